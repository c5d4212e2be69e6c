"""The shipped tokenizer loads with AutoTokenizer, round-trips code exactly, and training it is deterministic."""
import pytest

from tqops.train import corpus
from tqops.train.tokenizer import (FILES, SHIPPED_DIR, SPECIAL_TOKENS, VOCAB_SIZE, load_tokenizer, save_tokenizer,
                                   special_ids, train_tokenizer)

transformers = pytest.importorskip("transformers")

CODE = [
    "def f(x, *args, **kw):\n\tif x:  # tab-indented\r\n        return {'a': [1, 2.5e-3]}\n\n\n",
    "s = f'{x!r:>10}' + \"\\n\" + r'\\d+' + b'\\x00'.decode()  \n   \n",
    "π = 'ünïcödé ✓ 中文 🐍'\nclass _A_b9(object): pass",
    "",
    " leading space and trailing spaces   ",
]


def test_shipped_folder_loads_with_autotokenizer_and_round_trips():
    assert {p.name for p in SHIPPED_DIR.iterdir()} >= set(FILES)
    auto = transformers.AutoTokenizer.from_pretrained(SHIPPED_DIR)
    tok = load_tokenizer()
    assert len(auto) == tok.get_vocab_size() == VOCAB_SIZE
    assert [auto.eos_token, auto.pad_token, auto.mask_token] == list(SPECIAL_TOKENS)
    assert [auto.eos_token_id, auto.pad_token_id, auto.mask_token_id] == list(special_ids(tok).values()) == [0, 1, 2]
    texts = CODE + [f.text for f in corpus.read_heldout()[:6]]
    for text in texts:
        ids = auto(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(text).ids
        assert auto.decode(ids) == text
        assert tok.decode(ids) == text


def test_training_is_deterministic(tmp_path):
    texts = [f.text for f in corpus.iter_sources("train")][:40]
    for name in ("a", "b"):
        save_tokenizer(train_tokenizer(texts, vocab_size=600), tmp_path / name)
    for file in FILES:
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes()
    assert load_tokenizer(tmp_path / "a").get_vocab_size() == 600
