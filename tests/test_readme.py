"""The README's two commands are what CI runs and what a new user needs; its examples run; the docs' links resolve and
the commands they show exist."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(path=README, lang=None):
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text()) if lang in (None, m.group(1))]


def _readme_commands():
    """The README's first code block, before any section: a bash block of exactly two commands."""
    text = README.read_text()
    first = FENCE.search(text)
    assert first is not None and first.group(1) == "bash", "the README opens with a bash block"
    assert "\n## " not in text[:first.start()], "the two commands come before the first section"
    lines = [line for line in first.group(2).splitlines() if line.strip()]
    assert len(lines) == 2, f"expected the two commands, got {lines}"
    return lines


def test_readme_opens_with_two_commands():
    assert README.read_text().splitlines()[0] == "# tqops"
    demo, tests = _readme_commands()
    assert demo.startswith("pip install ") and demo.endswith("python -m tqops.demo")
    assert tests.startswith("pip install ") and '".[test]"' in tests and tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    _, tests = _readme_commands()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_readme_examples_parse():
    for _, block in _blocks(lang="python"):
        compile(block, "README.md", "exec")


def test_readme_examples_run():
    """Every README example that needs no downloaded checkpoint runs as written."""
    blocks = [b for _, b in _blocks(lang="python") if "from_pretrained" not in b]
    assert len(blocks) >= 2
    for block in blocks:
        scope = {}
        exec(compile(block, "README.md", "exec"), scope)
        out = scope.get("out")
        if out is None:
            continue
        # Under NaN poisoning a read of a never-written slot shows up as NaN; an all-zero row means no key was seen.
        assert out.isfinite().all()
        assert (out.float().abs().sum(-1) > 0).all(), "a row attended to nothing"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lowercase, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set:
    text = FENCE.sub("", path.read_text())
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    """Every relative link and image of the docs names a file that exists, and a section it names exists there."""
    text = FENCE.sub("", doc.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: link to {target}: no such file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{doc.name}: link to {target}: no such section"


def test_paths_in_the_docs_exist():
    """Every repository path the docs name (``tools/...``, ``tests/...``, ``tqops/...`` and the other top folders)
    exists."""
    pattern = re.compile(r"(?<![\w/.])((?:tools|tests|tqops|models|graphs|cudagraph|docs)/[\w/.-]*\w)")
    for doc in DOCS:
        for path in pattern.findall(doc.read_text()):
            assert (ROOT / path).exists(), f"{doc.name}: {path} does not exist"


def _help(module: str, *args: str) -> str:
    run = subprocess.run([sys.executable, "-m", module, *args, "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_commands_in_the_docs_exist():
    """Each `python -m tqops.bench|train NAME` the docs show is a subcommand, and each flag shown with one (and with
    the demo) is one of its options."""
    text = "\n".join(doc.read_text() for doc in DOCS)
    helps = {}
    for module, name, rest in re.findall(r"python -m (tqops\.(?:bench|train|demo))\b ?([a-z][\w-]*)?([^`\n]*)", text):
        if module == "tqops.demo":
            name, rest = "", f"{name} {rest}"
        elif not name:
            continue
        key = (module, name)
        if key not in helps:
            helps[key] = _help(module, *([name] if name else []))
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest.split("#")[0]):
            assert flag in helps[key], f"python -m {module} {name}: no option {flag}"


@pytest.mark.parametrize("doc,limit", [("README.md", 200), ("BENCHMARKS.md", 300), ("docs/tuning.md", 300)])
def test_docs_stay_within_their_length(doc, limit):
    """The house's docs describe the present: the README, the current tables and the launch rules stay short."""
    lines = (ROOT / doc).read_text().count("\n")
    assert lines <= limit, f"{doc} has {lines} lines; keep it within {limit} (history lives in git log)"
