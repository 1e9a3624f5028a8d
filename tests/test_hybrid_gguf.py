"""Qwen3.5 (`qwen35`) and Qwen3-Next (`qwen3next`) GGUF files in llama.cpp's layout
(engine.loading.synthetic_gguf writes them as convert_hf_to_gguf.py would: norms as 1 + w, A_log as
-exp(A_log), the convolution squeezed, Qwen3-Next's in_proj_qkvz split into attn_qkv and attn_gate,
Qwen3.5's value heads tiled), Q8_0 for the matrices. Each loads with the config its preset has and
gives the logits (within 1e-5) and greedy tokens of the same weights in transformers' layout loaded
from safetensors (the reference: every tensor dequantized by `gguf.quants`, the converter undone by
this file's own inverse, written apart from the loader's); the reference matches transformers.
A file missing a linear-attention tensor, or with one of another shape, is refused naming it."""
import math
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.errors import CheckpointError
from engine.layers import quantized_linear
from engine.layers.quantized_linear import INT8_GROUPS
from engine.loading.gguf_tensors import GGUFTensors, read_header
from engine.loading.loader import load_config, load_model, resolve, transformers_model
from engine.loading.synthetic import make_config
from engine.loading.synthetic_gguf import write_gguf
from engine.loading.synthetic_gguf_hybrid import TINY_QWEN35_GGUF, TINY_QWEN3_NEXT_GGUF
from tests.kernels_required import skip_unless_runs
from tests.test_moe_gguf import PROMPTS, greedy, our_logits

QWEN35, QWEN3_NEXT = "qwen3_5_text", "qwen3_next"
PRESETS = {QWEN35: TINY_QWEN35_GGUF, QWEN3_NEXT: TINY_QWEN3_NEXT_GGUF}
LLAMA_CPP_ARCH = {QWEN35: "qwen35", QWEN3_NEXT: "qwen3next"}
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module", params=[QWEN35, QWEN3_NEXT])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def gguf_file(arch, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", PRESETS[arch], "Q8_0", seed=7)


@pytest.fixture(scope="module")
def stored(gguf_file):
    """The file's tensors as gguf's dequantizer gives them: name -> (type name, torch's shape,
    float32 values) (the header read by ours: gguf's reader takes seconds on the vocabulary)."""
    out = {}
    for t in read_header(gguf_file)[1]:
        shape = tuple(int(n) for n in reversed(t.shape))
        raw = np.fromfile(gguf_file, dtype=np.uint8, count=t.n_bytes, offset=t.data_offset).reshape(-1, t.n_bytes // math.prod(shape[:-1]))
        values = gguf.quants.dequantize(raw, t.tensor_type)
        out[t.name] = (t.tensor_type.name, shape, torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape))
    return out


@pytest.fixture(scope="module")
def reference(arch, gguf_file, stored, tmp_path_factory):
    """The file's weights in transformers' names and layouts, a Hugging Face folder (the GGUF's
    config and tokenizer)."""
    folder = tmp_path_factory.mktemp(f"{arch}-reference")
    for f in resolve(str(gguf_file)).iterdir():
        if f.name != "workbench_source.json":
            shutil.copy2(f, folder / f.name)
    config = load_config(folder)
    save_file(unconverted(config, {n: v for n, (_, _, v) in stored.items()}), str(folder / "model.safetensors"))
    return folder


GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
LAYER = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
         "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
         "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
         "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
         "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
         "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
         "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
         "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
         "ssm_ba.weight": "linear_attn.in_proj_ba.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
         "attn_qkv.weight": "linear_attn.in_proj_qkv.weight"}


def unconverted(config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """llama.cpp's tensors back in transformers' layout: norms minus 1 (not the gated one),
    A_log = log(-ssm_a), the convolution [C, 1, K], experts one per name; Qwen3.5's value heads
    from tiled back to grouped by key head; Qwen3-Next's attn_qkv and attn_gate into in_proj_qkvz
    (per key head: q, k, v, z)."""
    out = {}
    for name, t in tensors.items():
        if name in GLOBAL:
            out[GLOBAL[name]] = t - 1 if name == "output_norm.weight" else t
            continue
        _, layer, rest = name.split(".", 2)
        p = f"model.layers.{layer}."
        if "_exps." in rest:
            proj = rest.split("_")[1]
            out.update({f"{p}mlp.experts.{e}.{proj}_proj.weight": t[e].contiguous() for e in range(t.shape[0])})
            continue
        if rest.endswith("norm.weight") and rest != "ssm_norm.weight":
            t = t - 1
        elif rest == "ssm_a":
            t = torch.log(-t)
        elif rest == "ssm_conv1d.weight":
            t = t.unsqueeze(1)
        elif rest == "ffn_gate_inp_shexp.weight":
            t = t.reshape(1, -1)
        out[p + LAYER[rest]] = t
    if config.model_type == QWEN35:
        _grouped_by_key_head(config, out)
    else:
        _qkvz(config, out)
    return out


def _grouped_by_key_head(config, out: dict) -> None:
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    per, dk, dv = hv // hk, config.linear_key_head_dim, config.linear_value_head_dim

    def grouped(x, dim, head):       # [per, hk, head] -> [hk, per, head] along dim
        shape = list(x.shape)
        return x.reshape(*shape[:dim], per, hk, head, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)
    for name in [n for n in out if ".linear_attn." in n]:
        t, what = out[name], name.split(".linear_attn.")[1]
        if what in ("in_proj_qkv.weight", "conv1d.weight"):
            out[name] = torch.cat([t[:2 * hk * dk], grouped(t[2 * hk * dk:], 0, dv)])
        elif what == "in_proj_z.weight":
            out[name] = grouped(t, 0, dv)
        elif what in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            out[name] = grouped(t, 0, 1)
        elif what == "out_proj.weight":
            out[name] = grouped(t, 1, dv)


def _qkvz(config, out: dict) -> None:
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    per_v = config.linear_num_value_heads // hk * config.linear_value_head_dim
    for name in [n for n in out if n.endswith("in_proj_qkv.weight")]:
        qkv, z = out.pop(name), out.pop(name.replace("in_proj_qkv", "in_proj_z"))
        q, k, v = qkv.split([hk * dk, hk * dk, hk * per_v])
        heads = [torch.cat([q[j * dk:(j + 1) * dk], k[j * dk:(j + 1) * dk], v[j * per_v:(j + 1) * per_v],
                            z[j * per_v:(j + 1) * per_v]]) for j in range(hk)]
        out[name.replace("in_proj_qkv", "in_proj_qkvz")] = torch.cat(heads)


# ---- the files -------------------------------------------------------------------------
def test_the_files_have_llama_cpps_tensors(arch, stored):
    """GGUF's order (the fastest dimension first) as llama.cpp's loader checks it: ssm_conv1d
    {K, C} and F32, ssm_a {Hv} negative (-exp(A_log)), ssm_dt.bias; Qwen3.5's ssm_beta / ssm_alpha,
    Qwen3-Next's ssm_ba and attn_qkv + attn_gate (no ssm_in); the norms near 1 (stored 1 + w, w
    near 0; the gated norm's w itself, near 1); the matrices Q8_0."""
    gguf_shape = {n: tuple(reversed(s)) for n, (_, s, _) in stored.items()}
    kinds = {n: k for n, (k, _, _) in stored.items()}
    conv = 2 * 2 * 32 + 4 * 32 if arch == QWEN35 else 2 * 2 * 16 + 4 * 16
    assert gguf_shape["blk.0.ssm_conv1d.weight"] == (4, conv) and kinds["blk.0.ssm_conv1d.weight"] == "F32"
    assert gguf_shape["blk.0.ssm_a"] == (4,) and bool((stored["blk.0.ssm_a"][2] < 0).all())
    assert gguf_shape["blk.0.ssm_dt.bias"] == (4,)
    if arch == QWEN35:
        assert gguf_shape["blk.0.ssm_beta.weight"] == (64, 4) and gguf_shape["blk.0.ssm_alpha.weight"] == (64, 4)
    else:
        assert gguf_shape["blk.0.ssm_ba.weight"] == (64, 8) and "blk.0.ssm_in.weight" not in stored
        assert gguf_shape["blk.0.ffn_gate_exps.weight"] == (64, 32, 8)
    assert gguf_shape["blk.0.attn_qkv.weight"] == (64, conv) and kinds["blk.0.attn_gate.weight"] == "Q8_0"
    assert gguf_shape["blk.3.attn_q.weight"] == (64, 2 * 4 * 16)        # [q; gate] per head, as transformers'
    for name in ("blk.0.attn_norm.weight", "blk.3.attn_q_norm.weight", "output_norm.weight"):
        assert (stored[name][2] - 1).abs().max() < 0.2
    # the gated norm multiplies by w itself (near 1), stored unshifted (1 + w would be near 2)
    assert (stored["blk.0.ssm_norm.weight"][2] - 1).abs().max() < 0.2


def test_the_config_read_from_the_file_is_the_presets(arch, gguf_file):
    """Every field our model reads, from the keys (ssm.*, full_attention_interval,
    rope.dimension_count = the rotated quarter of each head)."""
    ours, preset = load_config(resolve(str(gguf_file))), make_config(PRESETS[arch])
    assert ours.model_type == arch
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "tie_word_embeddings", "layer_types", "linear_conv_kernel_dim",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  *(("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "mlp_only_layers") if arch == QWEN3_NEXT else ())):
        assert getattr(ours, field) == getattr(preset, field), field
    assert ours.rms_norm_eps == pytest.approx(preset.rms_norm_eps)
    assert ours.rope_parameters["partial_rotary_factor"] == 0.25
    assert ours.rope_parameters["rope_theta"] == preset.rope_parameters["rope_theta"]


def test_a_files_recurrent_layers_key_wins_over_the_interval():
    """llama.cpp's `attention.recurrent_layers` (one bool per layer, MTP blocks past block_count
    - nextn_predict_layers included) says which layers are linear, where a file has it."""
    from engine.loading.gguf_qwen35 import gguf_hybrid_config
    keys = {"block_count": 5, "nextn_predict_layers": 1, "embedding_length": 64, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 16, "feed_forward_length": 128,
            "context_length": 2048, "attention.layer_norm_rms_epsilon": 1e-6, "ssm.conv_kernel": 4,
            "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.inner_size": 64,
            "rope.dimension_count": 4, "full_attention_interval": 4,
            "attention.recurrent_layers": [True, False, True, True, False]}
    metadata = {"general.architecture": "qwen35", **{f"qwen35.{k}": v for k, v in keys.items()}}
    config = gguf_hybrid_config(metadata, {"token_embd.weight": (64, 1000)})
    assert config.num_hidden_layers == 4 and config.tie_word_embeddings
    assert config.layer_types == ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    assert (config.linear_value_head_dim, config.rope_parameters["partial_rotary_factor"]) == (16, 0.25)


@pytest.mark.parametrize("preset", ["qwen3.5-9b", "qwen3-next-80b-a3b"])
def test_at_real_shapes_the_writer_and_the_loader_agree_with_llama_cpps_dims(preset):
    """The published sizes (4 of their layers; headers only, nothing generated): every linear-layer
    tensor the writer would write is one llama.cpp's loader asks for, of its dims (create_tensor in
    src/models/qwen35.cpp / qwen3next.cpp, torch's order here): Qwen3.5-9B's attn_qkv {4096, 8192},
    ssm_beta {4096, 32}, ssm_conv1d {4, 8192}; and Q4_K_M gives the big matrices Q4_K."""
    import gguf as gguf_py
    from engine.loading.gguf_qwen35 import hybrid_layout
    from engine.loading.synthetic_gguf import _entries, gguf_tensor_specs
    from engine.loading.synthetic_gguf_hybrid import GGUF_HYBRID_ARCH
    config = make_config({"preset": preset, "num_hidden_layers": 4})
    arch = next(a for a, n in gguf_py.MODEL_ARCH_NAMES.items() if n == GGUF_HYBRID_ARCH[config.model_type])
    names = gguf_py.get_tensor_name_map(arch, 4)
    written = {name: (tuple(shape), kind) for s in gguf_tensor_specs(config)
               for name, shape, kind, _ in _entries(s, config, names, "Q4_K_M", 0)}
    layout = hybrid_layout(GGUF_HYBRID_ARCH[config.model_type], config, written)
    assert {n: s for n, (s, _) in written.items() if n in layout.expected()} == layout.expected()
    if preset == "qwen3.5-9b":
        assert written["blk.0.attn_qkv.weight"] == ((8192, 4096), "Q4_K")
        assert written["blk.0.ssm_beta.weight"][0] == (32, 4096) and written["blk.0.ssm_conv1d.weight"] == ((8192, 4), "F32")
        assert written["blk.0.ssm_out.weight"] == ((4096, 4096), "Q4_K")
    else:
        assert written["blk.0.attn_qkv.weight"][0] == (2 * 16 * 128 + 32 * 128, 2048)
        assert written["blk.0.ssm_ba.weight"][0] == (64, 2048) and written["blk.0.ffn_gate_exps.weight"][0] == (512, 512, 2048)


# ---- loading ---------------------------------------------------------------------------
def test_a_float_load_of_the_file_is_the_reference_weights(arch, gguf_file, reference):
    """fp32: the logits of the reference folder through our safetensors path (within 1e-5)
    and its greedy tokens; the reference's logits are transformers' (test_hybrid's tolerance)."""
    ours = load_model(str(gguf_file), weight_dtype="float")
    from_safetensors = load_model(str(reference), weight_dtype="float")
    logits = our_logits(ours)
    torch.testing.assert_close(logits, our_logits(from_safetensors), atol=LOGITS_ATOL, rtol=0)
    assert greedy(ours, tokens=12) == greedy(from_safetensors, tokens=12)
    ids = ours.tokenizer.encode("The cat sat on the mat. The dog sat on the log.")
    with torch.no_grad():
        theirs = transformers_model(reference).eval()(torch.tensor([ids])).logits[0]
    assert (logits - theirs).abs().max() < 1e-4


def test_reordered_tensors_are_served_as_stored_exactly(arch, gguf_file, reference):
    """The projections whose rows (or, ssm_out, whole-head columns) the converter reordered, and
    Qwen3-Next's in_proj_qkvz gathered from attn_qkv and attn_gate, are read as stored Q8_0
    groups with the converter undone on the groups: their weights are the reference's bit for bit."""
    from safetensors.torch import load_file
    want = load_file(str(reference / "model.safetensors"))
    tensors = GGUFTensors(gguf_file, load_config(reference))
    names = (["in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight", "in_proj_b.weight", "in_proj_a.weight"]
             if arch == QWEN35 else ["in_proj_qkvz.weight", "in_proj_ba.weight", "out_proj.weight"])
    for name in (f"model.layers.{i}.linear_attn.{n}" for i in (0, 2) for n in names):
        assert tensors.type_of(name) == "Q8_0", name
        q, scale = tensors.int8_groups(name)
        assert torch.equal(q.float() * scale.repeat_interleave(32, dim=1), want[name]), name
        n = want[name].shape[0]
        rows = slice(n // 4, n // 4 + max(1, n // 2))       # a slice of rows, as a large tensor is packed
        q, scale = tensors.int8_groups(name, rows=rows)
        assert torch.equal(q.float() * scale.repeat_interleave(32, dim=1), want[name][rows]), name


@pytest.mark.parametrize("arch", [QWEN35], scope="module")
def test_bf16_serves_the_reordered_linears_as_stored(arch, gguf_file, reference):
    """bf16, weight_dtype auto: Qwen3.5's in_proj_qkv and out_proj are int8 groups from the file
    (never read in float), and the logits stay within twice the bf16 float model's error."""
    why = quantized_linear.unsupported(INT8_GROUPS, (256, 64), torch.device("cpu"), torch.bfloat16, 32)
    skip_unless_runs(why, "our quantized CPU linear (8-bit groups)")
    loaded = load_model(str(gguf_file), dtype=torch.bfloat16)
    mixer = loaded.model.layers[0].linear_attn
    for linear in (mixer.in_proj_qkv, mixer.out_proj):
        assert linear.quant.kind == INT8_GROUPS and linear.weight.is_meta
    exact = our_logits(load_model(str(reference), weight_dtype="float")).float()
    bf16 = our_logits(load_model(str(reference), dtype=torch.bfloat16, weight_dtype="float")).float()
    err_stored, err_bf16 = (our_logits(loaded).float() - exact).abs().max(), (bf16 - exact).abs().max()
    assert err_stored <= 2 * err_bf16 + 1e-3 * exact.abs().max(), (float(err_stored), float(err_bf16))


@pytest.mark.parametrize("arch", [QWEN3_NEXT], scope="module")
def test_a_qwen3_next_file_from_before_the_qkvz_split_loads(arch, gguf_file, tmp_path, monkeypatch):
    """A file with ssm_in (transformers' in_proj_qkvz as is: llama.cpp's legacy path) and no
    attn_qkv / attn_gate gives the split file's logits: the same weights."""
    from engine.loading import synthetic_gguf_hybrid
    monkeypatch.setattr(synthetic_gguf_hybrid, "SPLIT_QKVZ", False)
    legacy = write_gguf(tmp_path / "legacy.gguf", TINY_QWEN3_NEXT_GGUF, "Q8_0", seed=7)
    names = {t.name for t in read_header(legacy)[1]}
    assert "blk.0.ssm_in.weight" in names and "blk.0.attn_qkv.weight" not in names
    loaded = load_model(str(legacy), weight_dtype="float")
    assert GGUFTensors(legacy, loaded.hf_config).type_of("model.layers.0.linear_attn.in_proj_qkvz.weight") == "Q8_0"
    torch.testing.assert_close(our_logits(loaded), our_logits(load_model(str(gguf_file), weight_dtype="float")),
                               atol=LOGITS_ATOL, rtol=0)


# ---- broken files ----------------------------------------------------------------------
def _header_edited(gguf_file, tmp_path, old: bytes, new: bytes, name: str):
    data = bytearray(gguf_file.read_bytes())
    at = data.index(old)
    data[at:at + len(old)] = new
    bad = tmp_path / name
    bad.write_bytes(bytes(data))
    return bad


def test_a_file_missing_a_linear_attention_tensor_is_refused_naming_it(arch, gguf_file, tmp_path):
    bad = _header_edited(gguf_file, tmp_path, b"blk.2.ssm_a", b"blk.2.ssm_X", "missing.gguf")
    with pytest.raises(CheckpointError, match=r"missing\.gguf: tensor blk\.2\.ssm_a is missing .*convert it again"):
        load_model(str(bad))


def test_a_wrongly_shaped_tensor_is_refused_naming_it(arch, gguf_file, tmp_path):
    """ssm_dt.bias's one dimension rewritten from 4 to 2 in the header (its data still in the file)."""
    name = b"blk.1.ssm_dt.bias"
    n_dims_and_dim = (1).to_bytes(4, "little") + (4).to_bytes(8, "little")
    bad = _header_edited(gguf_file, tmp_path, name + n_dims_and_dim,
                         name + (1).to_bytes(4, "little") + (2).to_bytes(8, "little"), "shape.gguf")
    with pytest.raises(CheckpointError, match=r"shape\.gguf: tensor blk\.1\.ssm_dt\.bias has shape \[2\] but .*imply \[4\]"):
        load_model(str(bad))
