"""The held-out prompt rule: a window of one held-out file, cut at its first line start at or after the longest
context, files too short skipped, path order; every context shares the cut."""
import pytest

from tqops.train import corpus
from tqops.train.heldout import heldout_windows
from tqops.train.tokenizer import SHIPPED_DIR, load_tokenizer

LONGEST, NEW = 48, 16


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SHIPPED_DIR)


def first_cut(tok, text: str, longest: int, new_tokens: int):
    """The file's ids and the index of its first token at or after ``longest`` whose text begins with a line break and
    leaves ``new_tokens`` tokens from it (None if there is none)."""
    enc = tok.encode(text)
    starts = [i for i, (a, b) in enumerate(enc.offsets) if text[a:b].startswith("\n") and i >= longest]
    return enc.ids, next((i for i in starts if i + new_tokens <= len(enc.ids)), None)


def test_a_window_is_its_file_around_the_first_line_start_after_the_longest_context(tok):
    files = {f.path: f.text for f in corpus.read_heldout()}
    windows = heldout_windows(tok, 4, LONGEST, NEW)
    assert len(windows) == 4
    for w in windows:
        ids, cut = first_cut(tok, files[w.path], LONGEST, NEW)
        assert w.cut == LONGEST and w.ids == tuple(ids[cut - LONGEST:cut + NEW])
        continuation = list(w.ids[w.cut:])
        assert tok.decode(continuation[:1]).startswith("\n")
        assert w.continuation_bytes == len(tok.decode(continuation).encode("utf-8"))


@pytest.mark.parametrize("longest, new_tokens", [(128, 128), (1536, 128)])
def test_files_too_short_are_skipped_and_the_rest_kept_in_path_order(tok, longest, new_tokens):
    files = corpus.read_heldout()
    want = [f.path for f in files if first_cut(tok, f.text, longest, new_tokens)[1] is not None]
    assert [w.path for w in heldout_windows(tok, len(files), longest, new_tokens)] == want
    assert [w.path for w in heldout_windows(tok, 3, longest, new_tokens)] == want[:3]
    if longest > 1000:
        assert 0 < len(want) < len(files)  # the longest context leaves some committed files out


def test_a_file_without_a_line_start_in_range_is_skipped(tok, monkeypatch):
    one_line = "values = [" + ", ".join(map(str, range(LONGEST + NEW))) + "]\n"
    code = "".join(f"    x{i} = f({i})\n" for i in range(LONGEST))
    files = [corpus.SourceFile("a.py", "x = 1\n"), corpus.SourceFile("b.py", one_line),
             corpus.SourceFile("c.py", code), corpus.SourceFile("d.py", code)]
    monkeypatch.setattr(corpus, "read_heldout", lambda: files)
    assert [w.path for w in heldout_windows(tok, 4, LONGEST, NEW)] == ["c.py", "d.py"]
    assert [w.path for w in heldout_windows(tok, 1, LONGEST, NEW)] == ["c.py"]


def test_every_context_ends_at_the_same_cut(tok):
    contexts = (16, 32, LONGEST)
    for w in heldout_windows(tok, 2, LONGEST, NEW):
        continuation = list(w.ids[w.cut:])
        assert len(continuation) == NEW
        for c in contexts:
            assert len(w.prompt(c)) == c and w.sequence(c) == w.prompt(c) + continuation
            assert w.prompt(c) == w.prompt(LONGEST)[-c:]
