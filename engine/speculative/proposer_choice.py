"""`proposer: auto`: each step drafts with the proposer whose measured payoff is highest, or none.

The candidates are the proposers the engine has (suffix and n-gram always, EAGLE where a
head for the model loaded, the draft model where one is loaded) and "off". Each keeps
additive counters (engine.metrics.ProposerCounts) over the recent steps it drafted in:
sequences asked, draft tokens verified, accepted, drafting seconds. A candidate's payoff
is the decode rate of the step it would make (engine.metrics.decode_step_rate):

    rate = B * tau / (pass_s(B * (1 + verified) + other rows) + B * draft_s)

with, per asked sequence, tau = 1 + accepted (tokens per target pass: empty drafts, trimmed
trees and rejections included), verified = the draft tokens verified (the pass's extra rows)
and draft_s = the drafting seconds; pass_s is the speculation policy's measured pass time at
that width (SpeculationPolicy.predicted_pass_s), B the decoding sequences. "off" is tau 1,
nothing verified, nothing drafted. The chosen proposer then drafts as it would alone: the
policy picks a chain's k, or trims a tree to the nodes that pay.

Exploration is deterministic, so greedy output stays reproducible (and whatever drafts,
verification keeps the output the target's: greedy identical, sampled from its
distribution). A candidate with fewer than MIN_STEPS measured steps is chosen first, in
order; after that, one that has not drafted for EXPLORE_EVERY engine steps drafts for the
next EXPLORE_STEPS steps, so a proposer that lost is measured again as the text changes.
Each re-measurement that loses again doubles that candidate's wait (up to MAX_EXPLORE_EVERY),
and a win resets it: where nothing pays, measuring costs less and less of the run.

A retrieval proposer (SHADOWED: n-gram, suffix; drafting is a lookup, no model pass) is never
made to draft just to be measured: on the steps it does not draft, it is asked what it would
draft (at most once every SHADOW_EVERY steps of a request), and that draft, held against the
tokens the target then produces, is the step it would have made (`record_shadow`: the tokens it
would have had accepted, its lookup's seconds; under greedy decoding exactly the verdict a
verify pass would give), each counted as 1 / (1 + accepted) of a step: shadow drafts sample the
reply's positions evenly, while drafting for real a step covers 1 + accepted of them (so tau is
the harmonic mean over the samples, as a run drafting every step measures it). So where nothing
pays, nothing is verified to find that out: the lookups are all it costs. Its payoff is trusted after MIN_STEPS such steps, and a shadowed
candidate that pays is chosen and drafts for real.

A drafting candidate is chosen only where its expected rate beats drafting nothing by MARGIN
(5%): its tau comes from a few recent steps, and on the chat prompts a choice 3% ahead (the
suffix proposer at tau 1.04 from two drafting steps) ran at 0.93x.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from engine.metrics import ProposerCounts, decode_step_rate

OFF = "off"
MIN_STEPS = 4          # measured steps before a candidate's payoff is trusted
EXPLORE_EVERY = 64     # engine steps without drafting before a candidate is measured again
EXPLORE_STEPS = 4      # steps such a re-measurement lasts
MAX_EXPLORE_EVERY = 1024   # the longest wait of a candidate that lost every re-measurement
KEEP = 16              # recent steps per candidate its payoff is measured over
MARGIN = 0.05          # a drafting candidate must beat drafting nothing by this much to draft
SHADOWED = ("ngram", "suffix")     # measured on the steps they do not draft (see the module doc)
SHADOW_EVERY = 8       # a request's steps between two shadow drafts of one candidate


def shadow_verdict(drafted: list[int], produced: list[int], ended: bool) -> int | None:
    """How many of a shadow draft's tokens a verify pass would have accepted, given the tokens
    the target produced since it was drafted: its tokens up to the first the target did not
    produce. None while every token produced so far is as drafted and more are to come (or,
    with the request `ended`, never: -1, drop it)."""
    matched = next((i for i, (a, b) in enumerate(zip(drafted, produced)) if a != b), len(produced))
    if matched == len(produced) and len(produced) < len(drafted):
        return -1 if ended else None
    return matched


def shadow_counts(drafted: list[int], accepted: int, seconds: float) -> ProposerCounts:
    """A settled shadow draft as the step it would have been, counted as 1 / (1 + accepted) of
    a step: shadow drafts sample the reply's positions evenly, while drafting for real a step
    that accepts a tokens covers 1 + a of them, so such steps come 1 / (1 + a) as often. Summed,
    tau is the harmonic mean of the samples' 1 + accepted, as a run drafting every step measures it."""
    w = 1.0 / (1 + accepted)
    return ProposerCounts(asked=w, drafted=w * bool(drafted), proposed=w * len(drafted), accepted=w * accepted,
                          draft_s=w * seconds)


class ProposerChoice:
    def __init__(self, shadowed: tuple[str, ...] = ()):
        self.shadowed = shadowed                              # candidates measured by shadow drafts
        self.recent: dict[str, deque[ProposerCounts]] = {}    # per candidate: its recent steps' counts
        self.total: dict[str, ProposerCounts] = {}            # per candidate: every step's (the bench's)
        self.last_step: dict[str, int] = {}                   # the engine step it last drafted (or ran plain) in
        self.chosen, self.why = OFF, "nothing measured yet"
        self.exploring: tuple[str, int] | None = None         # (candidate, steps left) of a re-measurement
        self.rates: dict[str, float | None] = {}              # the last choice's payoffs (tokens per second)
        self.losses: dict[str, int] = {}                      # per candidate: re-measurements lost in a row
        self.remeasured: str | None = None                    # the candidate the last re-measurement was of

    def clear(self) -> None:
        self.__init__(self.shadowed)

    # ---- measurements --------------------------------------------------------------
    def record(self, name: str, step: int, counts: ProposerCounts) -> None:
        """One engine step's counts of the candidate that drafted in it."""
        if not counts.asked:
            return
        self.record_shadow(name, step, counts)
        self.total.setdefault(name, ProposerCounts()).add(counts)

    def record_shadow(self, name: str, step: int, counts: ProposerCounts) -> None:
        """A candidate's step in its recent payoff (`record` adds a drafted one to `total` too): a
        shadowed candidate's would-be step at engine step `step`, its draft held against the tokens
        the target produced (not drafted, so not in `total`)."""
        self.recent.setdefault(name, deque(maxlen=KEEP)).append(counts)
        self.last_step[name] = step

    def counts(self, name: str) -> ProposerCounts:
        """The candidate's counters over its recent steps."""
        total = ProposerCounts()
        for counts in self.recent.get(name, ()):
            total.add(counts)
        return total

    def rate(self, name: str, pass_s: Callable[[int], float | None], batch: int, other_rows: int = 0) -> float | None:
        """Expected tokens per second of this step drafted by `name` (None: not measured)."""
        counts = self.counts(name)
        if counts.asked == 0 or (name in self.shadowed and len(self.recent.get(name, ())) < MIN_STEPS):
            return None
        seconds = pass_s(round(batch * (1 + counts.verified_per_step)) + other_rows)
        if seconds is None:
            return None
        return decode_step_rate(batch, counts.tokens_per_step, seconds, counts.draft_s_per_step)

    # ---- the choice ----------------------------------------------------------------
    def choose(self, candidates: list[str], step: int, pass_s: Callable[[int], float | None],
               batch: int = 1, other_rows: int = 0) -> str:
        """The candidate that drafts at engine step `step` (see the module doc); sets chosen
        and why. pass_s(rows): the predicted seconds of a pass that wide (None: unmeasured)."""
        self.rates = {name: self.rate(name, pass_s, batch, other_rows) for name in candidates}
        best = max(candidates, key=lambda c: (self.rates[c] or 0.0, c == OFF))    # on a tie, no drafting
        if best != OFF and OFF in candidates and (self.rates[best] or 0.0) < (self.rates[OFF] or 0.0) * (1 + MARGIN):
            best = OFF                  # an edge within the measurement's noise: drafting nothing costs nothing
        if self.remeasured is not None and self.exploring is None:     # a re-measurement ended: did it win?
            self.losses[self.remeasured] = self.losses.get(self.remeasured, 0) + 1 if best != self.remeasured else 0
            self.remeasured = None
        name, why = self._measuring(candidates, step)
        if name is None:
            name = best
            counts = self.counts(name)
            others = ", ".join(f"{c} {_tok_s(self.rates[c])}" for c in candidates if c != name)
            why = (f"{name} has the highest expected rate, {_tok_s(self.rates[name])} (tau {counts.tokens_per_step:.2f}, "
                   f"{1e3 * counts.draft_s_per_step:.2f} ms drafting a sequence); {others}")
        self.chosen, self.why = name, why
        return name

    def _measuring(self, candidates: list[str], step: int) -> tuple[str | None, str]:
        """(a candidate to measure this step, why), or (None, "") when none needs it."""
        if self.exploring is not None:
            name, left = self.exploring
            self.exploring = (name, left - 1) if left > 1 else None
            if name in candidates:
                return name, f"measuring {name} again ({EXPLORE_STEPS} steps after {self.wait(name)} without)"
        measured = [c for c in candidates if c not in self.shadowed]         # a shadowed one never drafts to be measured
        for name in measured:
            if len(self.recent.get(name, ())) < MIN_STEPS:
                return name, f"measuring {name} (step {len(self.recent.get(name, ())) + 1} of {MIN_STEPS})"
        stale = [c for c in measured if step - self.last_step.get(c, step) >= self.wait(c)]
        if not stale:
            return None, ""
        name = min(stale, key=lambda c: self.last_step[c])                 # the longest unmeasured
        self.exploring = (name, EXPLORE_STEPS - 1) if EXPLORE_STEPS > 1 else None
        self.remeasured = name
        return name, f"measuring {name} again ({EXPLORE_STEPS} steps after {self.wait(name)} without)"

    def wait(self, name: str) -> int:
        """Engine steps a measured candidate waits before it is measured again."""
        return min(EXPLORE_EVERY << self.losses.get(name, 0), MAX_EXPLORE_EVERY)

    @property
    def is_measuring(self) -> bool:
        """The current choice measures a candidate rather than picking the best."""
        return self.why.startswith("measuring")

    def describe(self) -> dict:
        """What "In effect" shows: the choice, why, and each candidate's recent figures."""
        return {"chosen": self.chosen, "why": self.why,
                "candidates": {name: self.counts(name).as_dict() | {"expected_tok_s": self.rates.get(name)}
                               for name in self.rates},
                "totals": {name: counts.as_dict() for name, counts in self.total.items()}}


def _tok_s(rate: float | None) -> str:
    return "unmeasured" if rate is None else f"{rate:.1f} tok/s"
