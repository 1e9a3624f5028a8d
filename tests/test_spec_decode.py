"""Speculative decoding: lossless greedy output, distribution-preserving sampling,
cache rollback, live k/proposer changes, draft compatibility.

End-to-end tests run on the tiny random-weight model (tests/conftest.py: tiny_model), where
an early-exit draft "self:1" agrees with the target only sometimes, so every run has
rejections to roll back; one case runs on the real default model."""
import itertools

import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.engine import LLMEngine
from engine.errors import DraftIncompatibleError
from engine.metrics import ACCEPTED, BONUS, RESAMPLED
from engine.speculative.spec_decode import check_draft_compatible, ngram_lookup, rejection_sample
from engine.speculative.tree import DraftTree, greedy_verify, sample_verify
from tests.conftest import chat

GREEDY = SamplingParams(max_tokens=20, stop_on_eos=False)
QUESTION = chat("What is the capital of France?")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tests run many tiny forward passes; on the 2 shared cores of CI, thread
    hand-offs cost more than the arithmetic (measured ~6x slower with 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the rejection sampler on its own ----------------------------------------------
P = torch.tensor([0.5, 0.2, 0.2, 0.1])        # target
Q = torch.tensor([0.1, 0.6, 0.1, 0.2])        # draft


def _emitted_distribution(n=40000, seed=0):
    """Draw x ~ q, run one-token speculation, histogram the emitted token."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4)
    target = torch.stack([P, P])                                      # [k+1, V]
    for _ in range(n):
        x = int(torch.multinomial(Q, 1, generator=g))
        verdict = rejection_sample([x], Q[None], target, g)
        counts[verdict.tokens[0]] += 1
    return counts / n


def test_emitted_tokens_follow_the_target_distribution():
    tv = 0.5 * (_emitted_distribution() - P).abs().sum()
    assert tv < 0.01


# Drafts [0, 1]. Position 0: p(0)/q(0) = 0.3/0.5 = 0.6, residual max(0, p - q) = token 2 only.
# Position 1: p(1)/q(1) = 0.2/0.5 = 0.4, residual token 2 only. Bonus: p = token 0 only.
# So every outcome is fixed by the generator's uniforms u1, u2 (the first two torch.rand of
# each seed, below): token 0 kept iff u1 < 0.6, then token 1 kept iff u2 < 0.4.
Q_DRAFT = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
P_TARGET = torch.tensor([[0.3, 0.0, 0.7], [0.0, 0.2, 0.8], [1.0, 0.0, 0.0]])
EXPECTED_VERDICTS = [   # seed: (u1, u2) -> (num_accepted, tokens, kinds)
    (0.4963, 0.7682, 1, [0, 2], [ACCEPTED, RESAMPLED]),
    (0.7576, 0.2793, 0, [2], [RESAMPLED]),
    (0.6147, 0.3810, 0, [2], [RESAMPLED]),
    (0.0043, 0.1056, 2, [0, 1, 0], [ACCEPTED, ACCEPTED, BONUS]),
    (0.5596, 0.5591, 1, [0, 2], [ACCEPTED, RESAMPLED]),
    (0.8303, 0.1261, 0, [2], [RESAMPLED]),
    (0.5722, 0.5539, 1, [0, 2], [ACCEPTED, RESAMPLED]),
    (0.5349, 0.1988, 2, [0, 1, 0], [ACCEPTED, ACCEPTED, BONUS]),
]


def test_acceptance_follows_min_1_p_over_q_exactly():
    """Any other rule (always accept, u < p, u < q/p, resampling from p) changes a verdict."""
    for seed, (u1, u2, accepted, tokens, kinds) in enumerate(EXPECTED_VERDICTS):
        uniforms = torch.Generator().manual_seed(seed)
        assert [round(float(torch.rand((), generator=uniforms)), 4) for _ in range(2)] == [u1, u2]
        v = rejection_sample([0, 1], Q_DRAFT.clone(), P_TARGET.clone(), torch.Generator().manual_seed(seed))
        assert (v.num_accepted, v.tokens, v.kinds) == (accepted, tokens, kinds), f"seed {seed}"


def test_a_point_mass_draft_is_kept_with_probability_p():
    """n-gram drafts have no distribution: q(x) = 1, so x is kept iff u1 < p(x) = 0.3."""
    target = torch.tensor([[0.3, 0.0, 0.7], [1.0, 0.0, 0.0]])
    verdicts = [sample_verify(DraftTree.chain([0]), target, torch.Generator().manual_seed(seed)) for seed in (0, 3)]
    assert [(v.num_accepted, v.tokens, v.kinds) for v in verdicts] == [(0, [2], [RESAMPLED]),           # u1 0.4963
                                                                      (1, [0, 0], [ACCEPTED, BONUS])]   # u1 0.0043


def test_all_accepted_gives_a_bonus_token_from_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    v = rejection_sample([1, 1], p[:2].clone(), p, g)
    assert v.num_accepted == 2 and v.tokens == [1, 1, 2] and v.kinds == [ACCEPTED, ACCEPTED, BONUS]


def test_rejection_resamples_from_the_residual():
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[1.0, 0.0, 0.0]])
    p = torch.tensor([[0.0, 0.3, 0.7], [1.0, 0.0, 0.0]])            # p(x)=0: always rejected
    v = rejection_sample([0], q, p, g)
    assert v.num_accepted == 0 and v.tokens[0] in (1, 2) and v.kinds == [RESAMPLED]


def test_greedy_verify():
    assert greedy_verify(DraftTree.chain([5, 6, 7]), [5, 6, 9, 1]).tokens == [5, 6, 9]
    assert greedy_verify(DraftTree.chain([5, 6]), [5, 6, 8]).kinds == [ACCEPTED, ACCEPTED, BONUS]


def test_ngram_lookup_prefers_longest_most_recent_match():
    ctx = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert ngram_lookup(ctx, 2, 1, 3) == [4, 9]          # "1 2 3" -> 4 9
    assert ngram_lookup([7, 8, 9], 3, 1, 3) == []


# ---- end to end on the tiny model ----------------------------------------------------
def _tiny_engine(model, kv="auto", compile="off"):
    return LLMEngine(model, EngineConfig(kv_cache_dtype=kv, kv_cache_bytes=8 * 2**20, compile=compile), torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_prompts(tiny_model):
    """Token ids: [the question, the question + its greedy answer + the question again].
    On the question the tiny model soon loops over a few tokens (n-gram drafts get
    accepted). The second prompt repeats itself, so the n-gram proposer always has
    drafts; and it starts with the first request's prompt and output, so with prefix
    caching it reuses blocks that request wrote while speculating and rolling back."""
    eng = _tiny_engine(tiny_model)
    question = eng.encode(QUESTION)
    return [question, question + eng.generate_text(question, GREEDY)[1] + question]


KV_SCHEMES = ("auto", "fp8_e4m3", "fp8_e4m3_hadamard")


@pytest.fixture(scope="module")
def tiny_reference(tiny_model, tiny_prompts):
    """Target-only greedy outputs, per KV dtype and compile setting (FP8 and the compiled
    step's summation order change the numbers, so compare like with like)."""
    return {(kv, compile): [_tiny_engine(tiny_model, kv, compile).generate_text(p, GREEDY)[1] for p in tiny_prompts]
            for kv in KV_SCHEMES for compile in ("off", "on")}


def _no_blocks_in_use(eng) -> bool:
    return all(r.blocks.num_used_blocks == 0 for r in (eng.runner, eng.draft_runner) if r is not None)


@pytest.mark.parametrize("proposer,kv,prefix,compile",
                         list(itertools.product(["ngram", "suffix", "draft"], KV_SCHEMES, [True, False], ["off", "on"])))
def test_greedy_speculation_is_token_identical(make_tiny_engine, tiny_prompts, tiny_reference, proposer, kv, prefix,
                                               compile):
    eng = make_tiny_engine(kv_cache_dtype=kv, enable_prefix_caching=prefix, compile=compile)
    assert eng.settings()["compile"] == compile
    if proposer == "draft":
        eng.set_draft_model("self:1")                 # early exit: partial acceptance, real rollbacks
    proposed = accepted = 0
    for k in (1, 2, 4, 8):
        eng.reconfigure(proposer=proposer, num_speculative_tokens=k)
        for prompt, expected in zip(tiny_prompts, tiny_reference[kv, compile]):
            _, out, stats = eng.generate_text(prompt, GREEDY)
            assert out == expected, f"k={k}"
            assert stats.proposed > 0
            proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
        assert _no_blocks_in_use(eng)
    assert 0 < accepted < proposed                    # kept drafts and rolled-back drafts both happened


def test_greedy_speculation_is_token_identical_on_the_default_model(make_engine):
    prompt = chat("Repeat exactly: the cat sat on the mat, the cat sat on the mat, the dog sat on the log.")
    expected = make_engine(kv_cache_dtype="fp8_e4m3").generate_text(prompt, GREEDY)[1]
    eng = make_engine(kv_cache_dtype="fp8_e4m3", enable_prefix_caching=True)
    eng.set_draft_model("self:24")             # an early-exit draft: its own KV cache
    eng.reconfigure(proposer="draft", num_speculative_tokens=4)
    _, out, stats = eng.generate_text(prompt, GREEDY)
    assert out == expected
    assert 0 < stats.accepted < stats.proposed
    assert _no_blocks_in_use(eng)


def test_self_draft_accepts_everything(make_tiny_engine):
    eng = make_tiny_engine()
    eng.set_draft_model("self")
    eng.reconfigure(proposer="draft", num_speculative_tokens=4)
    _, _, stats = eng.generate_text(QUESTION, SamplingParams(max_tokens=21, stop_on_eos=False))
    assert stats.acceptance_rate == 1.0
    assert stats.per_position == [1.0] * 4
    assert stats.mean_accepted_len == 5.0                 # 4 accepted + the bonus per target pass


def test_rollback_keeps_exactly_the_blocks_needed(make_tiny_engine, tiny_prompts):
    eng = make_tiny_engine(block_size=4)
    eng.set_draft_model("self:1")
    eng.reconfigure(proposer="draft", num_speculative_tokens=8)
    prompt = tiny_prompts[1]
    generated = partial = rolled_back = 0
    for event in eng.generate(prompt, SamplingParams(max_tokens=60, stop_on_eos=False)):
        generated += len(event.token_ids)
        needed = -(-(len(prompt) + generated - 1) // 4)          # the last token has no KV yet
        if not event.finished:
            assert eng.runner.blocks.num_used_blocks == needed
            assert eng.draft_runner.blocks.num_used_blocks <= needed     # never more than the target
        partial += 0 < event.accepted < event.proposed
        rolled_back += event.accepted < event.proposed
    assert rolled_back >= 5 and partial >= 1
    assert _no_blocks_in_use(eng)


def test_live_k_and_proposer_changes_keep_greedy_output(make_tiny_engine, tiny_prompts, tiny_reference):
    eng = make_tiny_engine()
    eng.set_draft_model("self:1")
    schedule = {1: dict(proposer="ngram", num_speculative_tokens=3), 3: dict(proposer="draft", num_speculative_tokens=1),
                5: dict(num_speculative_tokens=7), 7: dict(proposer="off"), 9: dict(proposer="draft", num_speculative_tokens=2)}
    out, seen, most_proposed = [], [], {}
    for i, event in enumerate(eng.generate(tiny_prompts[1], GREEDY)):
        out.extend(event.token_ids)
        if seen:                                    # the last change applies from this step on
            proposer, k = seen[-1]
            assert event.proposed <= (0 if proposer == "off" else k), f"step {i} under {seen[-1]}"
            most_proposed[seen[-1]] = max(most_proposed.get(seen[-1], 0), event.proposed)
        if i in schedule:
            eng.reconfigure(**schedule[i])
            settings = eng.settings()
            seen.append((settings["proposer"], settings["num_speculative_tokens"]))
    assert out == tiny_reference["auto", "off"][1]
    assert seen == [("ngram", 3), ("draft", 1), ("draft", 7), ("off", 7), ("draft", 2)]
    assert most_proposed[("draft", 7)] == 7 and most_proposed[("off", 7)] == 0


def test_sampled_speculation_is_reproducible_with_a_seed(make_tiny_engine):
    eng = make_tiny_engine()
    eng.set_draft_model("self:1")
    eng.reconfigure(proposer="draft", num_speculative_tokens=3)

    def sampled(seed):
        params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=seed, stop_on_eos=False)
        _, ids, stats = eng.generate_text(QUESTION, params)
        assert stats.proposed > 0
        return ids
    assert sampled(123) == sampled(123)
    assert sampled(123) != sampled(124)             # the seed, not something fixed, decides the draw


class _Tok:
    def __init__(self, vocab, eos=2):
        self.vocab, self.eos_token_id, self.bos_token_id, self.pad_token_id = vocab, eos, 1, None

    def get_vocab(self):
        return self.vocab


def test_draft_with_another_tokenizer_is_named():
    target = _Tok({"a": 0, "b": 1, "c": 2})
    with pytest.raises(DraftIncompatibleError, match="token id 1 is 'x' in the draft but 'b' in the target"):
        check_draft_compatible(target, _Tok({"a": 0, "x": 1, "c": 2}))
    with pytest.raises(DraftIncompatibleError, match="eos_token_id"):
        check_draft_compatible(target, _Tok({"a": 0, "b": 1, "c": 2}, eos=0))
    check_draft_compatible(target, _Tok({"a": 0, "b": 1}))          # a shorter shared range is fine
