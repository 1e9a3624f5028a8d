"""Speculative decoding: lossless greedy output, distribution-preserving sampling,
cache rollback, live k/proposer changes, draft compatibility."""
import itertools

import pytest
import torch

from engine import SamplingParams
from engine.errors import DraftIncompatibleError
from engine.metrics import ACCEPTED, BONUS, RESAMPLED
from engine.spec_decode import check_draft_compatible, greedy_verify, ngram_lookup, rejection_sample
from tests.conftest import chat

PROMPTS = [chat("Repeat exactly: the cat sat on the mat, the cat sat on the mat, the dog sat on the log."),
           chat("What is the capital of France?")]
GREEDY = SamplingParams(max_tokens=20, stop_on_eos=False)


# ---- the rejection sampler on its own ----------------------------------------------
P = torch.tensor([0.5, 0.2, 0.2, 0.1])        # target
Q = torch.tensor([0.1, 0.6, 0.1, 0.2])        # draft


def _emitted_distribution(accept_rule_broken: bool, n=40000, seed=0):
    """Draw x ~ q, run one-token speculation, histogram the emitted token."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4)
    target = torch.stack([P, P])                                      # [k+1, V]
    for _ in range(n):
        x = int(torch.multinomial(Q, 1, generator=g))
        if accept_rule_broken:       # "always accept the draft": emits q, not p
            counts[x] += 1
            continue
        verdict = rejection_sample([x], Q[None], target, g)
        counts[verdict.tokens[0]] += 1
    return counts / n


def test_emitted_tokens_follow_the_target_distribution():
    tv = 0.5 * (_emitted_distribution(False) - P).abs().sum()
    assert tv < 0.01


def test_a_broken_acceptance_rule_is_detected():
    tv = 0.5 * (_emitted_distribution(True) - P).abs().sum()
    assert tv > 0.1                                                    # the test can fail


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
    assert greedy_verify([5, 6, 7], [5, 6, 9, 1]).tokens == [5, 6, 9]
    assert greedy_verify([5, 6], [5, 6, 8]).kinds == [ACCEPTED, ACCEPTED, BONUS]


def test_ngram_lookup_prefers_longest_most_recent_match():
    ctx = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert ngram_lookup(ctx, 2, 1, 3) == [4, 9]          # "1 2 3" -> 4 9
    assert ngram_lookup([7, 8, 9], 3, 1, 3) == []


# ---- end to end on the default model -------------------------------------------------
@pytest.fixture(scope="module")
def reference_outputs(default_model):
    """Target-only greedy outputs, per KV dtype (FP8 changes the numbers, so compare like with like)."""
    import torch as t
    from engine import EngineConfig
    from engine.engine import LLMEngine
    out = {}
    for kv in ("auto", "fp8_e4m3"):
        eng = LLMEngine(default_model, EngineConfig(kv_cache_dtype=kv, kv_cache_bytes=64 * 2**20), t.device("cpu"))
        out[kv] = [eng.generate_text(p, GREEDY)[1] for p in PROMPTS]
    return out


@pytest.mark.parametrize("proposer,kv,prefix", list(itertools.product(["ngram", "draft"], ["auto", "fp8_e4m3"], [True, False])))
def test_greedy_speculation_is_token_identical(make_engine, reference_outputs, proposer, kv, prefix):
    eng = make_engine(kv_cache_dtype=kv, enable_prefix_caching=prefix)
    if proposer == "draft":
        eng.set_draft_model("self:6")                 # early exit: partial acceptance, real rollbacks
    for k in (1, 2, 4, 8):
        eng.reconfigure(proposer=proposer, num_speculative_tokens=k)
        for prompt, expected in zip(PROMPTS, reference_outputs[kv]):
            _, out, stats = eng.generate_text(prompt, GREEDY)
            assert out == expected, f"k={k}"
            assert stats.proposed > 0
        assert eng.runner.blocks.num_used_blocks == 0


def test_self_draft_accepts_everything(make_engine):
    eng = make_engine()
    eng.set_draft_model("self")
    eng.reconfigure(proposer="draft", num_speculative_tokens=4)
    _, _, stats = eng.generate_text(PROMPTS[1], SamplingParams(max_tokens=21, stop_on_eos=False))
    assert stats.acceptance_rate == 1.0
    assert stats.per_position == [1.0] * 4
    assert stats.mean_accepted_len == 5.0                 # 4 accepted + the bonus per target pass


def test_rollback_keeps_exactly_the_blocks_needed(make_engine):
    eng = make_engine(block_size=4)
    eng.set_draft_model("self:10")
    eng.reconfigure(proposer="draft", num_speculative_tokens=8)
    gen = eng.generate(PROMPTS[1], SamplingParams(max_tokens=60, stop_on_eos=False))
    partial = rolled_back = 0
    for event in gen:
        computed = event.prompt_tokens + event.generated_tokens - 1      # the last token has no KV yet
        needed = -(-computed // 4)
        if not event.finished:
            assert eng.runner.blocks.num_used_blocks == needed
            draft = eng.draft_runner.blocks.num_used_blocks
            assert draft <= needed                                           # never more than the target
        partial += 0 < event.accepted < event.proposed
        rolled_back += event.accepted < event.proposed
    assert rolled_back >= 5 and partial >= 1
    assert eng.runner.blocks.num_used_blocks == 0 and eng.draft_runner.blocks.num_used_blocks == 0


def test_live_k_and_proposer_changes_keep_greedy_output(make_engine, reference_outputs):
    eng = make_engine()
    eng.set_draft_model("self:6")
    schedule = {1: dict(proposer="ngram", num_speculative_tokens=3), 3: dict(proposer="draft", num_speculative_tokens=1),
                5: dict(num_speculative_tokens=7), 7: dict(proposer="off"), 9: dict(proposer="draft", num_speculative_tokens=2)}
    out, seen = [], set()
    for i, event in enumerate(eng.generate(PROMPTS[0], GREEDY)):
        out.extend(event.token_ids)
        seen.add((event.settings["proposer"], event.settings["num_speculative_tokens"]))
        if i in schedule:
            eng.reconfigure(**schedule[i])
    assert out == reference_outputs["auto"][0]
    assert {("ngram", 3), ("draft", 1), ("draft", 7), ("off", 7)} <= seen


def test_sampled_speculation_is_reproducible_with_a_seed(make_engine):
    eng = make_engine()
    eng.set_draft_model("self:6")
    eng.reconfigure(proposer="draft", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=123, stop_on_eos=False)
    assert eng.generate_text(PROMPTS[1], params)[1] == eng.generate_text(PROMPTS[1], params)[1]


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
