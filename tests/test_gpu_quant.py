"""The GPU kernels on quantized weights as stored (engine.kernels.gpu_quant), run by the Triton
interpreter on the CPU (TRITON_INTERPRET=1, set before triton is imported; on CUDA the same
tests run there): every format's lookups equal gguf's own dequantization (the checkpoint's
formula for AWQ/GPTQ's int4) bit for bit, the linear equals the activations times that weight
at 1, 2, 5, 8 and 16 rows and beyond, and a row's bits are the same alone and in a batch."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from engine.kernels import gpu_quant  # noqa: E402
from engine.kernels.gpu_quant import BLOCKS, INT4_ZP  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(gpu_quant.device_refusal(torch.device(DEVICE)) is not None,
                                reason=f"the GPU kernels do not run here: {gpu_quant.device_refusal(torch.device(DEVICE))}")

OUT, IN = 48, 512               # 48 outputs: a whole tile of 32 and a part one
ROW_COUNTS = (1, 2, 5, 8, 16)
FULL = 37                       # more than two tiles of 16 rows, the last one partial


def _k():
    from engine.kernels import gpu_quant_linear
    return gpu_quant_linear


@pytest.fixture(scope="module", params=[*BLOCKS, INT4_ZP])
def weight(request):
    """A weight of random blocks in each format (random bytes, fp16 scales small and finite)."""
    return _k().random_weight(request.param, OUT, IN, torch.Generator().manual_seed(7), group=128).to(DEVICE)


def _reference(w: gpu_quant.StoredWeight) -> torch.Tensor:
    """The weight as gguf.quants.dequantize gives it; AWQ/GPTQ's (q - z) * s from the layout."""
    if w.fmt == INT4_ZP:
        data = w.data.cpu()
        runs = data.view(OUT, IN // 32, 16)
        q = torch.cat([runs & 15, runs >> 4], dim=-1).reshape(OUT, IN).float()
        z = w.zeros.cpu().float().repeat_interleave(w.group, dim=1)
        s = w.scales.cpu().float().repeat_interleave(w.group, dim=1)
        return (q - z) * s
    raw = w.data.cpu().numpy().reshape(-1)
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[w.fmt]).reshape(OUT, IN).copy())


def test_each_formats_rows_are_ggufs_own_dequantization_bit_for_bit(weight):
    want = _reference(weight)
    assert torch.equal(_k().dequantize(weight).cpu(), want)
    ids = torch.tensor([5, 0, 47, 5])
    assert torch.equal(gpu_quant.rows(weight, ids.to(DEVICE)).cpu(), want[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_linear_is_the_activations_times_the_stored_weight_at_every_row_count(weight, dtype):
    """fp32 sums of exact products: in fp32 within summation order of x @ W^T; in bf16 / fp16
    within the output's rounding (the weight is never rounded to the activations' dtype)."""
    w = _reference(weight)
    x = torch.randn(FULL, IN, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = x.float() @ w.t()
    full = gpu_quant.linear(x.to(DEVICE), weight).cpu()
    assert full.dtype == dtype
    rounding = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert (full.float() - want).abs().max() <= 4 * rounding * want.abs().max() + 1e-5
    for n in ROW_COUNTS:
        alone = gpu_quant.linear(x[:n].to(DEVICE), weight).cpu()
        assert torch.equal(alone, full[:n]), f"{weight.fmt}: {n} rows round differently from {FULL}"
    # a row's bits do not depend on its neighbours' values or its place in the batch
    shuffled = torch.cat([x[3:4], torch.randn(4, IN, generator=torch.Generator().manual_seed(2)).to(dtype)])
    assert torch.equal(gpu_quant.linear(shuffled.to(DEVICE), weight).cpu()[0], full[3])


def test_a_bias_is_added_in_fp32_before_the_output_is_rounded():
    w = _k().random_weight("Q4_K", OUT, 256, torch.Generator().manual_seed(3)).to(DEVICE)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(OUT, generator=torch.Generator().manual_seed(5))
    got = gpu_quant.linear(x.to(DEVICE), w, bias.to(DEVICE)).cpu()
    want = x @ _k().dequantize(w).cpu().t() + bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_layouts_bytes_are_the_files_and_int4_with_zero_points_holds_4_bits_and_its_scales():
    for fmt, layout in BLOCKS.items():
        w = _k().random_weight(fmt, OUT, IN, torch.Generator().manual_seed(0))
        assert w.nbytes == gpu_quant.stored_bytes(fmt, (OUT, IN)) == OUT * IN // 256 * gguf.GGML_QUANT_SIZES[
            gguf.GGMLQuantizationType[fmt]][1] * 256 // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]][0]
    w = _k().random_weight(INT4_ZP, OUT, IN, torch.Generator().manual_seed(0), group=128)
    assert w.nbytes == gpu_quant.stored_bytes(INT4_ZP, (OUT, IN), 128) == OUT * IN // 2 + OUT * 4 * 3


def test_shapes_the_kernel_cannot_take_are_refused_with_the_reason():
    assert "multiple of Q4_K's 256-value blocks" in gpu_quant.shape_refusal("Q4_K", (32, 320))
    assert "groups of a multiple of 32" in gpu_quant.shape_refusal(INT4_ZP, (32, 320), 20)
    assert "no GPU kernel reads IQ4_XS" in gpu_quant.shape_refusal("IQ4_XS", (32, 256))
    assert gpu_quant.refusal("Q4_K", (32, 256), torch.device(DEVICE), torch.int8) is not None


def test_the_kernels_are_refused_on_the_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "run on CUDA" in gpu_quant.device_refusal(torch.device("cpu"))


def test_the_trial_at_load_passes_here():
    for fmt in ("Q4_K", "Q6_K", INT4_ZP):
        assert gpu_quant.refusal(fmt, (64, 512), torch.device(DEVICE), torch.bfloat16, 128) is None


def test_an_awq_weight_in_the_gpu_layout_keeps_its_values():
    gen = torch.Generator().manual_seed(9)
    q, z = torch.randint(0, 16, (32, 256), generator=gen), torch.randint(0, 16, (32, 2), generator=gen)
    s = torch.rand(32, 2, generator=gen).half()
    w = gpu_quant.int4_zp_weight(q, z, s).to(DEVICE)
    want = (q.float() - z.float().repeat_interleave(128, 1)) * s.float().repeat_interleave(128, 1)
    assert torch.equal(_k().dequantize(w).cpu(), want)
    assert np.isclose(w.nbytes * 8 / q.numel(), 4 + 24 / 128)


# ---- a GGUF loaded as on a GPU ---------------------------------------------------------------
MIX = {"preset": "tiny", "hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4,
       "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2, "tie_word_embeddings": True}


def test_a_gguf_loads_in_its_stored_blocks_as_on_a_gpu_with_the_files_values(tmp_path, monkeypatch):
    """The loader serves every linear of a Q4_K_M file (Q4_K, Q6_K, Q5_0 and Q8_0 parts, a fused
    q/k/v of two types) in its stored blocks where the table's CUDA column says so, the tied
    embedding looked up in the head's blocks: every row the file's value bit for bit (rows in
    transformers' order, llama.cpp's q/k permutation undone), and a linear's product the float
    weight's. Run on the CPU by giving every device the table's CUDA column."""
    from engine.layers import quantized_linear
    from engine.loading import stored_formats
    from engine.loading.loader import load_model
    from engine.loading.synthetic_gguf import write_gguf
    path = write_gguf(tmp_path / "mix.gguf", MIX, "Q4_K_M")
    exact = load_model(str(path), dtype=torch.float32, weight_dtype="float")
    monkeypatch.setattr(stored_formats.StoredFormat, "on", lambda self, device: self.cuda)
    gpu = load_model(str(path), dtype=torch.float32, device=DEVICE)
    assert gpu.weights.quantized == gpu.weights.linears == 9
    assert set(gpu.weights.served) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert all(how.endswith("blocks as stored (GPU)") for how in gpu.weights.served.values())
    modules = dict(exact.model.named_modules())
    ids = torch.tensor([0, 1, 63, 64, 255])
    for name, m in gpu.model.named_modules():
        if getattr(m, "quant", None) is None:
            continue
        assert m.weight.is_meta and all(p.kernel == quantized_linear.TRITON for p in getattr(m.quant, "parts", [m.quant]))
        want = modules[name].weight
        assert torch.equal(quantized_linear.rows(m.quant, ids.to(DEVICE)).cpu(), want[ids]), name
    table = gpu.model.embed_tokens
    assert table.weight.is_meta and table.rows_from is gpu.model.lm_head.quant
    tokens = torch.tensor([[5, 49151, 300]])
    assert torch.equal(table(tokens.to(DEVICE)).cpu(), exact.model.embed_tokens(tokens))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    o_proj = gpu.model.layers[0].self_attn.o_proj
    torch.testing.assert_close(o_proj(x.to(DEVICE)).cpu(), exact.model.layers[0].self_attn.o_proj(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_an_awq_or_gptq_checkpoint_loads_with_its_zero_points_as_on_a_gpu(layout, tmp_path, monkeypatch):
    """AWQ and GPTQ linears in the GPU's int4 with zero points, packed a slice of rows at a time
    (a slice's scales and zeros land beside its values): every weight the checkpoint's
    (q - z) * s bit for bit, the fused parts in order."""
    from engine.loading import stored_formats, weight_quant
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    from tests.test_awq_gptq import GROUP, write_quantized
    folder, reference = write_quantized(write_checkpoint(tmp_path / "float", "tiny", seed=0), tmp_path / layout, layout)
    monkeypatch.setattr(stored_formats.StoredFormat, "on", lambda self, device: self.cuda)
    monkeypatch.setattr(weight_quant, "PART_ROWS", 32)
    monkeypatch.setattr(weight_quant, "PART_VALUES", 32 * 64)        # gate/up (2 x 128 rows) in slices of 32 rows
    loaded = load_model(str(folder), device=DEVICE)
    want = load_model(str(reference), weight_dtype="float")
    method = layout.upper()
    assert loaded.weights.served[method] == f"int4 zero-point groups as stored (GPU), group {GROUP}"
    for ours, theirs in zip(loaded.model.layers, want.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            linear = ours.get_submodule(name)
            assert linear.quant.kind == "int4 zero-point groups" and linear.weight.is_meta
            assert torch.equal(linear.dense_weight().cpu(), theirs.get_submodule(name).weight), name


def test_the_linear_is_one_opaque_op_in_a_compiled_graph_with_the_same_bits():
    """torch.compile (fullgraph, as a compiled step) records the kernel as one custom op."""
    w = _k().random_weight("Q4_K", 32, 256, torch.Generator().manual_seed(0)).to(DEVICE)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    compiled = torch.compile(lambda x: gpu_quant.linear(x, w) * 2, fullgraph=True)
    assert torch.equal(compiled(x), gpu_quant.linear(x, w) * 2)


_COMPILE_FOR_GPU = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels.gpu_quant_linear import _linear_kernel, _rows_kernel, FORMAT_IDS, LAYOUTS, WITH_MINIMUM

def build(fn, pointers, consts, arch):
    sig = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in fn.arg_names}
    triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})

for arch, formats in ((90, list(FORMAT_IDS)), (80, ["Q4_K", "Q6_K"])):
    for fmt in formats:
        lay, i = LAYOUTS[fmt], FORMAT_IDS[fmt]
        for x, dot in (("bf16", tl.bfloat16), ("fp16", tl.float16), ("fp32", tl.float32))[:3 if fmt == "Q4_K" else 1]:
            build(_linear_kernel, {"x_ptr": "*" + x, "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "b_ptr": "*" + x,
                  "y_ptr": "*" + x, "stride_xm": "i64", "stride_ym": "i64", "row_bytes": "i64"},
                  dict(FMT=i, VALUES=lay.values, BYTES=lay.bytes, SUB=lay.sub, HAS_MIN=fmt in WITH_MINIMUM,
                       HAS_BIAS=fmt == "Q4_K", DOT=dot, IEEE=x == "fp32", BLOCK_M=16, BLOCK_N=32), arch)
        build(_rows_kernel, {"ids_ptr": "*i64", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "out_ptr": "*fp32",
              "row_bytes": "i64"}, dict(FMT=i, VALUES=lay.values, BYTES=lay.bytes, SUB=lay.sub, BLOCK_T=16), arch)
print("compiled")
"""


def test_the_kernels_compile_for_gpu_targets():
    """What only the GPU compiler rejects, the interpreter misses: every format's linear and
    lookup compiled for sm_90 (and the K-quants for sm_80) to cubin with the ptxas in the
    triton wheel; no GPU needed."""
    import pathlib
    import subprocess
    import sys
    import triton
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_GPU], env=env, capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).parent.parent, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
