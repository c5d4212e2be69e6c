"""tqops' imports run one way (docs/design.md): a module imports only what stands on a floor below its own, no modules
import each other in a circle, and capture (``tqops.cudagraph``) knows nothing of a model. Read from the source with
ast, imports inside functions too, so nothing here runs the modules it reads."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

# Each unit is a module or subpackage of tqops ("" is tqops/__init__.py, the ops' public face), bottom floor first.
# A unit may import its own modules and the units of lower floors; units of one floor do not import each other.
FLOORS = (
    ("checks", "pdl", "quant", "cli"),
    ("formats", "norm"),
    ("kv", "linear", "deltanet"),
    ("attention",),
    ("device_constants",),
    ("",),
    ("graphs",),
    ("cudagraph",),
    ("models",),
    ("hf", "shipped"),
    ("train",),
    ("demo", "bench"),
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}
# Subpackages kept as top-level folders of the checkout (setuptools package-dir in pyproject.toml).
MAPPED = ("graphs", "models", "cudagraph")
# What a step function asks of a model: capture and replay take the step, never the model behind it.
MODEL_API = {"compute_logits", "propose", "attention_layers", "state_layers", "selects_in_step", "target_layer_ids",
             "layer_ids"}


def _folder(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # imports the parents, never the package itself
    return Path(spec.origin).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every tqops module: name -> (file, is a package's __init__.py)."""
    roots = [("tqops", _folder("tqops"))] + [(f"tqops.{name}", _folder(f"tqops.{name}")) for name in MAPPED]
    found = {}
    for package, folder in roots:
        for file in sorted(folder.rglob("*.py")):
            parts = list(file.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            found.setdefault(name, (file, is_package))
    return found


MODULES = _modules()


def _module_of(name: str):
    """The tqops module that an import of ``name`` runs last: ``name`` itself, else its nearest parent module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The tqops modules ``module`` imports, at its top or inside a function."""
    file, is_package = MODULES[module]
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            found.update(_module_of(alias.name) for alias in node.names if alias.name.split(".")[0] == "tqops")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "tqops":
                continue
            # `from package import name` runs the submodule `name` when there is one
            found.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else _module_of(source)
                         for alias in node.names)
    found.discard(None)
    found.discard(module)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_unit_stands_on_a_floor():
    unplaced = sorted({_unit(m) for m in MODULES} - set(FLOOR))
    assert not unplaced, f"place these tqops units in FLOORS (docs/design.md draws the order): {unplaced}"


def test_imports_run_one_way():
    back = sorted(f"{module} -> {target}" for module, targets in IMPORTS.items() for target in targets
                  if _unit(target) != _unit(module) and FLOOR.get(_unit(target), -1) >= FLOOR.get(_unit(module), -1))
    assert not back, "imports that run back up (or across one floor):\n" + "\n".join(back)


@pytest.mark.parametrize("low, high", [
    (("cli", "formats", "checks"), ("models", "train", "bench", "demo")),
    (("cudagraph",), ("models", "hf", "train", "shipped", "bench", "demo")),
    (("shipped",), ("train", "bench", "demo")),
])
def test_lower_floors_import_no_higher_one(low, high):
    taken = sorted(f"{module} -> {target}" for module, targets in IMPORTS.items() if _unit(module) in low
                   for target in targets if _unit(target) in high)
    assert not taken, "\n".join(taken)


def _circles() -> list[list[str]]:
    """The module graph's strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []
    for root in IMPORTS:
        if root in index:
            continue
        work = [(root, iter(sorted(IMPORTS[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(IMPORTS[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                circle = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    circle.append(member)
                    if member == node:
                        break
                if len(circle) > 1:
                    circles.append(sorted(circle))
    return circles


def test_no_modules_import_each_other_in_a_circle():
    assert not _circles()


def test_capture_knows_no_model():
    """cudagraph/ runs and keeps step functions over the forward context; building a step from a model is models'."""
    used = set()
    for module, (file, _) in MODULES.items():
        if _unit(module) != "cudagraph":
            continue
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in MODEL_API:
                used.add(f"{module}: .{node.attr}")
            elif isinstance(node, ast.keyword) and node.arg in MODEL_API:
                used.add(f"{module}: {node.arg}=")
            elif isinstance(node, ast.Constant) and node.value in MODEL_API:
                used.add(f"{module}: {node.value!r}")
    assert not used, sorted(used)
