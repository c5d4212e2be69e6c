"""tools/attention_sweep.py: its config grid at the Qwen3.5 shape, and its sweep on a tiny shape under the Triton
interpreter (each alternative's output against the default's, the tables and the JSON; no timing is asserted)."""
import dataclasses
import importlib.util
import json
import math
import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from tqops.formats import get_format  # noqa: E402
from .fake_compile_worker import fake_compile_worker  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sweep_tool():
    spec = importlib.util.spec_from_file_location("attention_sweep", os.path.join(ROOT, "tools", "attention_sweep.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_shape_is_the_hybrid_targets(sweep_tool):
    from tqops.bench.hybrid import QWEN3_5_9B, SHAPES
    from tqops.models.generate import CACHE_BLOCK_SIZE

    shape = sweep_tool.Shape()
    assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim) == (
        QWEN3_5_9B["num_attention_heads"], QWEN3_5_9B["num_key_value_heads"], QWEN3_5_9B["head_dim"])
    assert shape.block_size == CACHE_BLOCK_SIZE and shape.context == SHAPES["qwen3.5-9b"][2]


@pytest.mark.parametrize("fmt_name", ["bf16", "turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("batch,q_len", [(8, 1), (1, 1), (8, 16), (1, 16)])
def test_grid_at_the_qwen_shape(sweep_tool, fmt_name, batch, q_len):
    from tqops.attention.launch import launch_config

    t, fmt, shape, grid = sweep_tool, get_format(fmt_name), sweep_tool.Shape(), sweep_tool.Grid()
    n_blk = shape.context // shape.block_size

    def base(block_q=None):
        return launch_config(batch * q_len, batch, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                             shape.block_size, n_blk, 132, fmt, block_q)

    default = t.full_config(base())
    cap = int(grid.max_configs * grid.stage1_share) - 1
    keep, pruned = t.stage1_configs(base, fmt, q_len, shape.head_dim, grid, cap)
    assert 0 < len(keep) <= cap
    keys = [t.effective_key(c, fmt) for c in keep]
    assert len(set(keys)) == len(keys) and t.effective_key(default, fmt) not in keys  # no config twice
    group_pad = base()["group_pad"]
    for cfg in keep:
        assert cfg["block_n"] in grid.block_ns and cfg["num_warps"] in grid.warps
        assert cfg["num_splits"] & (cfg["num_splits"] - 1) == 0 and 1 <= cfg["num_splits"] <= 128
        assert t.est_regs(cfg, shape.head_dim, group_pad) <= grid.max_est_regs
    assert all(p["reason"] for p in pruned)
    # the default tile at twice the splits is tried where the splits allow it; at q_len 16 a 32-row query tile too
    if 2 * default["num_splits"] <= 128 and shape.context // (2 * default["num_splits"]) >= 256:
        assert any(c["block_n"] == default["block_n"] and c["num_warps"] == default["num_warps"]
                   and c["num_splits"] == 2 * default["num_splits"] and c["block_q"] == default["block_q"]
                   for c in keep)
    if q_len > 1:
        assert any(t.block_m(c, group_pad) == 32 for c in keep)
    variants = t.stage2_variants(default, fmt, shape.head_dim, group_pad, grid)
    assert {t.label(v, fmt, q_len) for v in variants} - {t.label(default, fmt, q_len)}
    # every override the tool passes is a keyword of paged_attention_triton
    import inspect

    from tqops.attention.triton_paged import paged_attention_triton

    params = inspect.signature(paged_attention_triton).parameters
    assert set(t.overrides_of(dict(default, maxnreg=128))) <= set(params)


def test_sweep_interpreted(sweep_tool, tmp_path):
    from tests.attention.interp import launch_config, paged_attention_interpreted

    shape = sweep_tool.Shape(num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, context=64)
    explicit = {
        "bf16": [dict(block_n=16, num_splits=2), dict(block_n=32, prefetch=True, num_splits=4)],
        "turboquant_4bit_nc": [dict(block_n=16, num_splits=2, prefetch=False, ids_ahead=False),
                               dict(block_n=32, prefetch=True), dict(block_n=16, value_halves=True, pair_asm=False)],
    }
    out = tmp_path / "sweep.json"
    sweep = sweep_tool.run_sweep(["bf16", "turboquant_4bit_nc"], batches=[1], q_lens=[1, 2], shape=shape,
                                 device="cpu", explicit=explicit, dtype=torch.float32,
                                 attention=paged_attention_interpreted, launch=launch_config, timer="cpu",
                                 max_sets=1, out_path=str(out), log=None)
    assert len(sweep.cases) == 4
    for case in sweep.cases:
        rows = case["rows"]
        assert rows[0]["stage"] == "default" and len(rows) == 1 + len(explicit[case["fmt"]])
        assert rows[0]["ref_rel"] < 1e-3  # the default against the torch reference
        for row in rows:
            assert "error" not in row, row
            assert row["ok"] and row["max_diff"] < 1e-3 and row["us"] > 0
        assert rows[0]["max_diff"] == 0
        labels = {r["config"] for r in rows}
        assert len(labels) == len(rows)
        table = sweep.table(case)
        assert table.startswith(f"### {case['fmt']}, batch 1, q_len {case['q_len']}")
        lines = [line for line in table.splitlines() if line.startswith("| ")]
        assert lines[0].split("|")[1].strip() == "config" and len(lines) == 1 + len(rows)
        assert {line.split("|")[1].strip() for line in lines[1:]} == labels
    assert [(s["batch"], s["q_len"]) for s in sweep.summary] == [(1, 1), (1, 2)]
    for s in sweep.summary:
        assert s["bf16 best / bf16 default"] <= 1 and math.isfinite(s["turboquant_4bit_nc best / bf16 default"])
    assert "### Summary" in sweep.markdown()
    report = json.loads(out.read_text())
    assert report["shape"] == dataclasses.asdict(shape) and len(report["cases"]) == 4
    assert report["cases"][0]["rows"][1]["overrides"]["block_n"] == 16


def test_compile_pool_replaces_broken_workers(sweep_tool):
    import time

    pool = sweep_tool.CompilePool(2, target=fake_compile_worker)
    try:
        kinds = [{}, {"fatal": True}, {}, {"die": True}, {}, {}, {"fatal": True}, {}]
        tasks = [dict(id=i, overrides=o) for i, o in enumerate(kinds)]
        # a budget no loaded machine reaches: only the late run below is out of time
        done = pool.run(tasks, stop_at=time.monotonic() + 900, desc="fake compile")
        assert sorted(done) == list(range(len(kinds)))
        assert done[3]["error"].startswith("worker died")
        assert all(done[i].get("regs") == i for i in range(len(kinds)) if i != 3), done
        assert all(w["proc"].is_alive() for w in pool.workers)  # the broken ones were replaced
        late = pool.run([dict(id=9, overrides={})], stop_at=time.monotonic() - 1, desc="fake compile")
        assert late == {9: dict(error="not compiled: time budget")}
    finally:
        pool.close()
    assert not any(w["proc"].is_alive() for w in pool.workers)
