"""How the command lines report bad flags: one ``prog: error: ...`` line on stderr, exit status 2, no traceback."""
import pytest


def run_cli(main, argv, capsys) -> tuple:
    """``main(argv)``, which must exit: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


def assert_one_line_error(code, stderr: str, prefix: str, words: str) -> None:
    """Exit status 2 and a single stderr line that starts with ``prefix`` (``"<prog>: error: "``) and contains
    ``words``."""
    assert code == 2 and "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and ": error: " in lines[0], stderr
    assert words in lines[0]
