"""The forward context is per thread and per asyncio task, and each set_forward_context block restores exactly the
context it replaced: layers and whole generate calls running at once in two threads each get their single-threaded
result, and a block exited out of order raises instead of leaving its context current."""
import asyncio
import contextlib
import threading

import pytest
import torch

from tqops.graphs import Attention, ForwardContext, build_metadata, get_forward_context, set_forward_context
from tqops.models import DFlashDrafter, Qwen3ForCausalLM, generate

from ..models.fixtures import write_drafter, write_target

STEPS = 24
BLOCK = 16


def _context(tag: int) -> ForwardContext:
    meta = build_metadata(torch.tensor([1]), torch.tensor([tag]), torch.tensor([[0]]), BLOCK, 1)
    return ForwardContext({0: meta})


# ---- nesting and out-of-order exit ------------------------------------------------------------------------------

def test_nested_blocks_restore_the_context_they_replaced():
    a, b = _context(1), _context(2)
    with set_forward_context(a):
        with set_forward_context(b):
            with set_forward_context(a):  # the same context twice is two entries
                assert get_forward_context() is a
            assert get_forward_context() is b
        assert get_forward_context() is a
    with pytest.raises(RuntimeError, match="no forward context is set"):
        get_forward_context()


def test_an_outer_block_exited_first_raises_and_is_not_current_again():
    a, b = _context(1), _context(2)
    outer, inner = set_forward_context(a), set_forward_context(b)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="exited while a block entered inside it was still open"):
        outer.__exit__(None, None, None)
    assert get_forward_context() is b  # the inner block is still open
    inner.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="no forward context is set"):
        get_forward_context()  # neither is left current


def test_exit_stack_closing_out_of_order():
    a, b = _context(1), _context(2)
    with pytest.raises(RuntimeError, match="exited while a block entered inside it"):
        with contextlib.ExitStack() as stack:
            outer = stack.enter_context(contextlib.ExitStack())
            outer.enter_context(set_forward_context(a))
            stack.enter_context(set_forward_context(b))
            outer.close()  # a's block, while b's is open
    with pytest.raises(RuntimeError, match="no forward context is set"):
        get_forward_context()


def test_another_thread_starts_without_this_threads_context():
    seen = []

    def look():
        try:
            get_forward_context()
            seen.append("a context")
        except RuntimeError as e:
            seen.append(str(e))

    with set_forward_context(_context(1)):
        thread = threading.Thread(target=look)
        thread.start()
        thread.join()
    assert len(seen) == 1 and seen[0].startswith("no forward context is set")


# ---- two layers at once -----------------------------------------------------------------------------------------

def _layer(seed: int) -> Attention:
    layer = Attention(4, 2, 64, name=f"thread{seed}.attn", causal=True)
    layer.allocate_cache(4, BLOCK)
    layer.kv_cache.zero_()
    return layer


def _steps(seed: int, q_len: int, wait=lambda: None):
    """``STEPS`` decode steps of ``q_len`` tokens on a fresh layer of one sequence (blocks ``[seed, ...]``): the
    outputs and the final cache. ``wait`` runs inside each step's forward context, before the layer."""
    layer = _layer(seed)
    g = torch.Generator().manual_seed(seed)
    table = torch.tensor([[2 * seed, 2 * seed + 1]])  # 24 tokens: two blocks of 16
    outs = []
    for step in range(STEPS // q_len):
        meta = build_metadata(torch.tensor([q_len]), torch.tensor([(step + 1) * q_len]), table, BLOCK, q_len)
        q = torch.randn(q_len, 4, 64, generator=g)
        k, v = torch.randn(q_len, 2, 64, generator=g), torch.randn(q_len, 2, 64, generator=g)
        with set_forward_context(ForwardContext({0: meta})):
            wait()
            outs.append(layer(q, k, v))
    return torch.cat(outs), layer.kv_cache


def _in_threads(*calls):
    """Run ``calls`` in threads at once; their results, or the first exception re-raised here."""
    results, errors = [None] * len(calls), []

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def test_two_threads_run_their_own_layers_and_metadata_at_once():
    """Each thread's steps wait inside their forward context until the other thread is inside its own: with one
    process-wide context, one of them would read the other's metadata."""
    want = [_steps(0, 1), _steps(1, 2)]
    barrier = threading.Barrier(2, timeout=60)

    def wait():
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass  # the other thread has finished or failed

    def steps(seed, q_len):
        try:
            return _steps(seed, q_len, wait)
        finally:
            barrier.abort()

    got = _in_threads(lambda: steps(0, 1), lambda: steps(1, 2))
    for (out, cache), (want_out, want_cache) in zip(got, want):
        assert torch.equal(out, want_out) and torch.equal(cache, want_cache)


def test_two_asyncio_tasks_run_their_own_contexts():
    async def step(seed, q_len):
        outs = []
        layer = _layer(seed)
        g = torch.Generator().manual_seed(seed)
        for i in range(4):
            meta = build_metadata(torch.tensor([q_len]), torch.tensor([(i + 1) * q_len]), torch.tensor([[seed]]),
                                  BLOCK, q_len)
            q, k, v = torch.randn(q_len, 4, 64, generator=g), torch.randn(q_len, 2, 64, generator=g), \
                torch.randn(q_len, 2, 64, generator=g)
            with set_forward_context(ForwardContext({0: meta})):
                await asyncio.sleep(0)  # the other task enters its context here
                outs.append(layer(q, k, v))
        return torch.cat(outs)

    async def both():
        return await asyncio.gather(step(0, 1), step(1, 2))

    alone = [asyncio.run(step(0, 1)), asyncio.run(step(1, 2))]
    together = asyncio.run(both())
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


# ---- two models generating at once ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_pairs(tmp_path_factory):
    """Two different tiny targets, each with its DFlash drafter (block 4)."""
    pairs = []
    for seed in (0, 5):
        path = tmp_path_factory.mktemp(f"pair{seed}")
        target = Qwen3ForCausalLM.from_pretrained(write_target(path / "target", seed=seed), dtype=torch.float32)
        drafter = DFlashDrafter.from_pretrained(write_drafter(path / "drafter", seed=seed + 1), target=target)
        pairs.append((target, drafter))
    return pairs


PROMPTS = ([[5, 17, 42, 8, 33], [3, 61, 23]], [[7, 7, 1], [90, 2, 14, 60, 3, 8]])


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
def test_two_threads_generate_with_their_own_models_at_once(two_pairs, speculative):
    def run(i):
        target, drafter = two_pairs[i]
        return generate(target, PROMPTS[i], 24, drafter=drafter if speculative else None).tokens

    want = [run(0), run(1)]
    for _ in range(2):
        assert _in_threads(lambda: run(0), lambda: run(1)) == want
