"""The table of stored formats (engine.loading.stored_formats): how each format is served on
the CPU and on CUDA, and why; Q5_0 and Q5_1 served as stored in 5-bit groups (Q5_K widened: 8-bit) with a zero
point, exactly (gguf.quants.dequantize is the oracle) and in a whole model; Q8_0 and Q6_K
packed to the same bytes as before there was a zero point."""
import gguf
import numpy as np
import pytest
import torch

from engine.kernels import cpu_quant
from engine.layers import quantized_linear
from engine.layers.quantized_linear import GPU_INT4_ZP, INT4, INT5_GROUPS, INT8, INT8_GROUPS, Q4_K, Q5_K, Q6_K, gpu_blocks
from engine.loading import gguf_tensors, stored_formats
from engine.loading.loader import load_config, load_model, resolve
from engine.loading.stored_formats import FORMATS, format_of
from engine.loading.synthetic_gguf import recipe_type, write_gguf
from engine.loading.synthetic import make_config
from engine.loading.weight_quant import plan_linears
from engine.models.llama import Linear
from tests.conftest import our_logits
from tests.kernels_required import excused, skip_unless_runs

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 64, 256
# A small Llama in llama.cpp's Q5_K_M mix: ffn_down's rows (384) are not whole super-blocks, so
# they fall back (Q5_K -> Q5_1 in layers 0-1, Q6_K -> Q8_0 in layers 2-3); the tied embedding Q6_K.
MIX = {"preset": "tiny", "hidden_size": HIDDEN, "intermediate_size": 384, "num_attention_heads": HEADS,
       "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 4, "tie_word_embeddings": True}
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,), "Q8_0": (0,)}


def _kernel_refuses() -> str | None:
    return quantized_linear.unsupported(INT8_GROUPS, (HIDDEN, HIDDEN), CPU, torch.float32, 32)


# ---- the table ---------------------------------------------------------------------------
def test_every_stored_format_says_how_each_device_serves_it_and_why():
    """On the CPU: the K-quants in their super-blocks (widened to int4 / 8-bit groups where those
    cannot be read), the other 4-bit types and AWQ/GPTQ as int4 groups, Q5_0/Q5_1 as int5 groups,
    Q8_0 as 8-bit groups, MXFP4 dequantized; on CUDA every quantized format dequantized, each with its reason."""
    cpu = {name: f.on(CPU).form for name, f in FORMATS.items()}
    assert cpu == {"Q4_0": INT4, "Q4_1": INT4, "Q4_K": Q4_K, "Q5_0": INT5_GROUPS, "Q5_1": INT5_GROUPS,
                   "Q5_K": Q5_K, "Q6_K": Q6_K, "Q8_0": INT8_GROUPS, "MXFP4": None, "AWQ": INT4,
                   "GPTQ": INT4, "int4 at load": INT4, "int8 at load": INT8, "float": None, "F32": None,
                   "F16": None, "BF16": None}
    assert {name: f.group for name, f in FORMATS.items() if f.cpu.form} == {
        "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q5_0": 32, "Q5_1": 32, "Q5_K": 256, "Q6_K": 256, "Q8_0": 32,
        "AWQ": None, "GPTQ": None, "int4 at load": 32, "int8 at load": 0}     # None: the checkpoint's group_size
    assert {name: f.widened for name, f in FORMATS.items() if f.widened} == {
        "Q4_K": (INT4, 32), "Q5_K": (INT8_GROUPS, 32), "Q6_K": (INT8_GROUPS, 16)}
    cuda = {name: f.on(CUDA).form for name, f in FORMATS.items()}
    assert cuda == {**{name: gpu_blocks(name) for name in ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")},
                    "AWQ": GPU_INT4_ZP, "GPTQ": GPU_INT4_ZP, "MXFP4": None, "int4 at load": None, "int8 at load": None,
                    "float": None, "F32": None, "F16": None, "BF16": None}
    assert all(f.on(CUDA).why for f in FORMATS.values())
    assert FORMATS["Q5_K"].on(CUDA).why == "as stored: the file's blocks byte for byte, read by the Triton kernel"
    assert FORMATS["int8 at load"].on(CUDA).why == (
        "int8 weights quantized at load run on the CPU only (CUDA keeps them dequantized)")
    assert FORMATS["MXFP4"].on(CPU).why == FORMATS["MXFP4"].on(CUDA).why == "no MXFP4 kernel yet"
    assert {name for name, f in FORMATS.items() if f.zero} == {"Q5_0", "Q5_1", "Q5_K"}
    table = stored_formats.__doc__.splitlines()       # the docstring's table names every quantized row
    for name, f in FORMATS.items():
        if f.cpu.form:
            assert any(line.startswith(f"  {name.split()[0]} ") for line in table), name


def test_a_type_without_a_row_is_dequantized_and_named():
    for device in (CPU, CUDA):
        assert format_of("Q3_K").on(device) == stored_formats.Serving(None, "no kernel takes Q3_K")


def test_the_gguf_reader_decodes_exactly_the_types_the_table_serves():
    assert set(stored_formats.gguf_forms()) == set(gguf_tensors._DECODERS)


# ---- the decoders, on random blocks --------------------------------------------------------
def _random_blocks(kind: str, rows: int, blocks: int, rng) -> np.ndarray:
    """Random stored bytes [rows, blocks, block bytes], the fp16 fields finite."""
    nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        values = (rng.standard_normal((rows, blocks)) * 0.01).astype(np.float16)
        raw[..., at:at + 2] = values[..., None].view(np.uint8)
    return raw


def _form_weights(kind: str, decoded) -> torch.Tensor:
    """The float32 weights a decoded form holds, computed exactly (float64) and rounded once."""
    q, scale, *zero = (torch.from_numpy(np.ascontiguousarray(a)) for a in decoded)
    group = q.shape[1] // scale.shape[1]
    values = q.double().view(q.shape[0], -1, group) - (8 if FORMATS[kind].cpu.form == INT4 else 0)
    values = values * scale.double()[..., None] + (zero[0].double()[..., None] if zero else 0)
    return values.view(q.shape).float()


# Q4_K's int4 zero (8 d*sc - dmin*m) is one float32 rounding, exact for the blocks llama.cpp's
# quantizer makes but not for random bytes: tests/test_kquants.py checks it on quantized ones.
@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "Q4_0", "Q4_1", "Q6_K", "Q8_0"])
def test_random_blocks_decode_to_the_oracles_weights_exactly(kind):
    """Every bit pattern of the values (random bytes; finite fp16 scales), in the kernel's
    form: the same float32 numbers as gguf.quants.dequantize (a zero's sign aside)."""
    raw = _random_blocks(kind, 16, 8, np.random.default_rng(7))
    want = torch.from_numpy(gguf.quants.dequantize(raw.reshape(16, -1), gguf.GGMLQuantizationType[kind]))
    decoded = gguf_tensors._DECODERS[kind](raw)
    if FORMATS[kind].zero:
        assert decoded[0].dtype == np.uint8 and int(decoded[0].max()) <= 31 and len(decoded) == 3
    assert torch.equal(_form_weights(kind, decoded), want)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K"])
def test_q5_blocks_packed_for_our_kernel_hold_the_oracles_weights(kind):
    """Through the kernel's layout (Q5_0, Q5_1: 5-bit groups; Q5_K widened: 8-bit groups; u = q,
    w = d * u + m): unpacked, the oracle's weights; the kernel's output in fp32 matches x @ w;
    5 bits a weight held (6 with the scale and zero), not 8."""
    skip_unless_runs(_kernel_refuses(), "our quantized CPU linear")
    raw = _random_blocks(kind, 32, 512 // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0],
                         np.random.default_rng(11))
    want = torch.from_numpy(gguf.quants.dequantize(raw.reshape(32, -1), gguf.GGMLQuantizationType[kind]))
    q, scale, zero = (torch.from_numpy(np.ascontiguousarray(a)) for a in gguf_tensors._DECODERS[kind](raw))
    if kind == "Q5_K":
        qw = quantized_linear.from_int8_groups(q, scale, torch.float32, zero)
    else:
        qw = quantized_linear.from_int5_groups(q, scale, zero, torch.float32)
        assert qw.data.numel() == 32 * 512 * 5 // 8
    assert (qw.kind, qw.group_size, qw.shape) == (INT8_GROUPS if kind == "Q5_K" else INT5_GROUPS, 32, (32, 512))
    ids = torch.tensor([0, 31, 7, 7])
    assert torch.equal(quantized_linear.rows(qw, ids), want[ids])             # an embedding's lookups
    assert torch.equal(quantized_linear.dequantize(qw), want)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    reference = x @ want.t()
    got = quantized_linear.linear(x, qw, None)
    assert (got - reference).abs().max() <= 2e-2 * reference.abs().max()       # int8 activations per 32


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K"])
def test_q8_0_and_q6_k_pack_to_the_bytes_they_always_had(kind):
    """A zero point in the 8-bit form changes nothing for the types without one: u = q + 128,
    m = -128 d, byte for byte."""
    skip_unless_runs(_kernel_refuses(), "our quantized CPU linear")
    raw = _random_blocks(kind, 32, 1, np.random.default_rng(3))
    q, scale = (torch.from_numpy(np.ascontiguousarray(a)) for a in gguf_tensors._DECODERS[kind](raw))
    qw = quantized_linear.from_int8_groups(q, scale, torch.bfloat16)
    data, scales = cpu_quant.pack(q.to(torch.int16) + 128, scale, -128 * scale, 8)
    assert torch.equal(qw.data, data) and torch.equal(qw.scales, scales)


# ---- a whole Q5_K_M file ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def q5_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("q5") / "tiny-q5_k_m.gguf", MIX, "Q5_K_M")


def test_the_q5_k_m_recipe_is_q4_k_ms_with_q5_k():
    config = make_config(MIX)
    assert recipe_type("model.layers.1.self_attn.q_proj.weight", (256, 256), config, "Q5_K_M") == "Q5_K"
    assert recipe_type("model.layers.2.self_attn.v_proj.weight", (128, 256), config, "Q5_K_M") == "Q6_K"
    assert recipe_type("model.layers.1.mlp.down_proj.weight", (256, 384), config, "Q5_K_M") == "Q5_1"       # fallback
    assert recipe_type("model.embed_tokens.weight", (1000, 256), config, "Q5_K_M") == "Q6_K"


def test_a_q5_k_m_file_is_served_as_stored_with_the_files_weights(q5_file):
    """fp32, weight_dtype auto: every linear as stored (Q5_K and Q6_K in their super-blocks, Q5_1
    in 8-bit groups of 32), none read in float, each weight the file's exactly."""
    skip_unless_runs(_kernel_refuses(), "our quantized CPU linear")
    loaded = load_model(str(q5_file), dtype=torch.float32)
    exact = load_model(str(q5_file), dtype=torch.float32, weight_dtype="float")
    report = loaded.weights.as_dict()
    assert report["served"] == {"Q5_K": "Q5_K super-blocks as stored", "Q5_1": "int5 as stored (group 32)",
                                "Q6_K": "Q6_K super-blocks as stored", "Q8_0": "int8 as stored (group 32)"}
    assert (report["quantized_linears"], report["linears"]) == (4 * 4 + 1, 4 * 4 + 1)
    for (name, m), (_, want) in zip(loaded.model.named_modules(), exact.model.named_modules()):
        if isinstance(m, Linear):
            assert m.weight.is_meta and torch.equal(quantized_linear.dequantize(m.quant), want.dense_weight()), name


def test_q5_k_m_logits_stay_as_close_to_exact_as_bf16(q5_file):
    """As the Q4_K_M file's (tests/test_kquants.py): served as stored in bf16, within twice
    the dequantized bf16 model's error against the file's exact weights."""
    skip_unless_runs(_kernel_refuses(), "our quantized CPU linear")
    reference = our_logits(load_model(str(q5_file), dtype=torch.float32, weight_dtype="float")).float()
    stored = load_model(str(q5_file), dtype=torch.bfloat16)
    assert stored.weights.quantized == 17
    bf16 = load_model(str(q5_file), dtype=torch.bfloat16, weight_dtype="float")
    err_stored = (our_logits(stored).float() - reference).abs().max()
    err_bf16 = (our_logits(bf16).float() - reference).abs().max()
    assert err_stored <= 2 * err_bf16 + 1e-3 * reference.abs().max(), (float(err_stored), float(err_bf16))


def test_on_cuda_the_plan_serves_every_gguf_type_in_its_blocks_where_the_kernel_passed_its_trial(q5_file, monkeypatch):
    """The plan reads the table's CUDA column (no GPU is needed to plan): each linear in its
    parts' stored blocks where the GPU kernel passed its trial there; where it did not, each
    dequantized with the trial's reason; int4 at load stays a CPU form, and says so."""
    from engine.kernels import gpu_quant
    from engine.loading.gguf_tensors import GGUFTensors
    from engine.models import LlamaFamilyModel
    config = load_config(resolve(str(q5_file)))
    with torch.device("meta"):
        model = LlamaFamilyModel(config)
    stored = GGUFTensors(q5_file, config)
    monkeypatch.setattr(gpu_quant, "device_refusal", lambda device: None)       # as on a GPU
    monkeypatch.setattr(gpu_quant, "trial", lambda fmt, device, dtype: None)
    plans = plan_linears(model, "auto", CUDA, stored, torch.bfloat16)
    assert len(plans) == 17 and all(p.as_stored for p in plans)
    assert {form for p in plans for form, _ in p.forms} == {gpu_blocks(t) for p in plans for t in p.types}
    monkeypatch.setattr(gpu_quant, "trial", lambda fmt, device, dtype: f"the GPU {fmt} kernel gave wrong results here")
    failed = plan_linears(model, "auto", CUDA, stored, torch.bfloat16)
    assert not any(p.as_stored for p in failed)
    assert {p.why_not for p in failed} == {f"the GPU {t} kernel gave wrong results here" for p in failed for t in p.types[:1]}
    int4 = plan_linears(model, "int4", CUDA, stored, torch.bfloat16)
    assert {p.why_not for p in int4} == {"int4 weights quantized at load run on the CPU only (CUDA keeps them dequantized)"}


def test_a_part_of_a_type_without_a_row_dequantizes_its_linear_and_says_why():
    """A fused gate/up whose up is stored in a type no kernel takes (Q3_K): float, named."""
    from engine.models import LlamaFamilyModel

    class Stored:       # a quantized source: Q3_K up projections, every other tensor Q8_0
        def type_of(self, name):
            return "Q3_K" if name.endswith("up_proj.weight") else "Q8_0" if name.endswith("proj.weight") else None

    with torch.device("meta"):
        model = LlamaFamilyModel(make_config(MIX))
    plans = {p.name: p for p in plan_linears(model, "auto", CPU, Stored(), torch.float32)}
    gate_up = plans["layers.0.mlp.gate_up_proj"]
    assert gate_up.source_type == "Q3_K+Q8_0" and gate_up.why_not == "no kernel takes Q3_K" and not gate_up.as_stored
    assert plans["layers.0.self_attn.qkv_proj"].as_stored or excused(_kernel_refuses(), "our quantized CPU linear")


def test_a_fused_linear_of_q5_0_and_q8_0_parts_runs_each_as_stored(tmp_path):
    """Q4_K_M on a width that is not whole super-blocks (320): q, k fall back to Q5_0 and, in
    the layers use_more_bits picks, v to Q8_0. The Q5_0 parts are one 5-bit weight, a Q8_0 v
    its own 8-bit one beside it: the file's weights exactly."""
    skip_unless_runs(_kernel_refuses(), "our quantized CPU linear")
    path = write_gguf(tmp_path / "narrow-q4_k_m.gguf", {**MIX, "hidden_size": 320}, "Q4_K_M")
    loaded = load_model(str(path), dtype=torch.float32)
    exact = load_model(str(path), dtype=torch.float32, weight_dtype="float")
    assert loaded.weights.quantized == loaded.weights.linears == 17
    for i in (0, 2):
        qkv = loaded.model.layers[i].self_attn.qkv_proj
        kinds = [part.kind for part in getattr(qkv.quant, "parts", [qkv.quant])]
        assert qkv.quant.shape == (512, 320) and kinds in ([INT5_GROUPS], [INT5_GROUPS, INT8_GROUPS]), (i, kinds)
        want = exact.model.layers[i].self_attn.qkv_proj.dense_weight()
        assert torch.equal(quantized_linear.dequantize(qkv.quant), want), i
    assert [loaded.weights.served[t] for t in ("Q5_0", "Q8_0")] == ["int5 as stored (group 32)", "int8 as stored (group 32)"]
