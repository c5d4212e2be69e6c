"""Format registry, slot sizes, codebook and rotation."""
import math

import pytest
import torch

import tqops
from tqops.quant import lloyd_max, rotation_matrix, rotation_signs
from tqops.quant.codebook import gaussian_distortion

VLLM_SLOT_BYTES_D128 = {  # per token per kv head, K and V together
    "bf16": 512, "fp16": 512, "fp8_e4m3": 256, "fp8_e5m2": 256,
    "turboquant_k8v4": 196, "turboquant_4bit_nc": 134, "turboquant_k3v4_nc": 118, "turboquant_3bit_nc": 102,
}


def test_format_names():
    assert tqops.FORMATS == tuple(VLLM_SLOT_BYTES_D128)


@pytest.mark.parametrize("name", tqops.FORMATS)
def test_slot_bytes_match_vllm(name):
    assert tqops.get_format(name).slot_bytes(128) == VLLM_SLOT_BYTES_D128[name]


@pytest.mark.parametrize("name", tqops.FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_layout_fields_fit_and_fp16_fields_are_aligned(name, head_dim):
    fmt = tqops.get_format(name)
    assert fmt.key_bytes(head_dim) + fmt.value_bytes(head_dim) == fmt.slot_bytes(head_dim)
    if fmt.key_mode == "mse":
        assert fmt.key_norm_offset(head_dim) % 2 == 0
    if fmt.value_mode == "uniform":
        assert fmt.value_scale_offset(head_dim) % 2 == 0
    assert fmt.slot_bytes(head_dim) % 2 == 0


def test_get_format_passes_through_and_rejects_unknown():
    fmt = tqops.get_format("turboquant_4bit_nc")
    assert tqops.get_format(fmt) is fmt
    with pytest.raises(ValueError, match="turboquant_4bit_nc"):  # the message lists the valid names
        tqops.get_format("int4")
    with pytest.raises(AttributeError):
        fmt.name = "bf16"  # frozen


@pytest.mark.parametrize("name", [f for f in tqops.FORMATS if f.startswith("turboquant")])
def test_turboquant_rejects_other_head_dims(name):
    with pytest.raises(ValueError, match="head_dim=96"):
        tqops.get_format(name).slot_bytes(96)


@pytest.mark.parametrize("bits,expected", [(1, 0.363), (2, 0.118), (3, 0.0345), (4, 0.0095)])
def test_lloyd_max_distortion_matches_known_figures(bits, expected):
    assert gaussian_distortion(bits) == pytest.approx(expected, rel=0.01)


def test_lloyd_max_4bit_levels():
    centroids, bounds = lloyd_max(4)
    assert centroids[-1].item() == pytest.approx(2.7326, abs=1e-4)
    assert centroids[8].item() == pytest.approx(0.1284, abs=1e-4)
    assert torch.allclose(centroids, -centroids.flip(0))
    assert bool((bounds[1:] > bounds[:-1]).all())


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotation_is_orthogonal_and_deterministic(head_dim):
    rot_t = rotation_matrix(head_dim)
    eye = rot_t.double() @ rot_t.double().t()
    assert torch.allclose(eye, torch.eye(head_dim, dtype=torch.float64), atol=1e-6)
    assert rot_t.abs().unique().numel() == 1 and rot_t.abs()[0, 0].item() == pytest.approx(1 / math.sqrt(head_dim))
    assert torch.equal(rot_t, rotation_matrix(head_dim))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotation_signs_are_the_butterflys_sign_flips(head_dim):
    # sqrt(d) R^T = diag(signs) H, and H's first column is all ones: column 0 holds the signs.
    signs = rotation_signs(head_dim)
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert torch.equal(signs.float(), torch.round(rotation_matrix(head_dim)[:, 0] * head_dim**0.5))
