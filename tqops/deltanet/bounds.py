"""Sequence bounds inside the Gated DeltaNet kernels: query_start_loc clamped and made non-decreasing in place of a
torch pass (``ops._bounds``) before each launch."""
import triton
import triton.language as tl


@triton.jit
def sequence_start(qsl_ptr, b, num_tokens):
    """``cummax(clamp(query_start_loc, 0, num_tokens))[b]`` (int64): the first row of sequence b, exactly as
    ``ops._bounds`` makes it, so whatever the values no program reads or writes a row outside the inputs."""
    offs = tl.arange(0, 128)
    start = tl.zeros([], dtype=tl.int64)
    for j0 in range(0, b + 1, 128):
        vals = tl.load(qsl_ptr + j0 + offs, mask=j0 + offs <= b, other=0).to(tl.int64)
        start = tl.maximum(start, tl.max(tl.minimum(tl.maximum(vals, 0), num_tokens), 0))
    return start


@triton.jit
def sequence_end(qsl_ptr, b, start, num_tokens):
    """The end of sequence b (the start of b + 1) given its ``start``: ``cummax(clamp(...))[b + 1]``."""
    return tl.maximum(start, tl.minimum(tl.maximum(tl.load(qsl_ptr + b + 1).to(tl.int64), 0), num_tokens))
