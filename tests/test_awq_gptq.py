"""AWQ and GPTQ safetensors checkpoints: served as stored int4 (or dequantized, or int8), their
logits against the dequantized reference, and the checkpoints refused with a clear message.

The test checkpoints are the "tiny" synthetic model's linears quantized round-to-nearest to
int4 in groups of 32 (its hidden size is 64) and packed here as AutoAWQ's and AutoGPTQ's pack
functions write them; the reference is the same folder with those weights dequantized,
w = (q - z) * s, written as a float checkpoint and loaded with weight_dtype float."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError, UnsupportedModelError
from engine.layers import quantized_linear
from engine.loading.awq_gptq import AWQGPTQTensors, QuantizationConfig
from engine.loading.checkpoint import Checkpoint
from engine.loading.loader import load_model
from engine.loading.synthetic import write_checkpoint
from engine.models.eagle_head import weights_fingerprint
from engine.models.llama import Linear
from tests.conftest import forced_fallback, our_logits

GROUP = 32
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]       # AutoAWQ's WQLinear_GEMM: nibble i holds column 8c + order[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYOUTS = {     # name -> quantization_config, symmetric
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}, False),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True}, True),
    "gptq_v2": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                 "checkpoint_format": "gptq_v2"}, False),
}


def rtn_int4(w: torch.Tensor, group: int, symmetric: bool):
    """(q [out, in], z [out, in / group] integers 0..15, s [out, in / group] fp16), w ~ (q - z) * s."""
    g = w.float().reshape(w.shape[0], -1, group)
    if symmetric:           # GPTQ's sym: zero 8, scale over [-absmax, absmax]
        s = (2 * g.abs().amax(-1) / 15).clamp(min=1e-6).half()
        z = torch.full_like(s, 8, dtype=torch.int64)
    else:
        low, high = g.amin(-1), g.amax(-1)
        s = ((high - low) / 15).clamp(min=1e-6).half()
        z = (-low / s.float()).round().clamp(0, 15).long()
    q = (g / s.float()[..., None] + z[..., None]).round().clamp(0, 15).long()
    return q.reshape(w.shape), z, s


def dequantize(q, z, s, group):
    out = q.shape[0]
    return ((q.view(out, -1, group) - z[..., None]) * s.float()[..., None]).reshape(q.shape)


def pack_columns(v: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[r, 8c] integers 0..15 -> int32 [r, c], nibble i of column c holding value 8c + order[i]."""
    nibbles = v.numpy().astype(np.uint32).reshape(v.shape[0], -1, 8)[..., list(order)]
    packed = sum(nibbles[..., i] << np.uint32(4 * i) for i in range(8)).astype(np.uint32)
    return torch.from_numpy(np.ascontiguousarray(packed).view(np.int32))


def pack_rows(v: torch.Tensor) -> torch.Tensor:
    """[8r, c] -> int32 [r, c], nibble i of row r holding row 8r + i (GPTQ's qweight)."""
    return pack_columns(v.t().contiguous()).t().contiguous()


def packed_tensors(layout: str, w: torch.Tensor, group: int = GROUP):
    """The packed tensors of one linear w [out, in] and its dequantized weight."""
    symmetric = LAYOUTS[layout][1] if layout in LAYOUTS else False
    q, z, s = rtn_int4(w, group, symmetric)
    if layout == "awq":
        tensors = {"qweight": pack_columns(q.t(), AWQ_PACK_ORDER), "qzeros": pack_columns(z.t(), AWQ_PACK_ORDER)}
    else:
        stored_z = z - 1 if layout == "gptq" else z        # AutoGPTQ's format stores z - 1
        g_idx = torch.arange(w.shape[1], dtype=torch.int32) // group
        tensors = {"qweight": pack_rows(q.t()), "qzeros": pack_columns(stored_z.t()), "g_idx": g_idx}
    tensors["scales"] = s.t().contiguous()
    return tensors, dequantize(q, z, s, group)


def write_quantized(float_folder, folder, layout: str, config_changes: dict | None = None):
    """(quantized folder, reference folder): float_folder's linears as `layout` packs them,
    and the same weights dequantized in a float checkpoint."""
    reference = folder.parent / f"{folder.name}-reference"
    for target in (folder, reference):
        shutil.copytree(float_folder, target)
    state = load_file(str(float_folder / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if name.rsplit(".", 2)[-2] not in PROJECTIONS:
            quantized[name] = dequantized[name] = tensor
            continue
        packed, w = packed_tensors(layout, tensor)
        quantized.update({name.removesuffix("weight") + suffix: t for suffix, t in packed.items()})
        dequantized[name] = w
    save_file(quantized, str(folder / "model.safetensors"))
    save_file(dequantized, str(reference / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**LAYOUTS[layout][0], **(config_changes or {})}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, reference


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-float"), "tiny", seed=0)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def checkpoints(request, float_folder, tmp_path_factory):
    """(quantized folder, its reference loaded with weight_dtype float, fp32)."""
    folder, reference = write_quantized(float_folder, tmp_path_factory.mktemp("q") / request.param, request.param)
    return folder, load_model(str(reference), weight_dtype="float")


def test_awq_and_gptq_are_served_as_stored_int4_and_match_the_reference(checkpoints, monkeypatch):
    folder, reference = checkpoints
    method = "AWQ" if folder.name == "awq" else "GPTQ"
    float_reads = []
    dequantized = AWQGPTQTensors.dequantized
    monkeypatch.setattr(AWQGPTQTensors, "dequantized",
                        lambda self, name, **rows: float_reads.append(name) or dequantized(self, name, **rows))
    loaded = load_model(str(folder), weight_dtype="auto")
    # no float detour: only the fingerprint's down projection is ever dequantized
    assert float_reads == ["model.layers.1.mlp.down_proj.weight"]
    assert loaded.weights.served == {method: "int4 as stored (group 32)", "float": "float32"}
    assert (loaded.weights.quantized, loaded.weights.linears) == (8, 9)     # all but the float head
    for ours, theirs in zip(loaded.model.layers, reference.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            linear = ours.get_submodule(name)
            assert linear.quant.kind == "int4" and linear.quant.group_size == GROUP and linear.weight.is_meta
            # the fused parts in order, every nibble, zero and scale where the kernel wants it
            assert torch.equal(linear.dense_weight(), theirs.get_submodule(name).weight), name
    # the kernel quantizes activations to int8 per block of 32: close, not exact
    ours_logits, reference_logits = our_logits(loaded), our_logits(reference)
    assert (ours_logits - reference_logits).abs().max() <= 2e-2 * reference_logits.abs().max()
    # an EAGLE head made for these weights attaches however they are served
    assert weights_fingerprint(loaded.model) == weights_fingerprint(reference.model)


def test_a_slice_of_a_packed_linears_rows_is_those_rows(checkpoints):
    """A large linear is packed a slice of rows at a time (engine.loading.weight_quant): each
    slice, even one that starts or stops inside a packed int32 of 8 columns, is those rows."""
    from engine.loading.loader import awq_gptq_source, load_config, open_checkpoint
    folder, _ = checkpoints
    source = awq_gptq_source(folder, open_checkpoint(folder, load_config(folder)))
    name = "model.layers.0.mlp.gate_proj.weight"
    whole, dense = source.int4_groups(name), source.dequantized(name)
    for rows in (slice(0, 1), slice(3, 19), slice(8, None)):
        assert all(torch.equal(a[rows], b) for a, b in zip(whole, source.int4_groups(name, rows)))
        assert torch.equal(source.dequantized(name, rows=rows), dense[rows])


def test_float_dequantizes_int8_requantizes_and_int4_keeps_the_stored_groups(float_folder, tmp_path):
    """On AutoGPTQ's layout (each layout's dequantization is checked exactly below, at group 128)."""
    folder, reference_folder = write_quantized(float_folder, tmp_path / "gptq", "gptq")
    reference_logits = our_logits(load_model(str(reference_folder), weight_dtype="float"))
    as_float = load_model(str(folder), weight_dtype="float")
    assert as_float.weights.served == {"GPTQ": "float32 (dequantized)", "float": "float32"}
    assert as_float.weights.quantized == 0
    assert torch.equal(our_logits(as_float), reference_logits)
    as_int8 = load_model(str(folder), weight_dtype="int8")
    assert as_int8.weights.served["GPTQ"] == "int8 (per channel) round-to-nearest at load"
    assert all(m.quant.kind == "int8" for m in as_int8.model.modules() if isinstance(m, Linear))
    cos = torch.nn.functional.cosine_similarity(our_logits(as_int8), reference_logits, dim=-1)
    assert cos.min() > 0.99
    # int4 keeps the stored groups, and quantizes the float head beside them
    assert load_model(str(folder), weight_dtype="int4").weights.served == {
        "GPTQ": "int4 as stored (group 32)", "float": "int4 (group 32) round-to-nearest at load"}


@pytest.mark.parametrize("layout, changes, message", [
    ("gptq", {"desc_act": True}, "act-order \\(desc_act true\\)"),
    ("gptq", {"bits": 8}, "GPTQ with 8-bit weights is not supported, only 4-bit"),
    ("awq", {"bits": 3}, "AWQ with 3-bit weights is not supported"),
    ("awq", {"version": "gemv"}, "AWQ version 'gemv'"),
    ("awq", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
])
def test_what_cannot_be_served_is_refused_by_name(float_folder, tmp_path, layout, changes, message):
    folder, _ = write_quantized(float_folder, tmp_path / layout, layout, changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(str(folder))


def test_an_act_order_g_idx_is_refused_even_when_desc_act_says_false(float_folder, tmp_path):
    folder, _ = write_quantized(float_folder, tmp_path / "gptq", "gptq")
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="down_proj.g_idx is not i // group_size"):
        load_model(str(folder))


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_a_packed_tensor_of_the_wrong_shape_or_missing_is_a_checkpoint_error(float_folder, tmp_path, layout):
    folder, _ = write_quantized(float_folder, tmp_path / layout, layout)
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.scales"
    state[name] = state[name][:, :-8].contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor {name} has shape \\[2, 24\\] but .* implies \\[2, 32\\]"):
        load_model(str(folder))
    del state[name]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"tensor {name} of the .* linear .* is missing"):
        load_model(str(folder))


def test_packed_tensors_without_a_quantization_config_are_named(float_folder, tmp_path):
    folder, _ = write_quantized(float_folder, tmp_path / "awq", "awq")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="q_proj.qweight \\(an AWQ/GPTQ checkpoint\\) but .* no quantization_config"):
        load_model(str(folder))


@pytest.mark.parametrize("layout", ["awq", "gptq", "gptq_v2"])
def test_group_128_maps_exactly_onto_the_int4_kernel(tmp_path, layout):
    """The usual published group size, on one linear [16, 256]: the kernel's weights are the
    stored (q - z) * s."""
    w = torch.randn(16, 256) * 0.02
    packed, reference = packed_tensors(layout, w, group=128)
    base = "model.layers.0.mlp.down_proj"
    save_file({f"{base}.{k}": v for k, v in packed.items()}, str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint.open(tmp_path)
    config = QuantizationConfig("AWQ" if layout == "awq" else "GPTQ", 128, 1 if layout == "gptq" else 0, tmp_path)
    tensors = AWQGPTQTensors(checkpoint, config, lambda name: name if name in checkpoint else None)
    assert tensors.expected_shapes(f"{base}.weight", (16, 256)) == {
        k: tuple(v.shape) for k, v in {f".{k}": v for k, v in packed.items()}.items()}
    qw = quantized_linear.from_int4_groups(*tensors.int4_groups(f"{base}.weight"), torch.float32)
    assert qw.group_size == 128
    assert torch.equal(quantized_linear.dequantize(qw), reference)
    assert torch.equal(tensors.dequantized(f"{base}.weight"), reference)


def test_auto_in_float32_without_our_kernel_dequantizes_and_says_why(checkpoints):
    folder, reference = checkpoints
    with forced_fallback("quant-ours-refused"):
        loaded = load_model(str(folder), weight_dtype="auto")                 # fp32
    method = "AWQ" if folder.name == "awq" else "GPTQ"
    assert loaded.weights.quantized == 0 and "no fast float32 path" in loaded.weights.served[method]
    assert torch.equal(our_logits(loaded), our_logits(reference))
