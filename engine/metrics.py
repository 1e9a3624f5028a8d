"""One event per engine step, and running aggregates (DESIGN.md metric definitions).

- acceptance rate = accepted draft tokens / proposed draft tokens
- mean accepted length tau = tokens emitted per target forward pass (incl. the bonus token)
- per-position acceptance = P(draft token i accepted | tokens < i accepted)
- TTFT = submission -> first generated token available
- decode speed = generated tokens after the first / decode wall time (TTFT excluded)
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Kinds of emitted tokens (the app colours them).
TARGET = "target"         # sampled by the target with no speculation this step
ACCEPTED = "accepted"     # a draft token the target accepted
RESAMPLED = "resampled"   # drawn from norm(max(0, p - q)) after a rejection (greedy: target argmax)
BONUS = "bonus"           # drawn from p after all k draft tokens were accepted


@dataclass
class StepEvent:
    step: int
    token_ids: list[int]
    token_kinds: list[str]
    text_delta: str
    time_s: float                   # since submission
    step_time_s: float
    target_time_s: float
    draft_time_s: float
    proposed: int
    accepted: int
    accepted_per_position: list[bool]   # for positions 1..: True accepted, False rejected (then stop)
    kv_bytes_used: int                  # blocks held by live sequences (target + draft)
    kv_bytes_capacity: int              # the pool(s) allocated
    kv_bytes_per_token: int
    kv_dtype: str
    prefix_hit_tokens: int
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None = None         # set on the first event of a request
    finished: bool = False
    finish_reason: str | None = None    # "stop" | "length" | "cancelled"
    settings: dict = field(default_factory=dict)   # settings in effect for this step
    summary: "RequestStats | None" = None          # on the last event


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_time_s: float = 0.0
    target_passes: int = 0            # target forward passes after prefill
    proposed: int = 0
    accepted: int = 0
    position_attempts: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0

    def record_step(self, event: StepEvent) -> None:
        if event.ttft_s is not None:
            return   # the prefill step: counted in TTFT, not in decode
        self.target_passes += 1
        self.decode_time_s += event.step_time_s
        self.proposed += event.proposed
        self.accepted += event.accepted
        self.draft_time_s += event.draft_time_s
        self.target_time_s += event.target_time_s
        for i, ok in enumerate(event.accepted_per_position):
            while len(self.position_attempts) <= i:
                self.position_attempts.append(0)
                self.position_accepts.append(0)
            self.position_attempts[i] += 1
            self.position_accepts[i] += int(ok)

    @property
    def decode_tokens(self) -> int:
        return max(self.generated_tokens - 1, 0)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_len(self) -> float | None:
        return self.decode_tokens / self.target_passes if self.target_passes else None

    @property
    def per_position(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.position_accepts, self.position_attempts)]

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "prefix_hit_tokens": self.prefix_hit_tokens,
                "generated_tokens": self.generated_tokens, "ttft_s": self.ttft_s,
                "decode_tok_s": self.decode_tok_s, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_len": self.mean_accepted_len, "per_position": self.per_position,
                "proposed": self.proposed, "accepted": self.accepted, "target_passes": self.target_passes,
                "draft_time_s": self.draft_time_s, "target_time_s": self.target_time_s}
