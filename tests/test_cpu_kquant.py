"""K-quants read as stored (engine.kernels.cpu_kquant): Q4_K, Q5_K and Q6_K super-blocks repacked
into the kernel's tiles hold the file's bytes exactly, decode to gguf's own weights, and give,
on every instruction set this CPU runs and for every row count, the bits of the same weight
widened into 4- or 8-bit groups with fp32 scales (the arithmetic the kernel promises)."""
import gguf
import pytest
import torch

from engine import cpu_features
from engine.kernels import cpu_kquant, cpu_quant
from engine.layers import quantized_linear
from tests.kernels_required import every_test_needs

_needs_kernel = every_test_needs(cpu_kquant.refusal, "our K-quant CPU linear")
RUNNABLE = [isa for isa, needs in cpu_quant.NEEDS.items() if all(f in cpu_features.flags() for f in needs)]
BITS = [4, 5, 6]
GGML = {4: gguf.GGMLQuantizationType.Q4_K, 5: gguf.GGMLQuantizationType.Q5_K, 6: gguf.GGMLQuantizationType.Q6_K}
N, K = 48, 768


def _blocks(bits, seed=0):
    return cpu_kquant.random_blocks(N, K, bits, torch.Generator().manual_seed(seed))


def _widened(raw, bits):
    """The same weight as the 4- / 8-bit groups' (packed bytes, fp32 scales, bits, group):
    u as stored, d = d_sb * sc, m = -dmin * min (Q6_K: -32 d)."""
    f = cpu_kquant.decode(raw, bits)
    group = cpu_kquant.GROUP[bits]
    per = (K // group) // (K // cpu_kquant.SUPER)
    d = cpu_kquant._fp16_bytes(f["d"]).repeat_interleave(per, 1) * f["sc"].float()
    if bits == 6:
        m = -32 * d
    else:
        m = -(cpu_kquant._fp16_bytes(f["dmin"]).repeat_interleave(per, 1) * f["mn"].float())
    width = 4 if bits == 4 else 8
    w, scales = cpu_quant.pack(f["u"], d, m, width)
    return w, scales.float(), width, group


@pytest.mark.parametrize("bits", BITS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_super_blocks_keep_the_files_bytes_and_gguf_decodes_them_alike(bits):
    """Packing regroups the file's bytes (as many, and back again exactly), and the weight they
    hold is gguf's dequantization, bit for bit."""
    raw = _blocks(bits)
    w = cpu_kquant.pack(raw, bits)
    assert w.numel() == raw.numel() and w.shape == (N // 16, K // 256, 16 * cpu_kquant.BLOCK_BYTES[bits])
    assert torch.equal(cpu_kquant.blocks_of(w, bits), raw)
    oracle = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), GGML[bits]).reshape(N, K))
    assert torch.equal(cpu_kquant.unpack(w, bits), oracle)
    ids = torch.tensor([0, 17, 47, 3, 17])
    assert torch.equal(cpu_kquant.rows(w, bits, ids), oracle[ids])


@pytest.mark.parametrize("bits", BITS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_the_native_repacking_gives_the_reference_layouts_bytes(bits):
    """Our op (cpu_kquant_pack.cpp, what a load runs) writes the bytes the torch-op definition
    writes, on random blocks of every value and on a file's real rows; a shape it cannot tile
    is refused by name."""
    raw = _blocks(bits, seed=10 + bits)
    assert torch.equal(cpu_kquant.pack(raw, bits), cpu_kquant.pack_reference(raw, bits))
    from engine.loading.synthetic_gguf import quantize
    real = torch.from_numpy(quantize(torch.randn(32, 512).numpy() * 0.02, GGML[bits].name))
    assert torch.equal(cpu_kquant.pack(real, bits), cpu_kquant.pack_reference(real, bits))
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        cpu_kquant.pack(raw[:40], bits)


def test_without_our_library_the_repacking_falls_back_to_the_reference(monkeypatch):
    """Where the library did not build, a load repacks in torch ops: the same bytes, into a slice too."""
    raw = _blocks(4, seed=20)
    native = cpu_kquant.pack(raw, 4)
    monkeypatch.setattr(cpu_quant, "refusal", lambda: "no compiler here")
    assert torch.equal(cpu_kquant.pack(raw, 4), native)
    into = torch.zeros_like(native)
    cpu_kquant.pack(raw[16:32], 4, into[1:2])
    assert torch.equal(into[1:2], native[1:2]) and not into[0].any()


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", BITS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_each_row_is_the_widened_weights_bits_for_any_row_count(bits, dtype, isa):
    raw = _blocks(bits, seed=bits)
    w = cpu_kquant.pack(raw, bits)
    widened, scales, width, group = _widened(raw, bits)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = torch.ops.workbench_cpu.linear_q(x, widened, scales, None, width, group, cpu_quant.ISAS["scalar"])
    for rows in (1, 2, 3, 4, 5, 8, 9, 13, 19):
        assert torch.equal(cpu_kquant.linear(x[:rows], w, bits, isa), want[:rows]), rows


@pytest.mark.parametrize("bits", BITS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_a_served_k_quant_is_one_weight_of_the_files_bytes_with_its_bias(bits):
    """quantized_linear's form: the file's rows in, the file's bytes held, a bias added once."""
    raw = _blocks(bits, seed=7)
    kind = next(k for k, b in quantized_linear.KQUANTS.items() if b == bits)
    qw = quantized_linear.from_kquant(raw, kind, torch.float32)
    assert qw.nbytes == raw.numel() and qw.shape == (N, K)
    x, bias = torch.randn(3, K), torch.randn(N)
    got = quantized_linear.linear(x, qw, bias)
    assert torch.equal(got, quantized_linear.linear(x, qw, None) + bias)
    want = x @ quantized_linear.dequantize(qw).t() + bias
    assert torch.allclose(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())


def test_a_shape_the_kernel_cannot_take_is_refused_with_its_reason():
    assert cpu_kquant.packable((48, 768)) is None
    assert "not a multiple of the super-block 256" in cpu_kquant.packable((48, 320))
    assert "out_features 40" in cpu_kquant.packable((40, 768))
    with pytest.raises(RuntimeError, match="K-quant"):
        torch.ops.workbench_cpu.linear_q(torch.randn(1, K), cpu_kquant.pack(_blocks(4), 4)[:, :, :100],
                                         torch.empty(0), None, 4, 256, 0)
