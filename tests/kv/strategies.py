"""Hypothesis strategies shared by the cache tests."""
import torch
from hypothesis import strategies as st

import tqops

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@st.composite
def store_cases(draw, formats=tqops.FORMATS, max_heads=4, max_blocks=4):
    """A cache geometry, random K/V and a shuffled slot mapping with -1 holes."""
    name = draw(st.sampled_from(formats))
    fmt = tqops.get_format(name)
    head_dim = draw(st.sampled_from((64, 128, 256) if fmt.is_turboquant else (8, 40, 64, 128, 256)))
    num_kv_heads = draw(st.integers(1, max_heads))
    block_size = draw(st.sampled_from((16, 32, 64)))
    num_blocks = draw(st.integers(1, max_blocks))
    num_slots = num_blocks * block_size
    num_tokens = draw(st.integers(0, min(num_slots, 70)))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    holes = torch.rand(num_tokens, generator=gen) < draw(st.sampled_from((0.0, 0.3)))
    slot_mapping = torch.where(holes, -1, slots).to(draw(st.sampled_from((torch.int32, torch.int64))))
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    scale = draw(st.sampled_from((1.0, 0.25, 3.0)))
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * scale).to(dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * scale + 0.5).to(dtype)
    k_scale, v_scale = draw(st.sampled_from(((1.0, 1.0), (0.5, 2.0), (0.03, 0.07))))
    return dict(fmt=fmt, head_dim=head_dim, num_kv_heads=num_kv_heads, block_size=block_size, num_blocks=num_blocks,
                key=key, value=value, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale, seed=seed)


def fp8_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One fp8 ulp at the magnitude of x (float32)."""
    mant, min_exp = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}[dtype]
    exp = torch.floor(torch.log2(x.abs().clamp_min(2.0**min_exp))).clamp_min(min_exp)
    return torch.exp2(exp - mant)
