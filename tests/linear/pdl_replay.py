"""A captured chain of ops replayed with and without programmatic dependent launch (PDL)."""
import torch


def assert_pdl_changes_nothing(chain, monkeypatch, replays: int = 5) -> None:
    """``chain()`` captured as a CUDA graph under ``TQOPS_PDL=0`` and ``=1`` gives the same tensor on every replay.
    Each op reads the one before it, so a kernel that read or wrote before its PDL wait shows up as a difference."""
    results = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("TQOPS_PDL", pdl)
        chain()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        outs = []
        for _ in range(replays):
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        results[pdl] = outs
    for got in results["1"]:
        assert torch.equal(got, results["0"][0])
