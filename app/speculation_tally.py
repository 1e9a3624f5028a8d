"""Does speculation pay over the session? The speculative replies of one set-up, added up.

Each step of a speculative reply carries the reply's own figure (`speculation`:
engine.metrics.speculation_report on its aggregates so far). The tally adds up the replies
of the current set-up, the one in progress included, with engine.metrics.combine_running,
and reports on the sum against the latest plain-decode baseline. The owner (MetricsHistory)
says when the set-up changes; a reply during which it changed stays out of the new tally,
since its counters mix both set-ups. Plain data in, plain data out: no Qt, no formula here.
"""
from __future__ import annotations

from engine.metrics import PositionCounts, combine_running, speculation_report


class SpeculationTally:
    def __init__(self):
        self.reset()

    def reset(self, mid_reply: bool = False) -> None:
        """A new set-up: forget the replies so far (and the rest of one under way)."""
        self.finished: list[dict] = []        # each finished speculative reply's aggregates
        self.live: dict | None = None         # the reply in progress, once it speculated
        self.positions = PositionCounts()     # per-position counts of those replies' steps
        self.baseline: tuple | None = None    # (k, plain step s, its source) of the latest report
        self.skipping = mid_reply
        self.report: dict | None = None

    def record_step(self, event: dict) -> None:
        if event["step"] == 0:                # a new reply: the previous one is complete
            self.skipping = False
            if self.live is not None:
                self.finished.append(self.live)
                self.live = None
        if self.skipping:
            return
        self.positions.add(event["accepted_per_position"])
        reply = event.get("speculation")
        if reply:
            self.live = event["running"]
            self.baseline = (reply["k"], 1.0 / reply["plain_tok_s"], reply["plain_source"])
            self.report = self._report()

    def _report(self) -> dict | None:
        """speculation_report over the tally's replies, with how many they are ("replies")."""
        runs = self.finished + ([self.live] if self.live is not None else [])
        k, plain_step_s, source = self.baseline
        report = speculation_report(combine_running(runs, self.positions), k, plain_step_s, source)
        return None if report is None else report | {"replies": len(runs)}
