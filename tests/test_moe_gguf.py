"""Mixture-of-experts GGUF files in llama.cpp's layout (engine.loading.synthetic_gguf): a
Qwen3-MoE in the Q4_K_M mix and a gpt-oss in MXFP4_MOE. Each loads with the config its
preset has, its stacked expert tensors read per expert exactly as gguf's own dequantizer
reads them, and gives the logits and greedy tokens of the same weights loaded from
safetensors (the reference: every tensor dequantized by `gguf.quants`, written in
transformers' layout, gpt-oss's experts fused). Qwen3-MoE's Q4_K experts are served as
stored, one int4 linear per expert; gpt-oss's MXFP4 experts are dequantized at load and the
report says so. A truncated or inconsistent file fails before any weight is read."""
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.errors import CheckpointError
from engine.layers import quantized_linear
from engine.layers.quantized_linear import INT4, INT8_GROUPS, Q4_K, Q6_K
from engine.loading.gguf_tensors import GGUFTensors, _mxfp4
from engine.loading.loader import load_config, load_model, resolve, transformers_model
from engine.loading.synthetic import make_config
from engine.loading.synthetic_gguf import TINY_QWEN3_MOE_Q4_K, recipe_type, use_more_bits, write_gguf
from engine.runtime.model_runner import ModelRunner
from tests.conftest import LOGITS_TEXT
from tests.kernels_required import excused, skip_unless_runs

QWEN3_MOE, GPT_OSS = "qwen3_moe", "gpt_oss"
FILES = {QWEN3_MOE: (TINY_QWEN3_MOE_Q4_K, "Q4_K_M"), GPT_OSS: ("tiny-gpt-oss", "MXFP4_MOE")}
LLAMA_CPP_ARCH = {QWEN3_MOE: "qwen3moe", GPT_OSS: "gpt-oss"}
PROMPTS = ([791, 8011, 2817], [504, 3858, 314, 260, 3334, 30, 378, 2368, 9040, 2817, 314], list(range(1000, 1020)))
# llama.cpp's names -> transformers' (the reference's own table, not gguf's)
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "post_attention_norm.weight": "post_attention_layernorm.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
         "attn_k_norm.weight": "self_attn.k_norm.weight", "attn_sinks.weight": "self_attn.sinks",
         **{f"attn_{g}.{w}": f"self_attn.{h}_proj.{w}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
            for w in ("weight", "bias")}}


@pytest.fixture(scope="module", params=[QWEN3_MOE, GPT_OSS])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def gguf_file(arch, tmp_path_factory):
    preset, recipe = FILES[arch]
    return write_gguf(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", preset, recipe, seed=5)


@pytest.fixture(scope="module")
def stored(gguf_file):
    """The file's tensors as gguf's reader sees them: name -> (type, torch's shape, data)."""
    return {t.name: (t.tensor_type, tuple(int(n) for n in reversed(t.shape)), t.data)
            for t in gguf.GGUFReader(str(gguf_file)).tensors}


@pytest.fixture(scope="module")
def oracle(stored):
    """Every tensor of the file as gguf's dequantizer gives it, float32, torch's shape."""
    return {name: torch.from_numpy(np.array(gguf.quants.dequantize(data, kind), dtype=np.float32))
            for name, (kind, _, data) in stored.items()}


@pytest.fixture(scope="module")
def reference(arch, gguf_file, oracle, tmp_path_factory):
    """The oracle's weights as a Hugging Face folder (the GGUF's config and tokenizer)."""
    folder = tmp_path_factory.mktemp(f"{arch}-reference")
    converted = resolve(str(gguf_file))
    for f in converted.iterdir():
        if f.name != "workbench_source.json":
            shutil.copy2(f, folder / f.name)
    save_file(hf_tensors(arch, oracle), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def hf_tensors(arch: str, oracle: dict) -> dict[str, torch.Tensor]:
    """llama.cpp's tensors in transformers' layout: Qwen3-MoE per expert; gpt-oss fused
    ([E, H, 2I] with gate in the even columns, biases [E, 2I] likewise, down [E, I, H])."""
    out, experts = {}, {}
    for name, t in oracle.items():
        if name in GLOBAL:
            out[GLOBAL[name]] = t
            continue
        _, layer, rest = name.split(".", 2)
        p = f"model.layers.{layer}."
        if rest in LAYER:
            out[p + LAYER[rest]] = t
        elif rest.startswith("ffn_gate_inp."):
            out[p + ("mlp.router." if arch == GPT_OSS else "mlp.gate.") + rest.split(".")[1]] = t
        else:                                       # ffn_{gate,up,down}_exps.{weight,bias}
            experts[(p, rest.split("_")[1], rest.split(".")[1])] = t
    for (p, proj, attr), t in experts.items():
        suffix = "_bias" if attr == "bias" else ""
        if arch == QWEN3_MOE:
            out.update({f"{p}mlp.experts.{e}.{proj}_proj.weight": t[e].contiguous() for e in range(t.shape[0])})
        elif proj == "down":                        # [E, H, I] -> [E, I, H]
            out[f"{p}mlp.experts.down_proj{suffix}"] = t if suffix else t.transpose(1, 2).contiguous()
        elif proj == "gate":                        # with up, interleaved: rows gate 0, up 0, gate 1, ...
            both = torch.stack([t, experts[(p, "up", attr)]], dim=2).flatten(1, 2)
            out[f"{p}mlp.experts.gate_up_proj{suffix}"] = both if suffix else both.transpose(1, 2).contiguous()
    return out


def our_logits(loaded) -> torch.Tensor:
    """Our logits for every position of LOGITS_TEXT through the paged cache, eager (the
    compiled step is tested elsewhere; compiling each of these small models costs seconds)."""
    ids = loaded.tokenizer.encode(LOGITS_TEXT)
    runner = ModelRunner(loaded, EngineConfig(block_size=4, num_blocks=16, compile="off"), torch.device("cpu"))
    return runner.forward(runner.start(ids), ids, logits_for="all")


def greedy(loaded, prompts=PROMPTS, tokens=16) -> list[list[int]]:
    eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=8 * 2**20, compile="off"), torch.device("cpu"))
    return [eng.generate_text(list(p), SamplingParams(max_tokens=tokens, stop_on_eos=False))[1] for p in prompts]


def _kernels_refuse() -> str | None:
    cpu = torch.device("cpu")
    return (quantized_linear.unsupported(INT4, (512, 256), cpu, torch.bfloat16, 32)
            or quantized_linear.unsupported(INT8_GROUPS, (256, 256), cpu, torch.bfloat16, 16)
            or quantized_linear.unsupported(Q4_K, (256, 256), cpu, torch.bfloat16, 256))


# ---- the files -------------------------------------------------------------------------
def test_the_files_have_llama_cpps_tensors_and_types(arch, stored):
    """Stacked experts [E, out, in] (GGUF lists dimensions the other way round), the router F32;
    Q4_K_M on an 8-expert Qwen3-MoE: experts Q4_K, ffn_down_exps Q6_K in the layer use_more_bits
    picks (1 of 2), attn_k/attn_v Q8_0 and attn_output Q5_K (llama.cpp's 8-expert rules), the
    untied head Q6_K; MXFP4_MOE: experts MXFP4, every other weight Q8_0, biases and sinks F32."""
    types = {name: (kind.name, shape) for name, (kind, shape, _) in stored.items()}
    if arch == QWEN3_MOE:
        assert types["blk.0.ffn_gate_exps.weight"] == ("Q4_K", (8, 256, 256))
        assert [types[f"blk.{i}.ffn_down_exps.weight"][0] for i in (0, 1)] == ["Q4_K", "Q6_K"]
        assert [types[f"blk.0.attn_{x}.weight"][0] for x in ("q", "k", "v", "output")] == ["Q4_K", "Q8_0", "Q8_0", "Q5_K"]
        assert types["blk.0.ffn_gate_inp.weight"] == ("F32", (8, 256))
        assert (types["token_embd.weight"][0], types["output.weight"][0]) == ("Q4_K", "Q6_K")
    else:
        assert types["blk.0.ffn_gate_exps.weight"] == ("MXFP4", (8, 32, 64))
        assert types["blk.0.ffn_down_exps.weight"] == ("MXFP4", (8, 64, 32))
        assert types["blk.0.ffn_up_exps.bias"] == ("F32", (8, 32)) and types["blk.0.attn_sinks.weight"] == ("F32", (4,))
        assert {types[f"blk.1.attn_{x}.weight"][0] for x in ("q", "k", "v", "output")} == {"Q8_0"}
        assert [types[n][0] for n in ("token_embd.weight", "output.weight", "blk.0.ffn_gate_inp.bias")] == ["Q8_0", "Q8_0", "F32"]
        assert "blk.0.post_attention_norm.weight" in types


def test_the_q4_k_m_recipe_at_qwen3_30b_a3b_shapes():
    """128 experts: none of llama.cpp's 8-expert rules; ffn_down_exps (and attn_v) Q6_K in the
    layers use_more_bits picks, the other experts Q4_K, the router F32."""
    config = make_config("qwen3-30b-a3b")
    experts = (128, 768, 2048)
    assert [i for i in range(48) if use_more_bits(i, 48)][:8] == [0, 1, 2, 3, 4, 5, 8, 11]
    assert recipe_type("model.layers.8.mlp.experts.down_proj.weight", (128, 2048, 768), config) == "Q6_K"
    assert recipe_type("model.layers.7.mlp.experts.down_proj.weight", (128, 2048, 768), config) == "Q4_K"
    assert recipe_type("model.layers.7.mlp.experts.gate_proj.weight", experts, config) == "Q4_K"
    assert [recipe_type(f"model.layers.7.self_attn.{x}_proj.weight", (512, 2048), config) for x in "kvo"] == ["Q4_K"] * 3
    assert recipe_type("model.layers.7.mlp.gate.weight", (128, 2048), config) == "F32"
    gpt_oss = make_config("gpt-oss-20b")
    assert recipe_type("model.layers.7.mlp.experts.gate_proj.weight", (32, 2880, 2880), gpt_oss, "MXFP4_MOE") == "MXFP4"
    assert recipe_type("model.layers.7.mlp.router.weight", (32, 2880), gpt_oss, "MXFP4_MOE") == "F32"


def test_the_config_read_from_the_file_is_the_presets(arch, gguf_file):
    """Including what transformers' GGUF reader misses (Qwen3-MoE's expert size; gpt-oss's
    YaRN, window and layer types: it fails on them) and what no key holds (llama.cpp's
    fixed choices: renormalised top-k, every layer sparse, swiglu limit 7)."""
    preset, _ = FILES[arch]
    want, got = make_config(preset), load_model(str(gguf_file), weight_dtype="float").hf_config
    fields = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "max_position_embeddings", "num_experts_per_tok", "tie_word_embeddings", "rope_parameters"]
    fields += (["num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"]
               if arch == QWEN3_MOE else
               ["num_local_experts", "intermediate_size", "sliding_window", "layer_types", "attention_bias", "swiglu_limit"])
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)


def test_each_expert_is_its_rows_of_the_stacked_tensor_exactly(arch, gguf_file, oracle):
    """Per-expert names map to contiguous row slabs: Q4_K's int4 groups, Q6_K's int8 groups,
    MXFP4 and F32 biases dequantized, each equal to the oracle's expert bit for bit."""
    tensors = GGUFTensors(gguf_file, load_config(resolve(str(gguf_file))))
    for layer, e, proj in ((0, 0, "gate"), (0, 7, "up"), (1, 3, "down"), (0, 5, "down")):
        name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
        want = oracle[f"blk.{layer}.ffn_{proj}_exps.weight"][e]
        kind = tensors.type_of(name)
        if kind == "Q4_K":
            q, scale, zero = tensors.int4_groups(name)
            got = (q.double().view(q.shape[0], -1, 32) - 8) * scale.double()[..., None] + zero.double()[..., None]
        elif kind == "Q6_K":
            q, scale = tensors.int8_groups(name)
            got = q.double().view(q.shape[0], -1, 16) * scale.double()[..., None]
        else:
            assert kind == "MXFP4"
            got = tensors.dequantized(name)
        assert torch.equal(got.reshape(want.shape).float(), want), (name, kind)
    if arch == GPT_OSS:
        assert torch.equal(tensors.dequantized("model.layers.1.mlp.experts.6.up_proj.bias"), oracle["blk.1.ffn_up_exps.bias"][6])
        assert torch.equal(tensors.dequantized("model.layers.1.self_attn.sinks"), oracle["blk.1.attn_sinks.weight"])


def test_our_mxfp4_decoding_is_ggmls():
    """Every exponent byte and every code, against gguf.quants (ggml's reference decoder)."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    with np.errstate(over="ignore"):       # exponent 255: both give inf (ggml reads it as 2^127)
        want = gguf.quants.dequantize(blocks.reshape(8, -1), gguf.GGMLQuantizationType.MXFP4)
        got = _mxfp4(blocks.reshape(8, 32, 17))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ---- loading ---------------------------------------------------------------------------
def test_a_float_load_of_the_file_is_the_reference_weights(arch, gguf_file, reference):
    """Dequantized at load (fp32): the same logits as the reference folder through our
    safetensors path (gpt-oss's fused experts), and the same greedy tokens as transformers
    on that folder."""
    ours = load_model(str(gguf_file), weight_dtype="float")
    from_safetensors = load_model(str(reference), weight_dtype="float")
    torch.testing.assert_close(our_logits(ours), our_logits(from_safetensors), atol=1e-5, rtol=1e-5)
    tokens = greedy(ours)
    assert tokens == greedy(from_safetensors)
    ref = transformers_model(reference).eval()
    with torch.no_grad():
        theirs = [ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert tokens == theirs
    if arch == GPT_OSS:
        assert ours.weights.served["MXFP4 experts"] == "dequantized at load to float32 (no MXFP4 kernel yet)"


@pytest.mark.parametrize("arch", [QWEN3_MOE], scope="module")
def test_qwen3_moe_experts_are_served_as_stored_one_linear_each(arch, gguf_file, reference):
    """bf16, weight_dtype auto: every expert's gate_up a Q4_K weight as stored, its down Q4_K
    or, in the Q6_K layer, Q6_K; none read in float. The logits stay
    within twice the bf16 float model's error of the file's exact weights."""
    skip_unless_runs(_kernels_refuse(), "our quantized CPU linear")
    loaded = load_model(str(gguf_file), dtype=torch.bfloat16)
    assert loaded.weights.served["Q4_K"] == "Q4_K super-blocks as stored"
    assert loaded.weights.served["Q6_K"] == "Q6_K super-blocks as stored"
    for i, layer in enumerate(loaded.model.layers):
        for expert in layer.mlp.experts:
            assert expert.gate_up_proj.quant.kind == Q4_K and expert.gate_up_proj.weight.is_meta
            assert expert.gate_up_proj.quant.shape == (512, 256)
            assert expert.down_proj.quant.kind == (Q4_K if i == 0 else Q6_K) and expert.down_proj.weight.is_meta
        assert layer.mlp.router.quant is None           # F32 in the file: llama.cpp never quantizes it
    exact = our_logits(load_model(str(reference), weight_dtype="float")).float()
    bf16 = our_logits(load_model(str(reference), dtype=torch.bfloat16, weight_dtype="float")).float()
    err_stored, err_bf16 = (our_logits(loaded).float() - exact).abs().max(), (bf16 - exact).abs().max()
    assert err_stored <= 2 * err_bf16 + 1e-3 * exact.abs().max(), (float(err_stored), float(err_bf16))


@pytest.mark.parametrize("arch", [GPT_OSS], scope="module")
def test_gpt_oss_mxfp4_experts_are_dequantized_at_load_and_said(arch, gguf_file, reference):
    """bf16, weight_dtype auto: the experts are bf16 linears (each the reference's exactly:
    a 4-bit float times a power of two is exact in bf16), the report says MXFP4 experts are
    dequantized at load; the Q8_0 attention and head are served as stored."""
    loaded = load_model(str(gguf_file), dtype=torch.bfloat16)
    served = loaded.weights.served
    assert served["MXFP4 experts"] == "dequantized at load to bfloat16 (no MXFP4 kernel yet)"
    assert "MXFP4" not in served                    # said once, as the experts line
    reference_model = load_model(str(reference), dtype=torch.bfloat16, weight_dtype="float").model
    for i, layer in enumerate(loaded.model.layers):
        for e, expert in enumerate(layer.mlp.experts):
            assert expert.gate_up_proj.quant is None
            want = reference_model.layers[i].mlp.experts[e]
            assert torch.equal(expert.gate_up_proj.dense_weight(), want.gate_up_proj.dense_weight())
            assert torch.equal(expert.down_proj.bias, want.down_proj.bias)
    if not excused(_kernels_refuse(), "our quantized CPU linear"):
        assert served["Q8_0"] == "int8 as stored (group 32)"
        assert loaded.model.layers[0].self_attn.qkv_proj.quant.kind == INT8_GROUPS
    exact = our_logits(load_model(str(reference), weight_dtype="float")).float()
    bf16 = our_logits(load_model(str(reference), dtype=torch.bfloat16, weight_dtype="float")).float()
    err_stored, err_bf16 = (our_logits(loaded).float() - exact).abs().max(), (bf16 - exact).abs().max()
    assert err_stored <= 2 * err_bf16 + 1e-3 * exact.abs().max(), (float(err_stored), float(err_bf16))


# ---- broken files ----------------------------------------------------------------------
def test_a_truncated_moe_file_fails_naming_the_tensor(gguf_file, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = gguf_file.read_bytes()
    cut.write_bytes(data[:len(data) * 2 // 3])
    with pytest.raises(CheckpointError, match=r"cut\.gguf is truncated: tensor (blk\.\d+\.\w+|output)\.weight .* download"):
        load_model(str(cut))


def test_experts_fewer_than_the_metadata_says_fail_naming_the_tensor(arch, gguf_file, tmp_path):
    """expert_count rewritten to 9 in the header: the stacked tensors hold 8."""
    key = f"{LLAMA_CPP_ARCH[arch]}.expert_count".encode()
    data = bytearray(gguf_file.read_bytes())
    at = data.index(key) + len(key) + 4             # after the key: u32 value type, then the value
    assert int.from_bytes(data[at:at + 4], "little") == 8
    data[at:at + 4] = (9).to_bytes(4, "little")
    bad = tmp_path / "nine.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError,
                       match=r"tensor blk\.0\.ffn_\w+_exps\.\w+ has shape .*expert_count is 9; the file is corrupt"):
        load_model(str(bad))
