"""The kernel-count summary of a captured step's profile (the profile itself needs CUDA)."""
import pytest

from tqops.bench.kernels import bench_kernels, summarize_kernels


def test_summary_counts_per_layer_and_ranks_by_time():
    kernels = [("gemm", 10.0), ("norm", 1.0), ("gemm", 12.0), ("attention", 30.0), ("norm", 1.5), ("rope", 0.5)]
    s = summarize_kernels(kernels, num_layers=2, top=2)
    assert s["kernels"] == 6 and s["kernels_per_layer"] == 3.0 and s["kernel_us"] == 55.0
    assert s["top"] == [dict(name="attention", launches=1, us=30.0), dict(name="gemm", launches=2, us=22.0)]
    assert s["attention_us"] == 0.0  # only the library's attention and combine kernels count
    marked = summarize_kernels([("_paged_attention_kernel", 7.0), ("_combine_splits_kernel", 1.5), ("gemm", 3.0)], 1)
    assert marked["attention_us"] == 8.5


def test_summary_keeps_one_middle_layers_launch_sequence():
    step = [("embed", 1.0)] + [(k, 1.0) for _ in range(4) for k in ("gemm", "_paged_attention_kernel", "norm")]
    s = summarize_kernels(step, num_layers=4)
    assert [name for name, _ in s["layer"]] == ["_paged_attention_kernel", "norm", "gemm"]
    assert summarize_kernels([("gemm", 1.0)], num_layers=1)["layer"] == []


def test_the_cuda_attention_kernel_counts_as_attention():
    # The TurboQuant decode calls run the CUDA kernel, whose profiled name is its template instance.
    cuda = "void turboquant_attention<1, 8, 2, true, 4, 4, false, 16>(unsigned short const*, int, int"
    step = [("embed", 1.0)] + [(k, 2.0) for _ in range(3) for k in ("gemm", cuda, "_combine_splits_kernel")]
    s = summarize_kernels(step, num_layers=3)
    assert s["attention_us"] == 12.0
    assert [name for name, _ in s["layer"]] == [cuda[:60], "_combine_splits_kernel", "gemm"]


def test_the_verify_kernel_counts_as_attention():
    verify = "void turboquant_verify<true>(unsigned short const*, int, int, unsigned char const*"
    step = [("gemm", 3.0), (verify, 20.0), ("_combine_splits_kernel", 1.0), ("gemm", 3.0), (verify, 20.0)]
    assert summarize_kernels(step, num_layers=2)["attention_us"] == 41.0


def test_an_unknown_step_is_refused_before_any_work():
    with pytest.raises(ValueError, match="step: expected one of .*'decode', 'verify', 'draft'.*got 'prefill'"):
        bench_kernels(step="prefill")
