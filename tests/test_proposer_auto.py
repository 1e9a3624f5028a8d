"""`proposer: auto` (engine.speculative.proposer_choice): the choice by measured payoff from the
counters (pure, no timing), deterministic re-measurement, "off" when nothing pays; in the
engine, greedy output token-identical to plain decoding whichever proposer drafts, sampled
output with the target's distribution, and events and "In effect" saying who drafted and why."""
import pytest
import torch

from engine import SamplingParams
from engine.metrics import ProposerCounts, decode_step_rate
from engine.speculative import proposer_choice
from engine.speculative.policy import SpeculationPolicy
from engine.speculative.proposer_choice import (EXPLORE_EVERY, EXPLORE_STEPS, MAX_EXPLORE_EVERY, MIN_STEPS, OFF,
                                               ProposerChoice, shadow_counts, shadow_verdict)
from tests.conftest import assert_second_token_follows_the_target, chat, together

GREEDY = SamplingParams(max_tokens=24, stop_on_eos=False)
CANDIDATES = ["suffix", "ngram", OFF]


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest: the module on one thread


def pass_s(rows: int) -> float:
    """A made-up CPU: a pass costs 10 ms plus 1 ms a row."""
    return 0.010 + 0.001 * rows


def step(asked=1, proposed=0, accepted=0, draft_s=0.0) -> ProposerCounts:
    return ProposerCounts(asked=asked, drafted=int(proposed > 0), proposed=proposed, accepted=accepted, draft_s=draft_s)


def measured(choice: ProposerChoice, counts: dict[str, ProposerCounts], at: int = 0) -> int:
    """MIN_STEPS steps of each candidate with these counts, as a fresh choice measures them."""
    for name in CANDIDATES:
        for _ in range(MIN_STEPS):
            assert choice.choose(CANDIDATES, at, pass_s) == name and choice.is_measuring
            choice.record(name, at, counts[name])
            at += 1
    return at


# ---- the counters and the formula -------------------------------------------------------------
def test_counters_add_up_and_their_ratios_are_per_asked_sequence():
    counts = ProposerCounts()
    counts.add(step(asked=2, proposed=8, accepted=6, draft_s=0.002))
    counts.add(step(asked=2, proposed=0, accepted=0, draft_s=0.002))      # two sequences with no match
    assert (counts.asked, counts.drafted, counts.proposed, counts.accepted) == (4, 1, 8, 6)
    assert counts.tokens_per_step == pytest.approx(1 + 6 / 4)              # tau, the empty drafts included
    assert counts.verified_per_step == pytest.approx(2.0)
    assert counts.draft_s_per_step == pytest.approx(0.001)
    assert counts.draft_s_per_token == pytest.approx(0.0005)
    assert counts.acceptance_rate == pytest.approx(0.75)
    assert decode_step_rate(4, 2.5, 0.02, 0.001) == pytest.approx(4 * 2.5 / (0.02 + 4 * 0.001))


# ---- the choice (pure) ------------------------------------------------------------------------
def test_a_shadow_draft_is_settled_as_a_verify_pass_would_and_waits_while_it_still_matches():
    assert shadow_verdict([5, 6, 7, 8], [5, 9], ended=False) == 1           # the second token differs: 1 accepted
    assert shadow_verdict([5, 6, 7, 8], [4], ended=False) == 0
    assert shadow_verdict([5, 6, 7, 8], [5, 6], ended=False) is None        # all as drafted so far: wait
    assert shadow_verdict([5, 6, 7, 8], [5, 6], ended=True) == -1           # cut short by the request's end
    assert shadow_verdict([5, 6, 7, 8], [5, 6, 7, 8], ended=False) == 4
    assert shadow_verdict([], [], ended=False) == 0                         # nothing to draft: a plain step


def test_shadow_drafts_count_steps_not_positions():
    """Half the reply's positions would accept 4 of 4 drafts (a step covers 5 tokens there), half
    none: drafting every step takes 1/5 + 1 steps per two positions, so 2 / 1.2 = 1.67 tokens a
    step, not the positions' mean of 3."""
    total = ProposerCounts()
    for accepted in (4, 0, 4, 0):
        total.add(shadow_counts([1, 2, 3, 4], accepted, 0.001))
    assert total.tokens_per_step == pytest.approx(2 / 1.2)
    assert total.verified_per_step == pytest.approx(4.0)          # 4 draft tokens every step either way
    assert total.draft_s_per_step == pytest.approx(0.001)
    assert total.acceptance_rate == pytest.approx((2 * 4 / 5) / (2 * 4 / 5 + 2 * 4 / 1))


def test_shadowed_candidates_never_draft_to_be_measured_and_win_only_when_their_shadows_pay():
    """Where nothing pays, a shadowed (retrieval) candidate is never verified to find it out:
    the choice measures only the others, then keeps "off"; shadows that accept take over."""
    choice = ProposerChoice(shadowed=("suffix", "ngram"))
    picks, at = [], 0
    rejected = step(proposed=4, accepted=0, draft_s=0.0001)
    for at in range(400):
        name = choice.choose(CANDIDATES, at, pass_s)
        picks.append(name)
        choice.record(name, at, step())
        for shadowed in ("suffix", "ngram"):
            if at % 8 == 0:
                choice.record_shadow(shadowed, at, rejected)
    assert set(picks) == {OFF}                                         # nothing drafted, ever
    for at in range(400, 440):
        choice.record_shadow("suffix", at, step(proposed=4, accepted=3, draft_s=0.0001))
    assert choice.choose(CANDIDATES, 440, pass_s) == "suffix" and not choice.is_measuring



def test_a_fresh_choice_measures_each_candidate_in_order_then_picks_the_best_payoff():
    choice = ProposerChoice()
    counts = {"suffix": step(proposed=4, accepted=3, draft_s=0.0002),   # tau 4 over 5 rows: 4 / 15.2 ms
              "ngram": step(proposed=4, accepted=0, draft_s=0.0001),    # tau 1 over 5 rows: 1 / 15.1 ms
              OFF: step()}                                              # tau 1 over 1 row: 1 / 11 ms
    at = measured(choice, counts)
    assert choice.choose(CANDIDATES, at, pass_s) == "suffix" and not choice.is_measuring
    assert choice.rates["suffix"] == pytest.approx(decode_step_rate(1, 4.0, pass_s(5), 0.0002))
    assert choice.rates[OFF] == pytest.approx(1 / pass_s(1))
    assert choice.rates["suffix"] > choice.rates[OFF] > choice.rates["ngram"]
    assert "suffix" in choice.why and "ngram" in choice.why and "off" in choice.why
    described = choice.describe()
    assert described["chosen"] == "suffix"
    assert described["candidates"]["suffix"]["tokens_per_step"] == pytest.approx(4.0)


def test_the_batch_weighs_the_wider_verify_pass():
    """Four sequences: each draft row is a quarter of a pass that costs more; with this CPU a
    draft that accepts 1 of 4 no longer pays, while it did for one sequence alone."""
    choice = ProposerChoice()
    counts = {"suffix": step(proposed=4, accepted=1), "ngram": step(proposed=4, accepted=1), OFF: step()}
    at = measured(choice, counts)

    def costly_rows(rows):                          # rows past 8 cost 5 ms each
        return 0.010 + 0.001 * min(rows, 8) + 0.005 * max(rows - 8, 0)
    assert choice.choose(CANDIDATES, at, costly_rows, batch=1) == "suffix"
    assert choice.choose(CANDIDATES, at + 1, costly_rows, batch=4) == OFF


def test_nothing_pays_so_nothing_drafts():
    choice = ProposerChoice()
    rejected = step(proposed=4, accepted=0, draft_s=0.0001)        # drafts that never land cost a wider pass
    at = measured(choice, {"suffix": rejected, "ngram": rejected, OFF: step()})
    assert choice.choose(CANDIDATES, at, pass_s) == OFF
    assert choice.why.startswith("off has the highest expected rate")


def test_an_edge_within_the_noise_drafts_nothing():
    """A candidate 3% ahead of drafting nothing (tau from a few steps) does not draft; 15% ahead, it does."""
    rejected = step(proposed=4, accepted=0)
    for accepted, chosen in ((1, OFF), (2, "suffix")):
        choice = ProposerChoice()
        at = measured(choice, {"suffix": step(asked=8, proposed=8, accepted=accepted), "ngram": rejected, OFF: step()})
        assert choice.choose(CANDIDATES, at, pass_s) == chosen
        edge = choice.rates["suffix"] / choice.rates[OFF]
        assert edge == pytest.approx(1.03125 if accepted == 1 else 1.1458, abs=1e-3)


def test_a_costly_draft_loses_to_a_cheap_one_that_accepts_less():
    choice = ProposerChoice()
    counts = {"suffix": step(proposed=4, accepted=2, draft_s=0.0001),
              "ngram": step(proposed=4, accepted=3, draft_s=0.050),    # an EAGLE-like head slower than the pass
              OFF: step()}
    at = measured(choice, counts)
    assert choice.choose(CANDIDATES, at, pass_s) == "suffix"


def _run(steps: int, counts: dict[str, ProposerCounts]) -> list[str]:
    choice, picks = ProposerChoice(), []
    for at in range(steps):
        name = choice.choose(CANDIDATES, at, pass_s)
        choice.record(name, at, counts[name])
        picks.append(name)
    return picks


def test_a_candidate_that_lost_is_measured_again_less_and_less_often():
    counts = {"suffix": step(proposed=4, accepted=3), "ngram": step(proposed=4, accepted=0), OFF: step()}
    picks = _run(2000, counts)
    assert picks == _run(2000, counts)                             # deterministic: greedy stays reproducible
    first = len(CANDIDATES) * MIN_STEPS
    assert picks[:first] == [name for name in CANDIDATES for _ in range(MIN_STEPS)]
    best = [i for i in range(first, 2000) if picks[i] == "suffix"]
    assert len(best) > 0.95 * (2000 - first)                        # the winner drafts most steps
    for loser in ("ngram", OFF):
        again = [i for i in range(first, 2000) if picks[i] == loser]
        runs = [again[0]] + [b for a, b in zip(again, again[1:]) if b != a + 1]
        assert len(again) == EXPLORE_STEPS * len(runs)              # each re-measurement EXPLORE_STEPS in a row
        gaps = [b - (a + EXPLORE_STEPS - 1) for a, b in zip(runs, runs[1:])]
        # ...after a wait that doubles with every loss, from EXPLORE_EVERY up to MAX_EXPLORE_EVERY
        assert runs[0] >= EXPLORE_EVERY and len(gaps) >= 3
        assert all(gap >= min(EXPLORE_EVERY << (i + 1), MAX_EXPLORE_EVERY) for i, gap in enumerate(gaps)), gaps


def test_a_re_measured_candidate_that_now_pays_takes_over():
    choice = ProposerChoice()
    counts = {"suffix": step(proposed=4, accepted=0), "ngram": step(proposed=4, accepted=0), OFF: step()}
    at = measured(choice, counts)
    counts["ngram"] = step(proposed=4, accepted=4)                 # the text turned repetitive
    picks = []
    for at in range(at, at + 4 * EXPLORE_EVERY):
        name = choice.choose(CANDIDATES, at, pass_s)
        choice.record(name, at, counts[name])
        picks.append(name)
    assert picks[-EXPLORE_EVERY // 2:].count("ngram") > EXPLORE_EVERY // 4


# ---- in the engine ------------------------------------------------------------------------------
def test_greedy_with_auto_is_token_identical_alone_and_batched(make_tiny_engine, monkeypatch):
    # the tiny model's suffix drafts run 0-5% ahead of none by its measured pass times, within the
    # margin and the machine's noise (the choice itself is tested above with made-up costs): here a
    # pass costs the same at every width and every edge drafts, so that drafting is exercised
    monkeypatch.setattr(proposer_choice, "MARGIN", 0.0)
    monkeypatch.setattr(SpeculationPolicy, "predicted_pass_s", lambda self, rows: 0.010)
    base = make_tiny_engine()
    prompts = [base.encode(chat(q)) for q in ("What is the capital of France?", "Name three colours.", "Count to five.")]
    expected = [base.generate_text(p, GREEDY)[1] for p in prompts]
    prompts.append(prompts[0] + expected[0] + prompts[0])            # repeats itself: long matches
    expected.append(base.generate_text(prompts[3], GREEDY)[1])
    eng = make_tiny_engine()
    eng.reconfigure(proposer="auto", num_speculative_tokens=8)
    drafted_by, outs = [], []
    for p in prompts + prompts:                                       # every prompt twice: the choice moves on
        events = list(eng.generate(p, GREEDY))
        steps = [e.proposer for e in events if e.proposed]
        drafted_by += steps
        outs.append([t for e in events for t in e.token_ids])
        named = events[-1].summary.drafted_by                          # the reply's stats name each choice
        assert named == {name: steps.count(name) for name in set(steps)}
    assert outs == expected + expected
    assert together(eng, prompts, GREEDY) == expected                        # all four in the same steps
    totals = eng.speculator.proposer_choice.total
    assert {"suffix", "off"} <= set(totals) and totals["suffix"].accepted > 0
    assert "suffix" in drafted_by and set(drafted_by) <= {"suffix", "ngram"}    # each event says who drafted it
    # the retrieval proposers were measured by their shadow drafts (the steps they would have made)
    shadowed = eng.speculator.proposer_choice.recent
    assert all(len(shadowed.get(name, ())) > 0 for name in ("suffix", "ngram"))
    settings = eng.settings()
    assert settings["proposer"] == "auto"
    choice = settings["proposer_choice"]
    assert choice["chosen"] in ("suffix", "ngram", "off") and choice["why"]
    assert set(choice["candidates"]) == {"suffix", "ngram", "off"}
    assert "eagle" in choice["left_out"] and "draft" in choice["left_out"]   # no head fits the tiny model
    assert all(r.blocks.num_used_blocks == 0 for r in eng.runners())


def test_auto_replies_join_the_suffix_index_even_when_it_did_not_draft(make_tiny_engine):
    eng = make_tiny_engine()
    eng.reconfigure(proposer="auto")
    eng.speculator.proposer_choice.chosen = OFF
    eng.speculator.proposer_choice.recent = {name: [step()] * MIN_STEPS for name in CANDIDATES}   # measured: nothing pays
    eng.speculator.proposer_choice.last_step = {name: 10**9 for name in CANDIDATES}
    eng.generate_text(eng.encode(chat("Name three colours.")), SamplingParams(max_tokens=6, stop_on_eos=False))
    assert eng.speculator.suffix_cache.index.num_tokens == 6


def test_sampled_output_with_auto_keeps_the_target_distribution(make_tiny_engine, monkeypatch):
    """Temperature 1: the second token is verified from whichever proposer auto chose for that
    step (suffix trees of earlier replies' second tokens, n-gram chains, or none); its
    frequencies match the target's own probabilities (chi-square). Every candidate is measured
    again after 4 steps without drafting here (no backoff, and no shadow drafts: each drafts to
    be measured), so the measurements take turns and each candidate drafts a steady share of
    the second tokens whatever the timings (which one the payoffs favour depends on the
    machine: a faster step moved it)."""
    monkeypatch.setattr(proposer_choice, "EXPLORE_EVERY", 4)
    monkeypatch.setattr(proposer_choice, "MAX_EXPLORE_EVERY", 4)
    eng = make_tiny_engine()
    eng.reconfigure(proposer="auto", num_speculative_tokens=4)
    eng.speculator.proposer_choice.shadowed = ()
    seen = []
    step_fn = eng.step

    def recording():
        events = step_fn()
        seen.extend((e.step, e.proposer, e.proposed) for e in events)
        return events
    eng.step = recording
    assert_second_token_follows_the_target(eng, eng.encode(chat("Name a colour.")), max_tokens=4)
    second = [proposer for index, proposer, proposed in seen if index == 1 and proposed]
    assert second.count("suffix") >= 50                              # earlier replies' second tokens, as trees
    assert {"suffix", "ngram", "off"} <= set(eng.speculator.proposer_choice.total)   # the choice moved among them
