"""transformers' own Qwen3.5 in the hybrid benchmark, on CPU at a tiny shape: its directly filled cache is what a
prefill leaves, every timed step sees the same cache, and the rows and ratios come out; under the other installed
transformers too."""
import logging
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tqops.bench import __main__ as bench_cli  # noqa: E402
from tqops.bench import hybrid_hf  # noqa: E402
from tqops.bench.hybrid import QWEN3_5_9B, vs_transformers  # noqa: E402

# 4 layers: 3 Gated DeltaNet, then 1 gated full attention (full_attention_interval 4, as at 9B)
TINY = dict(QWEN3_5_9B, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
BATCH, CONTEXT, BLOCK = 2, 40, 4
CACHES = ("DynamicCache", "StaticCache")
# transformers of another version (its source on this path), for the same tests in a subprocess; skipped where absent
OTHER_TRANSFORMERS = os.environ.get("TQOPS_OTHER_TRANSFORMERS", "/tmp/tf517/stub:/tmp/tf517/src")


@pytest.fixture(scope="module")
def model():
    return hybrid_hf.hf_qwen3_5(TINY, "cpu", dtype=torch.float32)


def _filled(model, cache_name):
    cache = hybrid_hf.hf_cache(model, cache_name, CONTEXT, room=BLOCK)
    hybrid_hf.fill_hf_cache(model, cache, BATCH, CONTEXT)
    return cache


def _prefilled(model, cache_name, prompt):
    cache = hybrid_hf.hf_cache(model, cache_name, CONTEXT, room=BLOCK)
    hybrid_hf.hf_step(model, cache, prompt, 0)()
    return cache


def _states(cache):
    """Each layer's state tensors: (conv, recurrent) of a Gated DeltaNet layer, (keys, values) of an attention one."""
    return [(layer.conv_states[0], layer.recurrent_states[0]) if hasattr(layer, "recurrent_states")
            else (layer.keys, layer.values) for layer in cache.layers]


def _held(cache):
    """What the next step reads: every Gated DeltaNet state, and the K/V of the cached tokens (a StaticCache's tail
    past them is stale, written over by the next step)."""
    n = int(cache.get_seq_length())
    return [t if hasattr(layer, "recurrent_states") else t[..., :n, :]
            for layer, pair in zip(cache.layers, _states(cache)) for t in pair]


@pytest.mark.parametrize("cache_name", CACHES)
def test_filled_cache_holds_context_tokens_in_the_shapes_a_prefill_leaves(model, cache_name):
    cache = _filled(model, cache_name)
    assert int(cache.get_seq_length()) == CONTEXT
    kv_len = CONTEXT if cache_name == "DynamicCache" else CONTEXT + BLOCK
    conv_dim = 2 * 2 * 16 + 4 * 16
    expected = [((BATCH, conv_dim, 4), (BATCH, 4, 16, 16))] * 3 + [((BATCH, 1, kv_len, 32),) * 2]
    assert [tuple(t.shape for t in pair) for pair in _states(cache)] == expected
    assert [layer.has_previous_state[0] for layer in cache.layers[:3]] == [True] * 3
    prompt = torch.randint(0, TINY["vocab_size"], (BATCH, CONTEXT))
    prefilled = _prefilled(model, cache_name, prompt)
    assert [type(layer) for layer in prefilled.layers] == [type(layer) for layer in cache.layers]
    for ours, theirs in zip(_states(cache), _states(prefilled)):
        assert [(t.shape, t.dtype) for t in ours] == [(t.shape, t.dtype) for t in theirs]
    assert int(prefilled.get_seq_length()) == CONTEXT


@pytest.mark.parametrize("cache_name", CACHES)
def test_decode_from_the_filled_cache_is_the_prefilled_models(model, cache_name):
    torch.manual_seed(1)
    prompt, token = torch.randint(0, TINY["vocab_size"], (BATCH, CONTEXT + 1)).split([CONTEXT, 1], dim=1)
    prefilled, filled = _prefilled(model, cache_name, prompt), _filled(model, cache_name)
    for ours, theirs in zip(_states(filled), _states(prefilled)):  # the prefill's states, in the filled layout
        for a, b in zip(ours, theirs):
            a.copy_(b)
    decoded = hybrid_hf.hf_step(model, filled, token, CONTEXT)()
    torch.testing.assert_close(decoded, hybrid_hf.hf_step(model, prefilled, token, CONTEXT)(), rtol=0, atol=0)
    with torch.no_grad():  # and the positions are the prompt's continuation: one forward over all of it
        whole = model(input_ids=torch.cat([prompt, token], 1)).logits[:, -1:]
    torch.testing.assert_close(decoded, whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cache_name", CACHES)
@pytest.mark.parametrize("q_len", [1, BLOCK])
def test_every_timed_step_sees_the_same_cache(model, cache_name, q_len):
    cache = _filled(model, cache_name)
    before = [t.clone() for t in _held(cache)]
    restore = hybrid_hf.restorer(cache)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, q_len))
    step = hybrid_hf.hf_step(model, cache, ids, CONTEXT)
    first = step().clone()
    assert int(cache.get_seq_length()) == CONTEXT + q_len
    assert hybrid_hf.time_step(step, restore, reps=2, warmup=1) > 0
    assert int(cache.get_seq_length()) == CONTEXT
    for now, then in zip(_held(cache), before, strict=True):
        torch.testing.assert_close(now, then, rtol=0, atol=0)
    torch.testing.assert_close(step(), first, rtol=0, atol=0)


def test_rows_on_cpu_are_eager_and_positive():
    rows = hybrid_hf.bench_hybrid_hf(TINY, CONTEXT, batches=(1, BATCH), block=BLOCK, shape="tiny", device="cpu",
                                     dtype=torch.float32, reps=2)
    assert [r["batch"] for r in rows] == [1, BATCH]
    for r in rows:  # compiled runs only on CUDA (reduce-overhead's CUDA graphs)
        assert r["format"] == "transformers (fp32, StaticCache, eager)" and r["mode"] == "eager"
        assert r["hf_decode_ms"] > 0 and r["hf_verify_ms"] > 0 and r["shape"] == "tiny"
        assert r["gdn_kernels"] in ("fla", "torch")


def test_a_mode_that_fails_falls_back_with_a_warning_and_stays_out(monkeypatch, caplog, model):
    calls = []

    def timed(model, cache_name, compile, batch, *args):
        calls.append((cache_name, batch))
        if cache_name == "StaticCache":
            raise RuntimeError("no static cache here")
        return 1.0, 2.0

    monkeypatch.setattr(hybrid_hf, "time_hf_steps", timed)
    monkeypatch.setattr(hybrid_hf, "hf_qwen3_5", lambda *args: model)
    with caplog.at_level(logging.WARNING, logger=hybrid_hf.__name__):
        rows = hybrid_hf.bench_hybrid_hf(TINY, CONTEXT, batches=(1, 2), device="cpu")
    assert [r["format"] for r in rows] == ["transformers (bf16, DynamicCache, eager)"] * 2
    assert calls == [("StaticCache", 1), ("DynamicCache", 1), ("DynamicCache", 2)]
    assert "no static cache here" in caplog.text


def test_a_compiled_mode_says_what_it_compiled_to(monkeypatch):
    monkeypatch.setattr(hybrid_hf, "_compile_counts", lambda: (5, 1, 2))
    assert hybrid_hf._mode(False, (0, 0, 0)) == "eager"
    assert hybrid_hf._mode(True, (3, 1, 0)) == ('torch.compile(mode="reduce-overhead"): 2 graphs, 0 graph breaks, '
                                               "2 CUDA-graph skips")


def test_tqops_rows_against_transformers():
    rows = [dict(format=f, batch=b, decode_captured_ms=d * b, verify_captured_ms=2 * d * b, decode_floor_ms=0.5 * b)
            for f, d in (("bf16", 1.0), ("turboquant_4bit_nc", 1.5)) for b in (1, 8)]
    rows += [dict(format="transformers (bf16, StaticCache, compiled)", batch=b, hf_decode_ms=4.0 * b,
                  hf_verify_ms=16.0 * b) for b in (1, 8)]
    vs_transformers(rows)
    assert [r["decode vs transformers"] for r in rows[:4]] == [0.25, 0.25, 0.375, 0.375]
    assert [r["verify vs transformers"] for r in rows[:4]] == [0.125, 0.125, 0.1875, 0.1875]
    assert [r["decode/floor"] for r in rows[4:]] == [8.0, 8.0]


def test_e2e_includes_transformers_unless_told_not_to():
    parser, _ = bench_cli.make_parser()
    assert parser.parse_args(["e2e", "--shape", "qwen3.5-9b"]).no_transformers is False
    assert parser.parse_args(["e2e", "--shape", "qwen3.5-9b", "--no-transformers"]).no_transformers is True


@pytest.mark.slow  # a second pytest, importing torch and transformers again
def test_the_same_under_the_other_transformers():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([OTHER_TRANSFORMERS, root]))
    probe = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                           capture_output=True, text=True, env=env, cwd=root, timeout=120)
    version = probe.stdout.strip()
    if probe.returncode or version == transformers.__version__:
        pytest.skip(f"no other transformers on {OTHER_TRANSFORMERS!r}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                           "-k", "not other_transformers"], capture_output=True, text=True, env=env, cwd=root,
                          timeout=600)
    assert done.returncode == 0, f"transformers {version}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
