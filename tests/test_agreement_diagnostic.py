"""engine.bench.agreement's emulation of llama.cpp's activation rounding, which its diagnosis
rests on: Q8_0 blocks of 32 as gguf-py's bit-exact port of quantize_row_q8_0_ref gives them,
and Q8_K blocks of 256 scaled by the block's signed largest value, as quantize_row_q8_K_ref."""
import numpy as np
import torch

from engine.bench.agreement import fake_q8_0, fake_q8_K, vec_dot_rounding


def test_q8_0_rounding_is_llama_cpps():
    from gguf.quants import Q8_0
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(0)) * 3
    theirs = torch.from_numpy(Q8_0.dequantize(Q8_0.quantize(x.numpy())))
    same = (fake_q8_0(x) == theirs).float().mean()
    assert same > 0.9999            # x * (127 / amax) on x86 against x * (1 / d) in the reference: an ulp apart


def test_q8_K_scales_by_the_signed_largest_value_of_256():
    block = torch.zeros(1, 256)
    block[0, :4] = torch.tensor([-2.0, 2.0, 1.0, 0.5])      # the largest magnitude first, negative
    block[0, 4] = 0.01
    out = fake_q8_K(torch.cat([block, -block]))
    d = 2.0 / 127.0                                       # iscale = -127 / max = 63.5
    expected = torch.tensor([-127 * d, 127 * d, 64 * d, 32 * d, d])       # 63.5 -> 64 (ties to even)
    assert torch.allclose(out[0, :5], expected, rtol=1e-6)
    assert torch.allclose(out[1, :5], -expected, rtol=1e-6)  # the first of equal magnitudes, +2.0: mirrored
    assert np.isclose(float(out[0, 5:].abs().sum()), 0.0)


def test_each_stored_type_takes_llama_cpps_activation_type():
    assert vec_dot_rounding("Q6_K") is vec_dot_rounding("Q4_K") is fake_q8_K
    assert vec_dot_rounding("Q5_1") is vec_dot_rounding("Q8_0") is fake_q8_0
    assert vec_dot_rounding("F32") is None
