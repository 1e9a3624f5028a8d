"""One event per engine step, running aggregates, and every metric formula (DESIGN.md).

Counters are plain and additive; every ratio the app, the bench and the training recipe
show is derived here, and only here:
- acceptance rate = accepted draft tokens / proposed draft tokens
- mean accepted length tau = tokens emitted per target forward pass (incl. the bonus token)
- per-position acceptance = P(draft token i accepted | tokens < i accepted)
- alpha per attempted token = accepted / attempted positions (the i.i.d. model's alpha)
- TTFT = submission -> first generated token available
- decode speed = generated tokens after the first / decode wall time (TTFT excluded), over
  the steps that did not compile: a step whose pass compiled the step graph (compile_s > 0)
  is marked and kept out, tokens and time, so a first reply does not report a compile as
  decode time (TPOT and ITL stay wall time)
- ITL = the time between a request's consecutive events (a speculative step's tokens arrive
  together, as in vLLM's streamed chunks); TPOT = (E2EL - TTFT) / (output tokens - 1);
  E2EL = submission -> last token; queue time = submission -> first scheduled
Serving figures over many requests (serving_summary) carry vLLM bench serve's names; a
run's figures for the app's results table (run_figures) come with 95% bootstrap intervals
over its requests (bootstrap_ci; two runs' difference: bootstrap_difference).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field, fields

# Kinds of emitted tokens (the app colours them).
TARGET = "target"         # sampled by the target with no speculation this step
ACCEPTED = "accepted"     # a draft token the target accepted
RESAMPLED = "resampled"   # drawn from norm(max(0, p - q)) after a rejection (greedy: target argmax)
BONUS = "bonus"           # drawn from p after all k draft tokens were accepted
SERVER = "server"         # streamed by a remote server, which does not say whether a draft proposed it


# ---- formulas -----------------------------------------------------------------------
def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when nothing was counted."""
    return numerator / denominator if denominator else None


def plus(total, value):
    """total + value, where a missing number (None: a remote server does not report it)
    stays missing instead of being counted as 0."""
    return None if total is None or value is None else total + value


def accepted_len_from_counters(accepted: float, drafts: float) -> float | None:
    """tau from a server's spec-decode counters (vLLM's convention): 1 + accepted / drafts,
    i.e. tokens per verification pass including the bonus token."""
    per_draft = ratio(accepted, drafts)
    return None if per_draft is None else 1 + per_draft


def expected_accepted_len(alpha: float, k: int) -> float:
    """tau for i.i.d. per-token acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else float(k + 1)


def decode_step_rate(batch: int, tokens_per_sequence: float, pass_s: float, draft_s_per_sequence: float) -> float:
    """Expected tokens per second of a decode step in which `batch` sequences each emit
    tokens_per_sequence tokens (tau: 1 without drafts, the bonus token included) from one
    target pass of pass_s seconds, after drafting for draft_s_per_sequence seconds each:
        batch * tau / (pass_s + batch * draft_s)
    The speculation policy's k (tau = expected_accepted_len) and `proposer: auto`'s choice
    (tau measured, ProposerCounts) both weigh a step by it."""
    return batch * tokens_per_sequence / (pass_s + batch * draft_s_per_sequence)


def predicted_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Decode speedup of speculation over plain decoding under the i.i.d. model:
    tau / (k * draft_cost + verify_cost), costs relative to one plain target step
    (draft_cost per drafted token, verify_cost for the (k+1)-token target pass)."""
    return expected_accepted_len(alpha, k) / (k * draft_cost + verify_cost)


def break_even_alpha(k: int, draft_cost: float, verify_cost: float) -> float | None:
    """The alpha at which predicted_speedup is 1.0 for these k and costs: below it speculation
    loses. 0.0 when it pays at any alpha; None when even alpha = 1 loses."""
    if predicted_speedup(1.0, k, draft_cost, verify_cost) < 1.0:
        return None
    if predicted_speedup(0.0, k, draft_cost, verify_cost) >= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(40):                  # predicted_speedup grows with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_speedup(mid, k, draft_cost, verify_cost) < 1.0 else (lo, mid)
    return hi


def expected_chain_accepted(rates: list[float], length: int) -> float:
    """Expected accepted tokens of a chain of `length` drafts, per-position acceptance `rates`
    (P(token i accepted | the ones before were)): sum over i <= length of P(the first i all
    accepted). A position never reached has rate 0."""
    reach, total = 1.0, 0.0
    for i in range(length):
        reach *= rates[i] if i < len(rates) else 0.0
        total += reach
    return total


def expected_tokens_per_step(draft_lengths: dict, rates: list[float], tree_steps: int = 0,
                             tree_accepted: int = 0) -> float | None:
    """Tokens a decode step emits, as the measurement's model: each chain step by the drafts it
    really verified (`draft_lengths`: steps by length, 0 where nothing was drafted) under the
    per-position acceptance, 1 + expected_chain_accepted; each tree step its measured
    1 + accepted. None before any step."""
    steps = sum(draft_lengths.values()) + tree_steps
    if not steps:
        return None
    chains = sum(n * (1 + expected_chain_accepted(rates, int(length))) for length, n in draft_lengths.items())
    return (chains + tree_steps + tree_accepted) / steps


def speculation_report(running: dict, k: int, plain_step_s: float | None, plain_source: str | None = None) -> dict | None:
    """Does speculation pay? From a request's (or several requests') aggregates
    (RequestStats.as_dict) and the wall time of a plain decode step with the same model and
    cache settings:
      measured_speedup  = decode tok/s with speculation / plain decode tok/s
      draft_cost        = draft time per drafted token / plain step
      verify_cost       = target time per target pass / plain step
      predicted_speedup = the measurement's model: expected_tokens_per_step (the per-position
                          acceptance over the drafts each step really proposed, none counted
                          as none) / (the measured seconds of a decoding step, its pass, drafting
                          and the rest of its work, / plain step);
                          without per-step counts (a server's), predicted_speedup(alpha, k,
                          draft_cost, verify_cost): k drafts every step (`prediction_model` says which)
      break_even_alpha  = the per-token alpha at which k drafts every step would pay 1.0
                          (predicted_speedup(alpha, k, draft_cost, verify_cost), i.i.d.)
    None until a draft token was proposed and a plain step time is known."""
    if not running.get("proposed") or not plain_step_s or not running.get("target_passes"):
        return None
    alpha = running.get("alpha")
    draft_cost = (ratio(running["draft_time_s"], running["proposed"]) or 0.0) / plain_step_s
    verify_cost = running["target_time_s"] / running["target_passes"] / plain_step_s
    # a decoding step's measured seconds: its pass, its drafting and the rest of its work (scheduling,
    # verification, proposer auto's choice), as the plain step's time holds the rest of a plain step's
    pass_and_draft_s = running["target_time_s"] + running["draft_time_s"]
    step_s = max(running.get("decode_time_s") or 0.0, pass_and_draft_s)
    step_cost = step_s / running["target_passes"] / plain_step_s
    tokens = expected_tokens_per_step(running.get("draft_lengths") or {}, running.get("per_position") or [],
                                      running.get("tree_steps", 0), running.get("tree_accepted", 0))
    if tokens is not None:
        predicted, model = tokens / step_cost, "per step"
    else:       # no per-step counts (a server's counters): k drafts every step, i.i.d.
        predicted, model = (None if alpha is None else predicted_speedup(alpha, k, draft_cost, verify_cost)), "i.i.d."
    return {"measured_speedup": running["decode_tok_s"] * plain_step_s if running["decode_tok_s"] else None,
            "predicted_speedup": predicted, "prediction_model": model,
            "alpha": alpha, "k": k, "draft_cost": draft_cost, "verify_cost": verify_cost,
            "step_cost": step_cost, "step_other_cost": (step_s - pass_and_draft_s) / running["target_passes"] / plain_step_s,
            "break_even_alpha": break_even_alpha(k, draft_cost, verify_cost),
            "plain_tok_s": 1.0 / plain_step_s, "plain_source": plain_source}


def attempted_positions(accepted: int, proposed: int) -> list[bool]:
    """One verify step's outcome per draft position: the accepted ones, then the first
    rejected one if a draft was rejected; positions after it were never attempted."""
    return [i < accepted for i in range(min(accepted + 1, proposed))]


@dataclass
class PositionCounts:
    """Per-position attempts and accepts. Position i is attempted only when every draft
    token before it was accepted, so accepts[i] / attempts[i] is the conditional rate."""
    attempts: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)

    def add(self, accepted_per_position) -> None:
        self._grow(len(accepted_per_position))
        for i, ok in enumerate(accepted_per_position):
            self.attempts[i] += 1
            self.accepts[i] += bool(ok)

    def merge(self, other: "PositionCounts") -> None:
        self._grow(len(other.attempts))
        for i, (n, a) in enumerate(zip(other.attempts, other.accepts)):
            self.attempts[i] += n
            self.accepts[i] += a

    def _grow(self, positions: int) -> None:
        missing = positions - len(self.attempts)
        if missing > 0:
            self.attempts.extend([0] * missing)
            self.accepts.extend([0] * missing)

    @classmethod
    def from_cumulative(cls, drafts: int, accepted_per_position: list[int]) -> "PositionCounts":
        """From a server's counters: drafts verified, and per position i how many drafts had
        their first i+1 tokens accepted (vLLM's and llama.cpp's *_accepted_tokens_per_pos).
        Position i was attempted whenever position i-1 was accepted (every draft proposing
        at least i+1 tokens, as with a fixed k)."""
        attempts = [int(drafts)] + [int(a) for a in accepted_per_position[:-1]]
        return cls(attempts=attempts, accepts=[int(a) for a in accepted_per_position])

    def rates(self) -> list[float]:
        """P(draft token i accepted | tokens < i accepted), for positions tried so far."""
        return [a / n for a, n in zip(self.accepts, self.attempts) if n]

    def alpha(self) -> float | None:
        """Accepted / attempted over all positions: the i.i.d. model's per-token alpha (the
        acceptance rate counts never-attempted drafts after a rejection, so it is lower)."""
        return ratio(sum(self.accepts), sum(self.attempts))


@dataclass
class ProposerCounts:
    """One proposer's additive counters over decode steps it was asked to draft in (what
    `proposer: auto` weighs; "off" counts its plain steps). Per asked sequence:
      tokens_per_step    = tau = 1 + accepted / asked (tokens per target pass; empty drafts,
                           trimmed trees and rejections included)
      verified_per_step  = draft tokens (tree nodes) verified / asked: the pass's extra rows
      draft_s_per_step   = drafting seconds / asked
      draft_s_per_token  = drafting seconds / draft tokens verified (0.0 before any)
      acceptance_rate    = accepted / proposed"""
    asked: int = 0             # sequence-steps it was asked to draft for (one per sequence per step)
    drafted: int = 0           # of those, with at least one draft token verified
    proposed: int = 0          # draft tokens verified
    accepted: int = 0
    draft_s: float = 0.0

    def add(self, other: "ProposerCounts") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def tokens_per_step(self) -> float | None:
        per = ratio(self.accepted, self.asked)
        return None if per is None else 1 + per

    @property
    def verified_per_step(self) -> float | None:
        return ratio(self.proposed, self.asked)

    @property
    def draft_s_per_step(self) -> float | None:
        return ratio(self.draft_s, self.asked)

    @property
    def draft_s_per_token(self) -> float:
        return ratio(self.draft_s, self.proposed) or 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return ratio(self.accepted, self.proposed)

    def as_dict(self) -> dict:
        return asdict(self) | {"tokens_per_step": self.tokens_per_step, "verified_per_step": self.verified_per_step,
                               "draft_ms_per_step": None if self.draft_s_per_step is None else 1e3 * self.draft_s_per_step,
                               "acceptance_rate": self.acceptance_rate}


# ---- events and aggregates ------------------------------------------------------------
@dataclass
class StepEvent:
    step: int
    token_ids: list[int]
    token_kinds: list[str]
    pieces: list[tuple[str, str]]       # the step's new text as (text, kind) runs, exact per token
    time_s: float                       # since submission
    step_time_s: float
    target_time_s: float
    draft_time_s: float
    target_passes: int                  # target forward passes this step (0: cancelled before one)
    proposed: int
    accepted: int
    accepted_per_position: list[bool]   # for positions 1..: True accepted, False rejected (then stop)
    # None below: a remote server that does not report the number (never a made-up 0).
    kv_bytes_used: int | None           # blocks held by live sequences (target + draft)
    kv_bytes_capacity: int | None       # the pool(s) allocated
    kv_bytes_per_token: int | None
    kv_dtype: str | None
    prefix_hit_tokens: int
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None = None         # set on the first event of a request
    finished: bool = False
    finish_reason: str | None = None    # "stop" | "length" | "cancelled"
    settings: dict | None = None        # the settings in effect: on the first step and when they change
    running: dict = field(default_factory=dict)     # the request's aggregates so far (RequestStats.as_dict)
    summary: "RequestStats | None" = None           # on the last event
    token_count: int | None = None      # tokens this step when their ids are unknown (a remote server streams text)
    kv_usage: float | None = None       # share of the KV cache in use, as a remote server reports it (0..1)
    server: dict | None = None          # a remote server's own figures (engine.remote.server_metrics); None locally
    speculation: dict | None = None     # speculation_report of the request so far, once it speculated
    request_id: int | None = None       # which request advanced (LLMEngine.submit's id)
    engine_step: dict | None = None     # the engine step that produced it (EngineStep.as_dict)
    compile_s: float = 0.0              # seconds of this step spent compiling (0.0: none); kept out of decode speed
    tree_nodes: int = 0                 # a draft tree's nodes verified in this step (0: a chain, or none)
    tree_predicted_accepted: float | None = None   # what the draft's confidences predicted it accepts
    proposer: str | None = None         # which proposer drafted this step (suffix, ngram, eagle, draft; None: none
                                        # did), under `proposer: auto` the one it chose for the step

    @property
    def num_tokens(self) -> int:
        """Tokens emitted this step (counted by the server when it streams text, not ids)."""
        return len(self.token_ids) if self.token_count is None else self.token_count

    @property
    def tokens_known(self) -> bool:
        """False when a remote server streamed text without counting its tokens."""
        return self.token_count is not None or bool(self.token_ids) or not self.pieces

    @property
    def text_delta(self) -> str:
        return "".join(text for text, _ in self.pieces)

    @property
    def is_decode(self) -> bool:
        """Decode steps count towards decode speed; the prefill step is TTFT."""
        return self.ttft_s is None

    def as_dict(self) -> dict:
        """Plain data for another thread or a file, with the step's own ratios."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "summary"}
        data["text_delta"] = self.text_delta
        data["step_acceptance"] = ratio(self.accepted, self.proposed)
        data["num_tokens"] = self.num_tokens
        timed = self.is_decode and self.tokens_known and not self.compile_s   # a compiling step has no speed
        data["step_tok_s"] = ratio(self.num_tokens, self.step_time_s) if timed else None
        data["summary"] = self.summary.as_dict() if self.summary is not None else None
        return data


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_recomputed_tokens: int = 0     # cached prompt tokens recomputed: no state snapshot reached them (hybrid)
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_tokens: int = 0            # tokens emitted by decode steps (all but the first)
    decode_time_s: float = 0.0
    target_passes: int = 0            # target forward passes after prefill
    proposed: int = 0
    accepted: int = 0
    positions: PositionCounts = field(default_factory=PositionCounts)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    queue_time_s: float | None = None     # submission -> first scheduled
    e2e_s: float | None = None            # submission -> last event
    preemptions: int = 0
    itl_s: list[float] = field(default_factory=list)    # gaps between its events after the first
    compile_s: float = 0.0            # wall time of its decode steps that compiled (kept out of decode speed)
    tree_steps: int = 0               # decode steps that verified a draft tree
    tree_nodes: int = 0               # nodes those trees verified
    tree_predicted: float = 0.0       # accepted nodes the draft's confidences predicted for them
    tree_time_s: float = 0.0          # drafting and verify-pass seconds of those steps
    compile_tokens: int = 0           # tokens those steps emitted
    compile_steps: int = 0            # its steps whose pass compiled, prefill included (0 once the step is warm)
    drafted_by: dict[str, int] = field(default_factory=dict)   # decode steps each proposer drafted (proposer auto's choices)
    draft_lengths: dict[int, int] = field(default_factory=dict)  # chain decode steps by drafts verified (0: none)
    tree_accepted: int = 0            # nodes the tree steps accepted

    def record_step(self, event: StepEvent) -> None:
        self.generated_tokens = event.generated_tokens
        self.compile_steps += bool(event.compile_s)
        if not event.is_decode:
            self.ttft_s = event.ttft_s
            return   # the prefill step: counted in TTFT, not in decode
        if event.num_tokens:
            self.itl_s.append(event.step_time_s)
        self.target_passes = plus(self.target_passes, event.target_passes)
        self.decode_tokens += event.num_tokens
        self.decode_time_s += event.step_time_s
        if event.compile_s:
            self.compile_s += event.step_time_s
            self.compile_tokens += event.num_tokens
        self.proposed += event.proposed
        self.accepted += event.accepted
        if event.proposer and event.proposed:
            self.drafted_by[event.proposer] = self.drafted_by.get(event.proposer, 0) + 1
        if not event.tree_nodes and event.target_passes:
            self.draft_lengths[event.proposed] = self.draft_lengths.get(event.proposed, 0) + 1
        if event.tree_nodes:
            self.tree_accepted += event.accepted
            self.tree_steps += 1
            self.tree_nodes += event.tree_nodes
            self.tree_predicted += event.tree_predicted_accepted or 0.0
            self.tree_time_s += (event.draft_time_s or 0.0) + (event.target_time_s or 0.0)
        self.draft_time_s = plus(self.draft_time_s, event.draft_time_s)
        self.target_time_s = plus(self.target_time_s, event.target_time_s)
        self.positions.add(event.accepted_per_position)

    @property
    def decode_tok_s(self) -> float:
        """Decode tokens / decode wall time, the steps that compiled left out (both sides)."""
        return ratio(self.decode_tokens - self.compile_tokens, plus(self.decode_time_s, -self.compile_s)) or 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return ratio(self.accepted, self.proposed)

    @property
    def mean_accepted_len(self) -> float | None:
        return ratio(self.decode_tokens, self.target_passes)

    @property
    def per_position(self) -> list[float]:
        return self.positions.rates()

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: decode wall time / (tokens - 1)."""
        tokens = self.generated_tokens or 0          # None: a server that does not count them
        return ratio(self.decode_time_s, tokens - 1) if tokens > 1 and self.decode_time_s is not None else None

    def to_plain(self) -> dict:
        """Every field as plain data (for another thread or a file); from_plain reads it back."""
        return asdict(self)

    @classmethod
    def from_plain(cls, data: dict) -> "RequestStats":
        return cls(**data | {"positions": PositionCounts(**data["positions"]), "itl_s": list(data["itl_s"])})

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefix_recomputed_tokens": self.prefix_recomputed_tokens,
                "generated_tokens": self.generated_tokens, "ttft_s": self.ttft_s, "decode_tokens": self.decode_tokens,
                "decode_time_s": self.decode_time_s,
                "decode_tok_s": self.decode_tok_s, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_len": self.mean_accepted_len, "per_position": self.per_position,
                "proposed": self.proposed, "accepted": self.accepted, "target_passes": self.target_passes,
                "alpha": self.positions.alpha(),
                "draft_time_s": self.draft_time_s, "target_time_s": self.target_time_s,
                "queue_time_s": self.queue_time_s, "e2e_s": self.e2e_s, "tpot_s": self.tpot_s,
                "preemptions": self.preemptions, "compile_s": self.compile_s, "compile_tokens": self.compile_tokens,
                "compile_steps": self.compile_steps, "tree_steps": self.tree_steps, "tree_nodes": self.tree_nodes,
                "tree_predicted": self.tree_predicted,
                "tree_time_s": self.tree_time_s, "drafted_by": dict(self.drafted_by),
                "draft_lengths": dict(self.draft_lengths), "tree_accepted": self.tree_accepted}


# RequestStats' additive counters (its positions add up apart, by PositionCounts.merge).
COUNTERS = ("prompt_tokens", "prefix_hit_tokens", "generated_tokens", "ttft_s", "decode_tokens",
            "decode_time_s", "target_passes", "proposed", "accepted", "draft_time_s", "target_time_s",
            "compile_s", "compile_tokens", "compile_steps", "tree_steps", "tree_nodes", "tree_predicted",
            "tree_time_s", "tree_accepted")


def combined(stats: list[RequestStats]) -> RequestStats:
    """Several requests' counters added up (the bench reports a prompt set as one)."""
    total = RequestStats()
    for s in stats:
        for name in COUNTERS:
            setattr(total, name, plus(getattr(total, name), getattr(s, name)))
        total.positions.merge(s.positions)
        for proposer, steps in s.drafted_by.items():
            total.drafted_by[proposer] = total.drafted_by.get(proposer, 0) + steps
        for length, steps in s.draft_lengths.items():
            total.draft_lengths[int(length)] = total.draft_lengths.get(int(length), 0) + steps
    return total


def combine_running(runnings: list[dict], positions: PositionCounts | None = None) -> dict:
    """Several replies' aggregates, as RequestStats.as_dict gives them (a step's `running`, a
    reply's summary), added up by `combined` into one such dict with every ratio derived
    again: the session's figures for speculation_report. Those dicts carry per-position
    rates, not counts, so alpha and per_position come from `positions`, the same replies'
    PositionCounts merged (missing without it, never guessed from the rates)."""
    total = combined([RequestStats(**{name: running.get(name, 0) for name in COUNTERS},
                                   draft_lengths=running.get("draft_lengths") or {}) for running in runnings])
    if positions is not None:
        total.positions.merge(positions)
    return total.as_dict()


# ---- many requests at once ---------------------------------------------------------------
@dataclass
class EngineStep:
    """One engine step (one forward pass over every scheduled token). Names as vLLM's metrics:
      running, waiting   vllm:num_requests_running, vllm:num_requests_waiting
      kv_usage           vllm:kv_cache_usage_perc (blocks held / blocks in the pool, 0..1)
      preemptions        vllm:num_preemptions (this step)
      drafted, accepted  vllm:spec_decode_num_draft_tokens, ..._num_accepted_tokens (this step)"""
    step: int
    running: int                  # requests holding blocks after the step
    waiting: int
    batch_size: int               # requests in the pass
    prefill_tokens: int           # prompt (or recomputed) tokens in the pass
    decode_tokens: int            # decode and verify rows in the pass
    kv_blocks_used: int
    kv_blocks_free: int
    preemptions: int
    drafted: int
    accepted: int
    k: int                        # draft tokens per speculating sequence this step (the policy's choice)
    pass_s: float                 # the forward pass
    step_s: float                 # the whole step (scheduling, drafting, the pass, sampling)
    experts_active: float | None = None     # MoE: distinct experts the pass woke, mean over MoE layers (None: dense)
    compiles: int = 0             # calls of the compiled step that compiled this step (0 once warm, whatever the threads)
    threads: int = 0              # torch's CPU thread count the pass ran at (the thread governor's)

    @property
    def kv_usage(self) -> float:
        return ratio(self.kv_blocks_used, self.kv_blocks_used + self.kv_blocks_free) or 0.0

    def as_dict(self) -> dict:
        # every field is a number: a shallow copy (asdict's deep copy cost about 40 us a step)
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"kv_usage": self.kv_usage}


def pass_figures(shares: list, events: list[StepEvent]) -> dict:
    """An engine step's figures of its pass (EngineStep's fields), from each request's share
    of it (its `rows`: a prompt chunk, or the root and its `drafts`; whether it was a `decode`;
    the `max_drafts` it was allowed) and the events the step emitted:
      prefill_tokens = rows of prompt chunks         decode_tokens = rows of decodes and verifies
      drafted = draft tokens verified                accepted = of those, accepted
      k = the most drafts a sequence was allowed"""
    return {"batch_size": len(shares),
            "prefill_tokens": sum(s.rows for s in shares if not s.decode),
            "decode_tokens": sum(s.rows for s in shares if s.decode),
            "drafted": sum(len(s.drafts) for s in shares), "accepted": sum(e.accepted for e in events),
            "k": max((s.max_drafts for s in shares), default=0)}


def speculation_speedup_by_batch(steps: list[dict]) -> dict[int, dict]:
    """Speculation's measured speedup per batch size, from engine steps (EngineStep.as_dict):
    over the decode-only steps (no prefill rows in the pass) of each batch size, the median
    rate of steps that verified drafts over the median rate of steps that did not, where a
    step's rate is the tokens it emitted, batch_size + accepted (each sequence: its accepted
    drafts plus one), over its step time. batch size -> {"speedup" (None without both kinds
    of step), "spec_steps", "plain_steps"}. The policy's k = 0 steps (speculation_policy
    auto) give the plain rate at the same batch size in the same run."""
    rates: dict[int, tuple[list[float], list[float]]] = {}
    for step in steps:
        if step["prefill_tokens"] or not step["batch_size"] or step["step_s"] <= 0:
            continue
        spec, plain = rates.setdefault(step["batch_size"], ([], []))
        (spec if step["drafted"] else plain).append((step["batch_size"] + step["accepted"]) / step["step_s"])
    return {size: {"speedup": ratio(percentile(spec, 50), percentile(plain, 50)) if spec and plain else None,
                   "spec_steps": len(spec), "plain_steps": len(plain)}
            for size, (spec, plain) in sorted(rates.items())}


def experts_active_by_batch(steps: list[dict]) -> dict[int, dict]:
    """An MoE model's experts woken per step, by batch size, from engine steps
    (EngineStep.as_dict with experts_active): over the decode-only steps of each batch size,
    the mean of experts_active (distinct experts per MoE layer; a step reads each woken
    expert's weights once). batch size -> {"experts_active", "steps"}. Where a dense model's
    step reads the same weights at any batch size, an MoE step of B tokens reads up to
    min(experts, B x top_k) experts per layer: batching shares less of the weight reads."""
    by_batch: dict[int, list[float]] = {}
    for step in steps:
        if step.get("experts_active") is None or step["prefill_tokens"] or not step["batch_size"]:
            continue
        by_batch.setdefault(step["batch_size"], []).append(step["experts_active"])
    return {size: {"experts_active": statistics.fmean(values), "steps": len(values)}
            for size, values in sorted(by_batch.items())}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_fields(name: str, seconds: list[float]) -> dict:
    """mean_/median_/p99_{name}_ms, as vLLM's bench serve names them."""
    ms = [1000 * s for s in seconds]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
            f"median_{name}_ms": statistics.median(ms) if ms else None,
            f"p99_{name}_ms": percentile(ms, 99)}


def finished_requests(stats: list[RequestStats]) -> list[RequestStats]:
    """The requests that ran to their end (a cancelled request has no e2e time)."""
    return [s for s in stats if s.e2e_s is not None]


def ttft_values(done: list[RequestStats]) -> list[float]:
    """TTFT of every request that generated a token (seconds)."""
    return [s.ttft_s for s in done if s.generated_tokens]


def tpot_values(done: list[RequestStats]) -> list[float]:
    """TPOT of every request with 2+ tokens (seconds)."""
    return [s.tpot_s for s in done if s.tpot_s is not None]


def serving_summary(stats: list[RequestStats], duration_s: float) -> dict:
    """A finished workload's figures, named as vLLM's bench serve saves them:
      request_throughput     = completed requests / duration
      output_throughput      = generated tokens / duration
      total_token_throughput = (prompt + generated tokens) / duration
      ttft, tpot, itl, e2el  = mean / median / p99 in ms (TPOT over requests with 2+ tokens)."""
    done = finished_requests(stats)
    output = sum(s.generated_tokens for s in done)
    prompt = sum(s.prompt_tokens for s in done)
    return {"completed": len(done), "duration_s": duration_s,
            "total_input_tokens": prompt, "total_output_tokens": output,
            "request_throughput": ratio(len(done), duration_s), "output_throughput": ratio(output, duration_s),
            "total_token_throughput": ratio(prompt + output, duration_s),
            **latency_fields("ttft", ttft_values(done)),
            **latency_fields("tpot", tpot_values(done)),
            **latency_fields("itl", [gap for s in done for gap in s.itl_s]),
            **latency_fields("e2el", [s.e2e_s for s in done]),
            "preemptions": sum(s.preemptions for s in done),
            "prefix_hit_tokens": sum(s.prefix_hit_tokens for s in done)}


# ---- a run's figures with confidence intervals (the app's results table) --------------------
RUN_FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "preemptions")
BOOTSTRAP_RESAMPLES = 1000
CONFIDENCE = 0.95


def run_figures(stats: list[RequestStats], duration_s: float, concurrency: float | None = None) -> dict:
    """The results table's figures (RUN_FIGURES) of one run's finished requests:
      output_throughput = generated tokens / request time (sum of E2EL) x concurrency, where
                          concurrency = sum of E2EL / duration (Little's law: the mean number of
                          the run's requests in flight), so it equals generated tokens / duration;
                          a bootstrap resample keeps the run's concurrency and varies the rest
      median/p99 TTFT and TPOT (ms), as serving_summary (latency_fields)
      preemptions = the requests' preemptions, added up."""
    done = finished_requests(stats)
    busy_s = sum(s.e2e_s for s in done)
    concurrency = ratio(busy_s, duration_s) if concurrency is None else concurrency
    per_request_time = ratio(sum(s.generated_tokens for s in done), busy_s)
    ttft, tpot = latency_fields("ttft", ttft_values(done)), latency_fields("tpot", tpot_values(done))
    return {"output_throughput": None if per_request_time is None or concurrency is None
            else per_request_time * concurrency,
            "median_ttft_ms": ttft["median_ttft_ms"], "p99_ttft_ms": ttft["p99_ttft_ms"],
            "median_tpot_ms": tpot["median_tpot_ms"], "p99_tpot_ms": tpot["p99_tpot_ms"],
            "preemptions": sum(s.preemptions for s in done)}


def run_statistic(stats: list[RequestStats], duration_s: float):
    """run_figures of a resample of this run's finished requests, at the run's concurrency."""
    done = finished_requests(stats)
    concurrency = ratio(sum(s.e2e_s for s in done), duration_s)
    return lambda sample: run_figures(sample, duration_s, concurrency)


def bootstrap_ci(items: list, statistic, resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE,
                 seed: int = 0) -> dict:
    """Percentile bootstrap: `resamples` times, draw len(items) items with replacement
    (random.Random(seed): the same intervals for the same data) and compute statistic(sample),
    a dict of figures; each figure's interval is (lo, hi), the (1 - confidence) / 2 and
    (1 + confidence) / 2 percentiles of its resampled values, or None with no items or when
    the statistic gave it no value."""
    rng = random.Random(seed)
    draws = [statistic(rng.choices(items, k=len(items))) for _ in range(resamples)] if items else []
    return _intervals(draws, confidence)


def bootstrap_difference(a_items: list, a_statistic, b_items: list, b_statistic,
                         resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE, seed: int = 0) -> dict:
    """The interval of statistic(B) - statistic(A) per figure, A's and B's items resampled
    independently (two runs' requests), as bootstrap_ci; it excludes 0 when lo > 0 or hi < 0."""
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples if a_items and b_items else 0):
        a = a_statistic(rng.choices(a_items, k=len(a_items)))
        b = b_statistic(rng.choices(b_items, k=len(b_items)))
        draws.append({k: None if a.get(k) is None or b.get(k) is None else b[k] - a[k] for k in b})
    return _intervals(draws, confidence)


def excludes_zero(interval: tuple[float, float] | None) -> bool | None:
    """Whether a difference's interval lies wholly above or below 0 (None: no interval)."""
    return None if interval is None else interval[0] > 0 or interval[1] < 0


def _intervals(draws: list[dict], confidence: float) -> dict:
    tail = 100 * (1 - confidence) / 2
    out = {}
    for key in (draws[0] if draws else {}):
        values = [d[key] for d in draws if d.get(key) is not None]
        out[key] = (percentile(values, tail), percentile(values, 100 - tail)) if values else None
    return out
