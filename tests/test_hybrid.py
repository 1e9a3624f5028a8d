"""Hybrid linear-attention models (Qwen3.5's text model, `qwen3_5_text`) against transformers on a
tiny random config: three Gated DeltaNet layers and one gated full-attention layer (layer_types'
default 3:1), grouped value heads (2 key heads, 4 value heads), partial RoPE. Logits through the
paged cache and the state cache within the fp32 tolerance used for Llama; greedy output token-
identical on 5 prompts past one chunk of the chunked form (64 tokens), eager and compiled; the
state cache's slots taken and given back with the requests, and counted apart from KV."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.layers import gated_delta
from engine.loading.loader import load_model
from tests.test_models import TINY, _save_tiny, assert_logits_match_transformers


def _qwen3_5(**extra):
    from transformers import AutoConfig
    fields = dict(TINY, num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256)
    return AutoConfig.for_model("qwen3_5_text", **{**fields, **extra})


def test_logits_match_transformers(tmp_path):
    assert_logits_match_transformers(tmp_path, _qwen3_5)


def test_chunked_form_equals_the_recurrent_one():
    """The chunked form (prefill) computes what the token-by-token loop (decode) does, from a
    non-zero state and over more than one chunk with a ragged end."""
    g = torch.Generator().manual_seed(3)
    heads, length, dk, dv = 3, 150, 8, 5
    q, k = (gated_delta.l2norm(torch.randn(heads, length, dk, generator=g)) for _ in range(2))
    v = torch.randn(heads, length, dv, generator=g)
    decay = -torch.rand(heads, length, generator=g)
    beta = torch.rand(heads, length, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    out_r, state_r = gated_delta.recurrent(q, k, v, decay, beta, state)
    out_c, state_c = gated_delta.chunked(q, k, v, decay, beta, state)
    assert (out_r - out_c).abs().max() < 1e-4 and (state_r - state_c).abs().max() < 1e-4


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    _save_tiny(folder, _qwen3_5)
    return folder


PROMPT_LENGTHS = (5, 33, 70, 97, 131)        # three past one 64-token chunk, one past two


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_greedy_output_is_token_identical_to_transformers(hybrid_folder, compile_mode):
    from engine.loading.loader import transformers_model
    loaded = load_model(str(hybrid_folder))
    ref = transformers_model(loaded.folder).eval()
    eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=4 * 2**20, compile=compile_mode), torch.device("cpu"))
    rng = torch.Generator().manual_seed(11)
    for n in PROMPT_LENGTHS:
        prompt = torch.randint(0, TINY["vocab_size"], (n,), generator=rng).tolist()
        ours = eng.generate_text(prompt, SamplingParams(max_tokens=8, stop_on_eos=False))[1]
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        assert ours == theirs, f"prompt of {n} tokens"
    runner = eng.runner
    assert runner.states.num_used_slots == 0            # every request gave its slot back
    if compile_mode == "on":
        assert runner.compiled is not None and len(runner.compiled.row_counts) > 1
