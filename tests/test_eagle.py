"""The EAGLE draft head: its recipe (engine.training.distill), its file, its proposer, and the
guarantees speculation owes the user with it (greedy identity, the target's distribution)."""
import json

import pytest
import torch

from engine import SamplingParams
from engine.errors import ModelNotFoundError, UnsupportedModelError
from tests.conftest import assert_second_token_follows_the_target, chat, serving_engine

GREEDY = SamplingParams(max_tokens=40, stop_on_eos=False)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory, tiny_model):
    """The whole recipe on the tiny model and a tiny budget: generate, choose the head's
    vocabulary, train with training-time test, evaluate, save."""
    from engine.training.distill import Recipe, run
    out = tmp_path_factory.mktemp("eagle") / "tiny-eagle"
    recipe = Recipe(conversations=12, max_new_tokens=24, concurrency=12, head_vocab=512, steps=40,
                    batch_size=6, lr=3e-3, eval_every=20, depth=3)
    report = run(recipe, out, threads=1, data_cache=tmp_path_factory.mktemp("data"), log=lambda m: None,
                 engine=serving_engine(tiny_model))
    return out, report


def test_recipe_writes_a_small_head_with_its_report(tiny_head, tiny_model):
    from engine.loading.loader import load_eagle_head
    folder, report = tiny_head
    saved = json.loads((folder / "distill_report.json").read_text())
    assert saved["recipe"]["steps"] == 40 and [c["step"] for c in saved["heldout_curve"]] == [20, 40]
    assert saved["data"]["answer_tokens"] > 0 and saved["data"]["tok_s"] > 0
    per_position = saved["heldout"]["per_position"]
    assert 1 <= len(per_position) <= 4 and all(0.0 <= r <= 1.0 for r in per_position)
    head, _ = load_eagle_head(str(folder), tiny_model)
    assert head.embed_tokens is tiny_model.model.embed_tokens           # the target's, not stored
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert not any("embed" in name or "lm_head" in name for name in header)
    assert len(head.head_token_ids) == 512
    from engine.training.distill import pinned_tokens
    pinned = pinned_tokens(tiny_model.tokenizer)           # special and byte tokens: always draftable
    assert set(tiny_model.tokenizer.all_special_ids) <= set(pinned) and len(pinned) > 200
    assert set(pinned) <= set(head.head_token_ids.tolist())
    best = saved["best_step"]                               # the kept weights: the best evaluation's
    assert best in (20, 40)
    parity = saved["parity"]            # a held-out prompt served again with the head drafting
    assert parity["answer_identical"] and parity["proposed"] > 0
    assert parity["max_abs_feature_diff"] == 0.0 and parity["positions_differing"] == 0


def test_unrolled_training_forward_is_what_the_proposer_computes(tiny_head, tiny_model):
    """Training-time test trains each draft step on the attention pattern the proposer runs:
    the draft distributions from `distill.unrolled` equal the proposer's, step by step."""
    from engine.layers.sampler import make_generator
    from engine.loading.loader import load_eagle_head
    from engine.speculative.eagle_proposer import EagleProposer
    from engine.training.distill import _batch, unrolled
    from engine.training.distill_data import Sequence
    head, _ = load_eagle_head(str(tiny_head[0]), tiny_model)
    torch.manual_seed(1)
    prefix = torch.randint(100, 2000, (30,)).tolist()
    feats = torch.randn(29, head.config.hidden_size)        # the target's features for positions 0..28
    proposer = EagleProposer(head, 16, torch.device("cpu"))
    proposer.target_pass(0, feats)
    k = 4
    sampled = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    proposal = proposer.propose(prefix, k, sampled, make_generator(3))
    seq = Sequence(prefix[:1], prefix[1:] + proposal.tokens, torch.cat([feats, torch.zeros(k, feats.shape[1])]))
    tokens, f, _ = _batch([seq], k)
    with torch.no_grad():
        outs = unrolled(head, tokens, f, k)
    for d in range(k):      # step d+1 from the last true position 28
        q = head.full_logits(outs[d][0, 28:29] @ head.head_weight.t()).softmax(-1)[0]
        torch.testing.assert_close(q, proposal.probs[d], atol=1e-5, rtol=1e-4)


def test_greedy_eagle_speculation_is_token_identical(tiny_head, make_tiny_engine):
    prompt = chat("What is the capital of France?")
    for kv, prefix in (("auto", True), ("fp8_e4m3", False)):
        eng = make_tiny_engine(kv_cache_dtype=kv, enable_prefix_caching=prefix)
        expected = eng.generate_text(prompt, GREEDY)[1]
        for k in (1, 4):
            eng.reconfigure(proposer="eagle", eagle_head=str(tiny_head[0]), num_speculative_tokens=k)
            _, out, stats = eng.generate_text(prompt, GREEDY)
            assert out == expected, (kv, prefix, k)
            assert stats.proposed > 0
            eng.reconfigure(proposer="off")
        assert eng.runner.blocks.num_used_blocks == 0


def _eager_and_compiled_drafts(eng, head_folder) -> dict:
    """The chain and tree each way drafts on the same inputs: the engine's step and the eager one."""
    from engine.config import TreeShape
    from engine.speculative.eagle_proposer import EagleProposer
    eng.reconfigure(proposer="eagle", eagle_head=str(head_folder))
    head = eng.speculator.eagle[1]
    torch.manual_seed(1)
    prefix = torch.randint(100, 2000, (40,)).tolist()
    feats = torch.randn(39, head.config.hidden_size)          # the target's features for positions 0..38
    drafted = {}
    for name, how in (("eager", None), ("compiled", eng.speculator.eagle_step)):
        proposer = EagleProposer(head, 16, torch.device("cpu"), how)
        proposer.target_pass(0, feats[:30])                    # a prompt's pass
        chain = proposer.propose(prefix[:31], 4, GREEDY, None).tokens
        proposer.target_pass(30, feats[30:])                   # a later pass: a catch-up of 9 rows
        tree = proposer.propose_tree(prefix, TreeShape(2, 3, 6), GREEDY, None).tree
        drafted[name] = chain, tree.tokens, tree.parents
    return drafted


@pytest.fixture(scope="module")
def built_head(tmp_path_factory, tiny_model):
    """A head for the tiny model as the recipe starts it (the target's last layer), untrained."""
    from engine.models.eagle_head import save_eagle
    from engine.training.distill import build_head
    folder = tmp_path_factory.mktemp("built") / "head"
    save_eagle(build_head(tiny_model, torch.arange(0, 2048, 4)), folder)
    return folder


def test_the_compiled_draft_step_drafts_what_the_eager_one_does(make_tiny_engine, built_head):
    """Where the target's step is compiled the head's draft step is too (the engine's EagleStep,
    one graph for catch-ups, chains and tree levels): on the same inputs it drafts the tokens
    the eager reference does. With compile off the head drafts eagerly."""
    eng = make_tiny_engine()
    drafted = _eager_and_compiled_drafts(eng, built_head)
    assert eng.settings()["compile"].startswith("on") and drafted["compiled"] == drafted["eager"]
    assert eng.speculator.eagle[1].head_quant is None                        # a float target's head stays float
    step = eng.speculator.eagle_step.compiled
    assert {30, 9, 1} <= step.row_counts and step.compiles == 1     # one graph for every pass
    assert eng.speculator.eagle_step.chain_replays >= 2           # a chain's passes replay prepared tensors
    off = make_tiny_engine(compile="off")
    off.reconfigure(proposer="eagle", eagle_head=str(built_head))
    assert off.speculator.eagle_step.compiled is None


def test_a_quantized_target_drafts_with_an_int8_head_compiled_as_eager(tiny_model, built_head):
    """A quantized target's head is served in int8 (its weights are most of a draft step's
    cost); compiled, it drafts what its eager step does."""
    from engine.loading.loader import load_model
    from tests.conftest import engine_factory
    quantized = load_model(str(tiny_model.folder), weight_dtype="int8")
    eng = engine_factory(quantized, 8 * 2**20)()
    drafted = _eager_and_compiled_drafts(eng, built_head)
    head = eng.speculator.eagle[1]
    assert head.head_quant is not None and head.fc.quant is not None and head.layers[0].mlp.down_proj.quant is not None
    assert drafted["compiled"] == drafted["eager"] and eng.speculator.eagle_step.compiled.compiles == 1


def test_eagle_switched_on_mid_reply_keeps_greedy_output(tiny_head, make_tiny_engine):
    """The head starts from the first target pass it sees (no prompt features)."""
    eng = make_tiny_engine()
    prompt = eng.encode(chat("Why is the sky blue?"))
    expected = eng.generate_text(prompt, GREEDY)[1]
    request = eng.start(prompt, GREEDY)
    out = []
    while not request.finished:
        if request.step_index == 5:
            eng.reconfigure(proposer="eagle", eagle_head=str(tiny_head[0]), num_speculative_tokens=3)
        out += request.step().token_ids
    request.close()
    assert out == expected and request.stats.proposed > 0


def test_the_shipped_head_drafts_for_the_default_model_and_stays_lossless(make_engine):
    eng = make_engine(kv_cache_dtype="fp8_e4m3", enable_prefix_caching=True)
    prompt = chat("Explain what a hash table is in two sentences.")
    expected = eng.generate_text(prompt, GREEDY)[1]
    eng.reconfigure(proposer="eagle", num_speculative_tokens=4)
    assert eng.settings()["proposer"] == "eagle" and eng.settings()["eagle_head"] == "shipped"
    _, out, stats = eng.generate_text(prompt, GREEDY)
    assert out == expected
    assert 0 < stats.accepted < stats.proposed            # kept and rolled-back drafts both happened


def test_sampled_eagle_speculation_keeps_the_target_distribution(make_engine, default_model):
    """Temperature 1 on the real model: the token after the first one is drawn through the
    EAGLE head's proposal and the rejection sampler. Given the commonest first token, its
    frequencies must match the target's own probabilities (chi-square, top-k 4 support)."""
    eng = make_engine(enable_prefix_caching=True)
    eng.reconfigure(proposer="eagle", num_speculative_tokens=2)
    assert_second_token_follows_the_target(eng, eng.encode(chat("Name a colour.")))


def test_a_head_for_another_model_is_refused_with_the_reason(tiny_head, make_engine, make_tiny_engine):
    from engine.errors import ConfigError
    eng = make_engine()
    with pytest.raises((UnsupportedModelError, ConfigError), match="another"):
        eng.reconfigure(proposer="eagle", eagle_head=str(tiny_head[0]))
    assert eng.settings()["proposer"] == "off"                  # nothing changed
    tiny = make_tiny_engine()
    with pytest.raises(UnsupportedModelError, match="trained for another model"):
        tiny.reconfigure(proposer="eagle")                        # the shipped head is the default model's


def test_a_folder_without_a_head_is_named(make_engine, tmp_path):
    eng = make_engine()
    with pytest.raises(ModelNotFoundError, match="no EAGLE head at"):
        eng.reconfigure(proposer="eagle", eagle_head=str(tmp_path))
    assert eng.settings()["proposer"] == "off"


def test_speculation_report_says_whether_it_pays(tiny_head, make_tiny_engine):
    eng = make_tiny_engine()
    # fixed: the report needs drafted tokens, which the auto policy may decline on a busy machine
    eng.reconfigure(proposer="eagle", eagle_head=str(tiny_head[0]), num_speculative_tokens=4,
                    speculation_policy="fixed")
    events = list(eng.generate(chat("What is the capital of France?"), GREEDY))
    report = events[-1].speculation
    assert report["plain_source"] == "calibration"               # no plain reply yet in this session
    assert report["k"] == 4 and report["measured_speedup"] > 0 and report["predicted_speedup"] > 0
    assert report["measured_speedup"] == pytest.approx(events[-1].running["decode_tok_s"] / report["plain_tok_s"])
    eng.reconfigure(proposer="off")
    eng.generate_text(chat("What is the capital of France?"), GREEDY)
    eng.reconfigure(proposer="eagle")
    assert list(eng.generate(chat("Why?"), GREEDY))[-1].speculation["plain_source"] == "session"


def test_break_even_alpha_is_where_predicted_speedup_is_one():
    from engine.metrics import break_even_alpha, predicted_speedup
    a = break_even_alpha(4, 0.05, 1.2)
    assert 0 < a < 1 and predicted_speedup(a, 4, 0.05, 1.2) == pytest.approx(1.0, abs=1e-6)
    assert break_even_alpha(4, 0.5, 3.5) is None      # at best 5 tokens per 5.5 plain steps: never pays
    assert break_even_alpha(1, 0.0, 0.5) == 0.0                  # a verify cheaper than a step always pays
