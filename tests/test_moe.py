"""Mixture-of-experts models (Qwen3-MoE, gpt-oss) on tiny random configs: greedy output
token-identical to transformers on 5 prompts, and the batching rule: eight concurrent
requests each give their solo tokens, in fp32 and bf16, eager and compiled, with
speculation on. Plus the experts' own invariance (a token's result never depends on which
other tokens share its experts) and the routing."""
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.models.moe import SparseMoE
from tests.test_batching import COMPILE, PRESSURE, engine, params_for, prompts, run_together, solo

MOE_PRESETS = ("tiny-qwen3-moe", "tiny-gpt-oss")


def _load(folder, dtype=torch.float32):
    from engine.loading.loader import load_model
    return load_model(str(folder), dtype=dtype)


@pytest.fixture(scope="module", params=MOE_PRESETS)
def moe_folder(request, tmp_path_factory):
    from engine.loading.synthetic import write_checkpoint
    # fp32 on disk: transformers' reference reads exactly the weights we read
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, dtype=torch.float32, seed=3)


def test_greedy_output_is_token_identical_to_transformers(moe_folder):
    from engine.loading.loader import transformers_model
    loaded = _load(moe_folder)
    ref = transformers_model(loaded.folder).eval()
    eng = LLMEngine(loaded, EngineConfig(kv_cache_bytes=8 * 2**20, compile="off"), torch.device("cpu"))
    rng = torch.Generator().manual_seed(11)
    for n in (3, 9, 17, 30, 44):                 # past the tiny gpt-oss window (8 tokens)
        prompt = torch.randint(100, 40000, (n,), generator=rng).tolist()
        ours = eng.generate_text(prompt, SamplingParams(max_tokens=12, stop_on_eos=False))[1]
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, n:].tolist()
        assert ours == theirs, f"prompt of {n} tokens"


def test_every_layer_has_experts_and_the_router_picks_top_k(moe_folder):
    loaded = _load(moe_folder)
    blocks = [layer.mlp for layer in loaded.model.layers]
    assert all(isinstance(b, SparseMoE) for b in blocks)
    x = torch.randn(5, loaded.hf_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, chosen = blocks[0].route(x)
    assert chosen.shape == weights.shape == (5, loaded.hf_config.num_experts_per_tok)
    assert torch.allclose(weights.sum(-1), torch.ones(5))          # renormalised (Qwen3) / softmaxed (gpt-oss)
    assert all(len(set(row)) == len(row) for row in chosen.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_expert_output_does_not_depend_on_the_tokens_sharing_its_experts(moe_folder, dtype):
    loaded = _load(moe_folder, dtype)
    block = loaded.model.layers[0].mlp
    x = torch.randn(23, loaded.hf_config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        together = block(x)
        alone = torch.cat([block(x[i:i + 1]) for i in range(x.shape[0])])
        reordered = block(x.flip(0)).flip(0)
    assert block.last_active > loaded.hf_config.num_experts_per_tok       # the batch woke more experts
    assert torch.equal(together, alone) and torch.equal(together, reordered)


# ---- the batching rule on MoE models: eight requests, each its solo tokens ------------------
@pytest.fixture(scope="module", params=[(p, d, c) for p in MOE_PRESETS
                                        for d, c in ((torch.float32, "off"), (torch.bfloat16, "off"),
                                                     (torch.bfloat16, "on"))],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}-compile-{p[2]}")
def moe(request, tmp_path_factory):
    from engine.loading.synthetic import write_checkpoint
    preset, dtype, compile_mode = request.param
    loaded = _load(write_checkpoint(tmp_path_factory.mktemp("moe-batch"), preset, seed=0), dtype)
    COMPILE[id(loaded)] = compile_mode
    yield loaded
    del COMPILE[id(loaded)]                          # its id may be another model's once freed


def test_eight_concurrent_requests_on_an_moe_model_give_their_solo_tokens(moe):
    all_prompts = prompts(moe)
    all_params = [params_for(i, False) for i in range(8)]
    alone = [solo(moe, p, s) for p, s in zip(all_prompts, all_params)]
    eng = engine(moe, **PRESSURE)
    together, stats = run_together(eng, all_prompts, all_params)
    assert [together[i] for i in range(8)] == alone
    assert sum(s.preemptions for s in stats.values()) >= 1
    assert stats[1].prefix_hit_tokens == 64
    if COMPILE[id(moe)] == "on":
        assert eng.runner.compiled is not None and len(eng.runner.compiled.row_counts) > 3


@pytest.mark.parametrize("spec", [dict(proposer="draft", draft_model="self:1", num_speculative_tokens=3),
                                  dict(proposer="draft", draft_model="self:1", num_speculative_tokens=3,
                                       draft_tree="3:4:10")], ids=["chain", "tree"])
def test_with_speculation_on_an_moe_model_the_same_holds(moe, spec):
    all_prompts = prompts(moe)
    all_params = [params_for(i, False) for i in range(8)]
    alone = [solo(moe, p, s, **spec) for p, s in zip(all_prompts, all_params)]
    together, stats = run_together(engine(moe, **PRESSURE, **spec), all_prompts, all_params)
    assert [together[i] for i in range(8)] == alone
    assert sum(s.proposed for s in stats.values()) > 0
    assert alone == [solo(moe, p, s) for p, s in zip(all_prompts, all_params)]   # lossless

