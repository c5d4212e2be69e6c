"""The demo, the drafter stage's acceptance run and the acceptance study prompt with the same held-out tokens."""
import pytest

from tqops import demo
from tqops.bench import acceptance
from tqops.train import accept
from tqops.train.heldout import heldout_windows
from tqops.train.tokenizer import load_tokenizer
from .train.conftest import tiny_drafter, tiny_target  # noqa: F401  (pytest fixtures: the tiny trained pair)

PROMPTS, PROMPT_TOKENS, NEW = 2, 40, 10


class Stop(Exception):
    """Raised by the recording generate once it has the prompts: nothing after them is under test."""


def first_prompts(monkeypatch, module, run) -> list[list[int]]:
    """The prompts of the first ``timed_generate`` call ``run()`` makes through ``module``."""
    seen = []

    def record(target, prompts, *args, **kwargs):
        seen.append([list(p) for p in prompts])
        raise Stop

    monkeypatch.setattr(module, "timed_generate", record)
    with pytest.raises(Stop):
        run()
    return seen[0]


def test_demo_drafter_stage_and_study_give_the_same_prompt_tokens(tiny_target, tiny_drafter, monkeypatch):
    target, drafter = str(tiny_target[0]), str(tiny_drafter[0])
    got = {
        "demo": first_prompts(monkeypatch, demo, lambda: demo.main([
            "--target", target, "--draft", drafter, "--prompts", str(PROMPTS), "--prompt-tokens", str(PROMPT_TOKENS),
            "--max-new-tokens", str(NEW), "--rounds", "1", "--device", "cpu"])),
        "drafter stage": first_prompts(monkeypatch, accept, lambda: accept.measure_acceptance(
            target, drafter, prompts=PROMPTS, prompt_tokens=PROMPT_TOKENS, new_tokens=NEW)),
        "study": first_prompts(monkeypatch, acceptance, lambda: acceptance.bench_acceptance(
            target, drafter, formats=(), prompts=PROMPTS, contexts=(PROMPT_TOKENS,), new_tokens=NEW, device="cpu")),
    }
    tok = load_tokenizer(tiny_target[0])
    want = [w.prompt(PROMPT_TOKENS) for w in heldout_windows(tok, PROMPTS, PROMPT_TOKENS, NEW)]
    assert len(want) == PROMPTS and all(len(p) == PROMPT_TOKENS for p in want)
    assert got == dict.fromkeys(got, want)
    assert accept.heldout_prompts(tok, PROMPTS, PROMPT_TOKENS, new_tokens=NEW) == want
