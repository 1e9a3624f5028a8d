"""Our forward pass against transformers' reference implementation, per architecture,
through the paged cache: prefill, then token-by-token decode, then a multi-token chunk."""
import json

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ModelNotFoundError, UnsupportedModelError
from engine.loading.loader import load_model
from engine.runtime.model_runner import ModelRunner

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _tiny(model_type, **extra):
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **TINY, **extra)


ARCHS = {
    "llama": lambda: _tiny("llama", tie_word_embeddings=True),
    "mistral": lambda: _tiny("mistral", head_dim=32),
    "qwen2": lambda: _tiny("qwen2", tie_word_embeddings=False),
    "qwen3": lambda: _tiny("qwen3", head_dim=32),
    "qwen3_moe": lambda: _tiny("qwen3_moe", head_dim=32, moe_intermediate_size=48, num_experts=8,
                               num_experts_per_tok=2, norm_topk_prob=True),
    # a 4-token window on the first layer (the test's 23 tokens pass it), sinks, biases, YaRN
    "gpt_oss": lambda: _tiny("gpt_oss", head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"]),
    "llama3-rope": lambda: _tiny("llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}


def _save_tiny(tmp_path, make_config):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32).eval()
    with torch.no_grad():   # non-trivial norms so q/k-norm and RMSNorm weights matter
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(TINY["vocab_size"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    tok.save_pretrained(tmp_path)
    return ref


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_transformers(tmp_path, arch):
    assert_logits_match_transformers(tmp_path, ARCHS[arch])


def assert_logits_match_transformers(tmp_path, make_config) -> None:
    """A tiny random model of `make_config()` saved in tmp_path: our logits of 23 tokens
    (a 10-token prefill, 5 decodes, an 8-token chunk) within fp32 tolerance of transformers'."""
    ref = _save_tiny(tmp_path, make_config)
    ours = load_model(str(tmp_path))
    runner = ModelRunner(ours, EngineConfig(block_size=4, num_blocks=32), torch.device("cpu"))
    ids = torch.randint(0, TINY["vocab_size"], (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits[0]                                   # [23, V]
    seq = runner.start(ids[0, :10].tolist())
    got = [runner.forward(seq, ids[0, :10].tolist(), logits_for="all")]   # prefill
    for t in range(10, 15):                                             # decode
        got.append(runner.forward(seq, [int(ids[0, t])]))
    got.append(runner.forward(seq, ids[0, 15:].tolist(), logits_for="all"))  # a verification-sized chunk
    got = torch.cat(got)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 1e-4


def assert_whole_prompt_logits_match(loaded, ref, vocab: int = TINY["vocab_size"], tol: float = 1e-4) -> None:
    """Our logits of a 23-token prompt (ids under `vocab`) in one prefill (block size 4) within
    `tol` of `ref`'s (a transformers model of the same weights)."""
    ids = torch.randint(0, vocab, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits[0]
    runner = ModelRunner(loaded, EngineConfig(block_size=4, num_blocks=32, compile="off"), torch.device("cpu"))
    got = runner.forward(runner.start(ids[0].tolist()), ids[0].tolist(), logits_for="all")
    assert (got - expected).abs().max() < tol


def assert_greedy_matches_transformers(folder, compile_mode: str) -> None:
    """Greedy output of the model in `folder` equals transformers' generate on 5 random prompts
    of 3 to 21 tokens (past a 4-token window), 10 tokens each, eager or compiled."""
    from engine import SamplingParams
    from engine.engine import LLMEngine
    from engine.loading.loader import transformers_model
    loaded = load_model(str(folder))
    ref = transformers_model(loaded.folder).eval()
    eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=4 * 2**20, compile=compile_mode), torch.device("cpu"))
    rng = torch.Generator().manual_seed(11)
    for n in (3, 6, 9, 14, 21):
        prompt = torch.randint(0, TINY["vocab_size"], (n,), generator=rng).tolist()
        ours = eng.generate_text(prompt, SamplingParams(max_tokens=10, stop_on_eos=False))[1]
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        assert ours == theirs, f"prompt of {n} tokens"
    if compile_mode == "on":
        assert eng.runner.compiled is not None and len(eng.runner.compiled.row_counts) > 1


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        load_model(str(tmp_path))


def test_missing_model_path_is_clear(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model not found: .*nowhere"):
        load_model(str(tmp_path / "nowhere"))


def test_folder_without_config_is_clear(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))


def test_pickle_weights_refused_by_default(tmp_path):
    _tiny("llama").save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match="pickle"):
        load_model(str(tmp_path))


def test_hub_id_needs_opt_in():
    with pytest.raises(ModelNotFoundError, match="allow hub downloads"):
        load_model("someorg/somemodel")
