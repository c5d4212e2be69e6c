"""The README's two commands are what CI runs and what a new user needs."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash")
    return lines[start + 1], lines[start + 2]


def test_readme_opens_with_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "# tqops" and lines[2] == "```bash" and lines[5] == "```"
    demo, tests = _readme_commands()
    assert demo.endswith("python -m tqops.demo")
    assert tests.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    _, tests = _readme_commands()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_readme_examples_run():
    """Every README example that needs no downloaded checkpoint runs as written."""
    import re

    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "from_pretrained" not in b]
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
