"""Our quantized CPU linear (engine.kernels.cpu_quant): each row's bits do not depend on how many
rows share the call nor on the instruction set (AVX-512 VNNI, AVX2, scalar), and the result is
the exact arithmetic it promises: activations rounded to int8 per block of 32, an integer dot
per weight group, the floats in order."""
import pytest
import torch

from engine import cpu_features
from engine.kernels import cpu_quant
from engine.layers import quantized_linear
from tests.kernels_required import every_test_needs

_needs_kernel = every_test_needs(cpu_quant.refusal, "our quantized CPU linear")
RUNNABLE = [isa for isa, needs in cpu_quant.NEEDS.items() if all(f in cpu_features.flags() for f in needs)]
FORMATS = [(4, 32), (8, 32), (8, 16)]


def _weight(bits, group, n=96, k=320, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16 if bits == 4 else 256, (n, k), generator=gen)
    d = (torch.rand(n, k // group, generator=gen) / 8 + 1e-3).half().float()
    m = (torch.randn(n, k // group, generator=gen) / 8).half().float()
    return u, d, m


def _int8_activations(x):
    """x rounded as the kernel rounds it: per row and block of 32, sx = amax / 127, q = round-even(x * 127 / amax)."""
    blocks = x.float().reshape(x.shape[0], -1, cpu_quant.XBLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q.double() * (amax / 127).double()).reshape(x.shape)


@pytest.mark.parametrize("bits,group", FORMATS, ids=["4bit", "8bit-g32", "8bit-g16"])
def test_any_row_count_gets_the_same_bits_on_every_instruction_set(bits, group):
    """1 row (decode), 5 to 8 (a verify pass: AVX-512 reads the tile once for all of them), 9
    and 13 to 15 (eight, then one or a one-pass group), 17 and 64 (groups of rows and a remainder)."""
    w, scales = cpu_quant.pack(*_weight(bits, group), bits)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 320, generator=gen) * torch.rand(320, generator=gen) * 4      # uneven channels, as in a model
    reference = torch.ops.workbench_cpu.linear_q(x, w, scales, None, bits, group, cpu_quant.ISAS["scalar"])
    for isa in RUNNABLE:
        for rows in (1, 2, 5, 6, 7, 8, 9, 13, 14, 15, 17, 64):
            got = torch.ops.workbench_cpu.linear_q(x[:rows], w, scales, None, bits, group, cpu_quant.ISAS[isa])
            assert torch.equal(got, reference[:rows]), f"{isa}, {rows} rows"


@pytest.mark.parametrize("bits,group", FORMATS, ids=["4bit", "8bit-g32", "8bit-g16"])
def test_the_result_is_the_int8_activations_times_the_exact_weights(bits, group):
    u, d, m = _weight(bits, group)
    w, scales = cpu_quant.pack(u, d, m, bits)
    exact = (u.double().view(96, -1, group) * d[..., None].double() + m[..., None].double()).view(96, 320)
    assert torch.equal(cpu_quant.unpack(w, scales, bits), exact.float())          # packing is lossless
    x = torch.randn(9, 320, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(96)
    want = _int8_activations(x) @ exact.t() + bias.double()
    for dtype in (torch.float32, torch.bfloat16):
        got = cpu_quant.linear(x.to(dtype), w, scales, bias.to(dtype), bits)
        assert got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2        # bf16: the input and the output rounded
        assert ((got.double() - want).abs().max() / want.abs().max()) < tolerance, dtype


def test_scales_are_fp16_only_where_that_is_exact():
    u, d, m = _weight(4, 32)
    assert cpu_quant.pack(u, d, m, 4)[1].dtype == torch.float16
    assert cpu_quant.pack(u, d + 1e-4 * torch.rand_like(d), m, 4)[1].dtype == torch.float32


def test_a_shape_the_kernel_cannot_tile_is_named():
    assert cpu_quant.packable((96, 320), 4, 32) is None
    assert "out_features 40" in cpu_quant.packable((40, 320), 4, 32)
    assert "in_features 48" in cpu_quant.packable((96, 48), 8, 16)
    assert "groups of 64" in cpu_quant.packable((96, 320), 8, 64)


def test_every_kind_runs_on_our_kernel_and_keeps_its_rows():
    """int4 groups, int8 groups and int8 per channel (its scale repeated per group, exactly)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=gen)
    q8 = torch.randint(-128, 128, (64, 128), generator=gen)
    weights = [quantized_linear.quantize_int4(w, torch.bfloat16), quantized_linear.quantize_int8(w, torch.float32),
               quantized_linear.from_int8_groups(q8, torch.rand(64, 8, generator=gen).half().float(), torch.bfloat16)]
    assert [qw.kernel for qw in weights] == [quantized_linear.OURS] * 3
    assert quantized_linear.check_rows(weights) is None
    q, scale = quantized_linear.int8_rtn(w)
    assert torch.equal(quantized_linear.dequantize(weights[1]), q.float() * scale[:, None])


def test_forcing_an_instruction_set_is_checked_and_undone():
    chosen = cpu_quant.isa()
    with pytest.raises(ValueError, match="unknown instruction set"):
        cpu_quant.force_isa("sse9")
    cpu_quant.force_isa(None)
    assert cpu_quant.isa() == chosen


def test_an_instruction_set_only_the_quantized_linear_has_leaves_the_other_ops_their_widest(monkeypatch):
    """WORKBENCH_CPU_ISA=avx_vnni forces our quantized linear; the float linear, which has no
    such path, keeps the widest it passed instead of refusing to serve."""
    from engine.kernels import cpu_linear
    monkeypatch.setenv(cpu_linear.ISA_ENV, "avx_vnni")
    chosen = {}
    assert cpu_linear.choose_isa(chosen, {"scalar": (), "avx2": ()}, lambda isa: None, "a float op") is None
    assert chosen["isa"] == "avx2"
    chosen = {}
    why = cpu_linear.choose_isa(chosen, {"scalar": (), "avx_vnni": ("no-such-flag",)}, lambda isa: None, "ours")
    assert "avx_vnni" in why and "did not pass" in why


def test_the_avx_vnni_code_is_tried_only_where_the_cpu_has_it():
    """The 256-bit VNNI code runs in its VEX form (AVX-VNNI) only on a CPU with the flag, and in
    AVX-512 VL's form only with AVX-512 VNNI: a CPU without either never runs it."""
    assert "avx_vnni" in cpu_quant.NEEDS["avx_vnni"] and "avx512_vnni" in cpu_quant.NEEDS["avx512vl_vnni"]
    assert ("avx_vnni" in RUNNABLE) == ("avx_vnni" in cpu_features.flags())
    if "avx512_vnni" in cpu_features.flags() and "avx512vl" in cpu_features.flags():
        assert cpu_quant._trial("avx512vl_vnni") is None


def test_a_graph_names_registered_weights_by_index_and_gets_their_bits():
    """The compiled step's call (linear_at: a model's weights registered once, the step's in use
    per thread) gives what linear_q gives on the same tensors, for every format, 1 and 5 rows,
    with a bias; a call with nothing in use, a wrong index or width, or forgotten weights is
    refused with a message."""
    weights = [cpu_quant.pack(*_weight(bits, group, seed=i), bits) + (bits,) for i, (bits, group) in enumerate(FORMATS)]
    key = cpu_quant.register(weights)
    other = cpu_quant.register(weights[:1])
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(96, generator=gen)
    try:
        cpu_quant.use(key)
        isa = cpu_quant.ISAS[cpu_quant.isa()]
        for index, ((w, scales, bits), (_, group)) in enumerate(zip(weights, FORMATS)):
            for rows, dtype in ((1, torch.float32), (5, torch.bfloat16)):
                x = torch.randn(rows, 320, generator=gen).to(dtype)
                for b in (None, bias):
                    want = torch.ops.workbench_cpu.linear_q(x, w, scales, b, bits, group, isa)
                    assert torch.equal(cpu_quant.linear_at(x, index, 96, b), want)
        with pytest.raises(RuntimeError, match="no weight 3"):
            cpu_quant.linear_at(x, 3, 96, None)
        with pytest.raises(RuntimeError, match="another width"):
            cpu_quant.linear_at(x, 0, 64, None)
        cpu_quant.use(other)
        assert torch.equal(cpu_quant.linear_at(x, 0, 96, None), torch.ops.workbench_cpu.linear_q(
            x, weights[0][0], weights[0][1], None, 4, 32, isa))
    finally:
        cpu_quant.forget(key)
        cpu_quant.forget(other)
    with pytest.raises(RuntimeError, match="no model's weights in use"):
        cpu_quant.linear_at(x, 0, 96, None)
    with pytest.raises(RuntimeError, match="no weights registered"):
        cpu_quant.use(key)


@pytest.mark.parametrize("bits,group", FORMATS, ids=["4bit", "8bit-g32", "8bit-g16"])
def test_an_embedding_row_looked_up_in_packed_bytes_is_the_dequantized_row(bits, group):
    """A tied embedding is read from its head's packed bytes once a step (our op, embed_rows):
    the same fp32 bits as the torch expression and as unpack's whole table, fp16 and fp32 scales."""
    u, d, m = _weight(bits, group)
    for scales_dtype in (torch.float16, torch.float32):
        d_s = d if scales_dtype == torch.float16 else d * (1 + 2**-20)      # not an fp16 number: fp32 scales
        w, scales = cpu_quant.pack(u, d_s, m, bits)
        assert scales.dtype == scales_dtype
        ids = torch.tensor([0, 5, 17, u.shape[0] - 1, 31, 16])
        got = cpu_quant.rows(w, scales, bits, ids)
        assert torch.equal(got, cpu_quant.rows_reference(w, scales, bits, ids))
        assert torch.equal(got, cpu_quant.unpack(w, scales, bits)[ids])
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_quant.rows(w, scales, bits, torch.tensor([u.shape[0]]))
