"""The split rule is a pure function of the stdlib-relative path; splits are disjoint; the committed file follows it."""
import json

import pytest

from tqops.train import corpus


def test_bucket_is_a_fixed_hash_of_the_path():
    # pinned: a change of the rule would silently move files between training and evaluation
    assert [corpus.bucket(p) for p in ("json/decoder.py", "os.py", "turtle.py", "unittest/mock.py")] == [93, 92, 2, 2]
    assert corpus.split_of("turtle.py") == "heldout" and corpus.split_of("os.py") == "train"
    counts = {s: 0 for s in ("heldout", "valid", "train")}
    for i in range(2000):
        counts[corpus.split_of(f"pkg/module_{i}.py")] += 1
    assert 0.02 < counts["heldout"] / 2000 < 0.06 and 0.015 < counts["valid"] / 2000 < 0.05


@pytest.fixture
def fake_stdlib(tmp_path):
    files = {
        "os.py": "import sys\n", "json/decoder.py": "x = 1\n", "turtle.py": "y = 2\n" * 3,
        "unittest/mock.py": "line\n" * 10,
        "test/test_os.py": "t\n", "ctypes/test/test_x.py": "t\n", "lib2to3/tests/a.py": "t\n",
        "idlelib/idle_test/b.py": "t\n", "site-packages/pkg/c.py": "t\n", "__pycache__/d.py": "t\n",
        "config-3.11-x86_64-linux-gnu/python-config.py": "t\n", "_sysconfigdata__linux.py": "t\n",
        "encodings/cp999.py": "# generated with gencodec.py\n", "latin.py": b"\xff\xfe",
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return tmp_path


def test_exclusions_and_disjoint_splits(fake_stdlib):
    paths = [f.path for f in corpus.iter_sources(root=fake_stdlib)]
    assert paths == ["json/decoder.py", "os.py", "turtle.py", "unittest/mock.py"]
    by_split = {s: [f.path for f in corpus.iter_sources(s, root=fake_stdlib)] for s in ("train", "valid", "heldout")}
    assert sorted(sum(by_split.values(), [])) == paths
    assert by_split["heldout"] == ["turtle.py", "unittest/mock.py"]


def test_heldout_file_is_capped_and_sorted(fake_stdlib, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "HELDOUT_CHARS", 12)
    out = tmp_path / "heldout.jsonl"
    written = corpus.write_heldout(out, root=fake_stdlib)
    assert [(f.path, f.text) for f in corpus.read_heldout(out)] == [(f.path, f.text) for f in written]
    assert [f.text for f in written] == ["y = 2\ny = 2\n", "line\nline\n"]  # cut at the last newline within 12


def test_committed_heldout_file_follows_the_rule():
    files = corpus.read_heldout()
    assert corpus.HELDOUT_FILE.stat().st_size < 400_000
    assert len(files) >= 20 and [f.path for f in files] == sorted(f.path for f in files)
    assert all(corpus.split_of(f.path) == "heldout" for f in files)
    assert all(0 < len(f.text) <= corpus.HELDOUT_CHARS and f.text.endswith("\n") for f in files)
    # the local stdlib's train split never contains a held-out path
    with open(corpus.HELDOUT_FILE) as f:
        assert all(set(json.loads(line)) == {"path", "text"} for line in f)
    assert not {f.path for f in files} & set(p for p in corpus.source_paths() if corpus.split_of(p) == "train")
