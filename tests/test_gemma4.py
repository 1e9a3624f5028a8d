"""Gemma 4's dense text model (gemma4_text) against transformers on tiny random configs: logits
through the paged cache within fp32 tolerance, and greedy output token-identical on 5 prompts
that run past the sliding window, eager and compiled, through LLMEngine. The configs make
each Gemma 4 specific show: per-layer embeddings, KV shared across the last layers (and
their double-wide MLPs), full layers with a wider head and proportional RoPE, unscaled
attention with q/k/v norms, layer scalars apart from 1; the second config keys equal to
values on its full layers, an untied head and final logit softcapping. Also: a layer that
reuses another's KV holds no cache of its own (the pool and the memory plan), and what we do
not serve is refused by name."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.cache.memory_plan import plan_memory
from engine.engine import LLMEngine
from engine.errors import UnsupportedModelError
from engine.loading.loader import load_model
from engine.runtime.model_runner import ModelRunner
from tests.test_models import TINY, assert_greedy_matches_transformers, assert_whole_prompt_logits_match

WINDOW = 4
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 10000.0}}


def _gemma4(**extra):
    from transformers import AutoConfig
    fields = dict(TINY, num_hidden_layers=5, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
                  layer_types=TYPES, rope_parameters=ROPE, num_kv_shared_layers=2, use_double_wide_mlp=True,
                  hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY["vocab_size"])
    return AutoConfig.for_model("gemma4_text", **{**fields, **extra})


CONFIGS = {
    # layers 3 and 4 reuse layers 2's and 1's KV; per-layer embeddings; tied head, as released
    "ple-kv-shared": lambda: _gemma4(),
    # no sharing, no PLE; the full layers' values are their keys; untied, so that greedy output wanders
    "k-eq-v-softcap": lambda: _gemma4(num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                                      tie_word_embeddings=False, final_logit_softcapping=2.0),
}


def _save(folder, make_config):
    """transformers' model of the config, saved with a tokenizer; norms and layer scalars moved
    off their initial values so that each one matters, and weights wider than the initial
    0.02 so that the logits part."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if "norm" in name else p.mul_(4.0)
        for name, b in ref.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    ref.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(folder)
    return ref


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma4(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, _save(folder, CONFIGS[request.param])


def test_logits_match_transformers(gemma4):
    """23 tokens: a 10-token prefill, 5 decodes, an 8-token chunk, through the paged cache."""
    folder, ref = gemma4
    runner = ModelRunner(load_model(str(folder)), EngineConfig(block_size=4, num_blocks=32, compile="off"),
                         torch.device("cpu"))
    ids = torch.randint(0, TINY["vocab_size"], (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]                                       # [23, V]
    seq = runner.start(ids[0, :10].tolist())
    got = [runner.forward(seq, ids[0, :10].tolist(), logits_for="all")]
    got += [runner.forward(seq, [int(ids[0, t])]) for t in range(10, 15)]
    got.append(runner.forward(seq, ids[0, 15:].tolist(), logits_for="all"))
    got = torch.cat(got)
    assert expected.abs().max() > 1.0              # logits that part, not all near 0
    assert (got - expected).abs().max() < 1e-4


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_greedy_output_is_token_identical_to_transformers(gemma4, compile_mode):
    assert_greedy_matches_transformers(gemma4[0], compile_mode)


def test_a_layer_that_reuses_kv_holds_no_cache(tmp_path):
    """5 layers, the last 2 attending over layers 2's and 1's K/V: the pool has 3 layers, and
    the memory plan counts 3 layers' bytes per token (each as wide as the widest head, 32:
    the sliding layers' 16-wide heads are stored zero-padded, which the model says)."""
    _save(tmp_path, CONFIGS["ple-kv-shared"])
    loaded = load_model(str(tmp_path))
    model = loaded.model
    assert [layer.self_attn.cache_index for layer in model.layers] == [0, 1, 2, 2, 1]
    config = EngineConfig(block_size=4, num_blocks=8, compile="off")
    runner = ModelRunner(loaded, config, torch.device("cpu"))
    kv_heads, width = 2, 32
    assert runner.kv.k.shape == (3, 8, 4, kv_heads, width)
    per_token = 2 * 3 * kv_heads * width * 4                           # K and V, 3 layers, fp32
    plan = plan_memory(config, torch.device("cpu"), model)
    assert plan.kv_bytes_per_block == per_token * 4
    assert (plan.kv_layers.full, plan.kv_layers.window, plan.kv_layers.shared) == (1, 2, 2)
    assert runner.kv.bytes_allocated == per_token * 4 * 8
    assert model.padded_kv_values_per_token == 2 * 2 * kv_heads * (32 - 16)     # layers 0 and 2 are sliding
    from engine.bench.model_memory import model_memory                       # `bench memory`'s figures agree
    kv = model_memory(loaded.hf_config, 64)["kv"]
    assert (kv["num_layers"], kv["full_layers"], kv["window_layers"], kv["kv_shared_layers"]) == (3, 1, 2, 2)
    assert kv["bytes_per_token"]["bf16"] == 2 * 3 * kv_heads * width * 2


@pytest.mark.parametrize("extra, named", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16), "enable_moe_block"),
    (dict(attention_k_eq_v=True, num_global_key_value_heads=1), "KV heads differ"),
])
def test_what_we_do_not_serve_is_refused_by_name(tmp_path, extra, named):
    _save(tmp_path, lambda: _gemma4(**extra))
    with pytest.raises(UnsupportedModelError, match=named):
        load_model(str(tmp_path))


# ---- a llama.cpp file: config from the gemma4 keys ------------------------------------------
def _write_like_llama_cpp(model, path) -> None:
    """`model` (transformers' Gemma4ForCausalLM) as llama.cpp's convert (conversion/gemma.py,
    Gemma4Model) writes it: its keys (per-layer arrays where it writes them), F32 tensors under
    llama.cpp's names, norms as stored (no 1 + w), the full layers' rope_freqs, and (for the
    loader) the default model's tokenizer."""
    import gguf
    from engine.loading.loader import default_gguf_path
    from engine.loading.synthetic_gguf import add_tokenizer
    c, layers = model.config, model.config.num_hidden_layers
    shared = c.num_kv_shared_layers
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    writer.add_key_length(32)
    writer.add_value_length(32)
    writer.add_key_length_swa(16)
    writer.add_value_length_swa(16)
    writer.add_feed_forward_length([c.intermediate_size * (2 if i >= layers - shared else 1) for i in range(layers)])
    add_tokenizer(writer, gguf.GGUFReader(str(default_gguf_path())), c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":                     # tied: llama.cpp writes token_embd only
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)) + ("" if name.endswith(".weight") else ".weight"),
                          tensor.float().numpy())
    rotated = int(c.rope_parameters["full_attention"]["partial_rotary_factor"] * 16)    # of the 16 pairs of a 32-wide head
    writer.add_tensor("rope_freqs.weight", torch.tensor([1.0] * rotated + [1e30] * (16 - rotated)).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_cpp_gemma4_file_gives_transformers_logits(tmp_path):
    """The gemma4 keys (sliding_window_pattern and feed_forward_length per layer, key_length and
    key_length_swa, shared_kv_layers, embedding_length_per_layer_input) and the rope_freqs tensor
    (half the full layers' pairs rotated here, not transformers' default quarter) give
    transformers' config back, and the file's tensors (norms as stored, PLE, layer scalars) its logits."""
    rope = {**ROPE, "full_attention": {**ROPE["full_attention"], "partial_rotary_factor": 0.5}}
    make = lambda: _gemma4(vocab_size=49152, vocab_size_per_layer_input=49152, rope_parameters=rope)  # noqa: E731
    ref = _save(tmp_path / "hf", make)
    _write_like_llama_cpp(ref, tmp_path / "tiny-gemma4.gguf")
    loaded = load_model(str(tmp_path / "tiny-gemma4.gguf"), weight_dtype="float")
    config, theirs = loaded.hf_config, ref.config
    assert config.model_type == "gemma4_text" and config.layer_types == theirs.layer_types
    assert config.kv_sharing_modes == theirs.kv_sharing_modes and config.use_double_wide_mlp
    assert [config.per_layer_config[i].head_dim for i in range(5)] == [16, 32, 16, 16, 32]
    assert config.rope_parameters == theirs.rope_parameters
    assert_whole_prompt_logits_match(loaded, ref, vocab=49152)


def test_a_multimodal_gemma4_folder_serves_its_text_model(tmp_path):
    """Gemma 4's releases are Gemma4ForConditionalGeneration folders: we serve the text_config,
    reading the text model under "model.language_model." and leaving the image tower unread;
    text-only logits are the multimodal model's."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, Gemma4ForConditionalGeneration, PreTrainedTokenizerFast
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=64)
    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma4", text_config=_gemma4().to_dict(), vision_config=vision, audio_config=None)
    ref = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if "norm" in name else p.mul_(4.0)
    ref.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.hf_config.model_type == "gemma4_text"
    assert_whole_prompt_logits_match(loaded, ref)


def test_a_synthetic_tiny_gemma4_checkpoint_holds_transformers_tensors():
    """engine.loading.synthetic's "tiny-gemma4" writes the tensors our model reads: transformers'
    Gemma4ForCausalLM's names and shapes, the sharing layers without k/v projections, norms
    and layer scalars at 1."""
    from transformers import AutoModelForCausalLM
    from engine.loading.synthetic import make_config, tensor_groups
    config = make_config("tiny-gemma4")
    specs = [spec for group in tensor_groups(config) for spec in group]
    with torch.device("meta"):
        theirs = {name: tuple(t.shape) for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    assert {spec.name: spec.shape for spec in specs} == theirs
    assert "model.layers.3.self_attn.k_proj.weight" not in theirs
    assert {spec.init for spec in specs if spec.name.endswith(("norm.weight", "layer_scalar"))} == {"ones"}


def test_requests_together_and_drafted_give_their_solo_tokens(tmp_path):
    """Six requests in shared steps, drafted by the target's first 4 layers (an early-exit draft
    whose layer 3 reuses layer 2's KV, its per-layer inputs the first 4 slices) as chains and as
    trees (the sharing layers attend their producers' K/V of a tree's rows too): each one's
    greedy tokens are those it gets alone. (49152 tokens: speculation calibrates with ids past 1000.)"""
    from tests.conftest import together
    _save(tmp_path, lambda: _gemma4(vocab_size=49152, vocab_size_per_layer_input=49152))
    loaded = load_model(str(tmp_path))
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=rng).tolist() for n in (3, 7, 12, 20, 5, 9)]
    params = SamplingParams(max_tokens=12, stop_on_eos=False)
    config = dict(kv_cache_bytes=8 * 2**20, compile="off")
    solo = LLMEngine(loaded, EngineConfig(**config), torch.device("cpu"))
    expected = [solo.generate_text(p, params)[1] for p in prompts]
    for spec in (dict(proposer="draft", draft_model="self:4"), dict(proposer="draft", draft_model="self:4",
                                                                    draft_tree="4:3:8")):
        eng = LLMEngine(loaded, EngineConfig(**config, **spec), torch.device("cpu"))
        assert together(eng, prompts, params) == expected, spec
