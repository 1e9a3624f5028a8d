"""How many draft tokens the next step verifies, from the batch size and measured costs.

Speculation trades a wider verify pass for more tokens per pass. Alone on a CPU, a 5-row
pass costs about one decode step, so k = 4 is nearly free; with 16 sequences decoding, each
row of drafts is a sixteenth of a wider pass that now costs several decode steps, and
speculation loses (vLLM #4565, #17984; hence vLLM's speculative_disable_by_batch_size and
SGLang's batch-aware adaptive speculation). The policy picks the k (0 included) that
maximises expected tokens per second for the batch:

    throughput(k) = B * tau(alpha, k) / (pass_s(B * (k + 1) rows) + B * k * draft_s)

(engine.metrics.decode_step_rate) with tau from engine.metrics.expected_accepted_len, alpha
the proposer's measured per-token acceptance, pass_s the measured time of a pass that wide (interpolated between the widths
measured so far, linearly) and draft_s the measured time to draft one token. A width past
every measured one is tried once (k at its largest) before it is predicted.

A draft tree (engine.speculative.tree) is trimmed after it is grown: the n best nodes by the draft's
cumulative confidence are expected to accept calibration * (sum of their confidences) tokens
(EAGLE-2's observation that the confidence tracks acceptance; calibration is measured:
accepted over predicted, over the recent trees that verified a node and grew about as many
nodes: a suffix tree's size is bounded by its match's length, and on the edit prompts at
k = 8 the trees grown to 8 nodes accepted 0.82 of their confidences where one-node trees
accepted 0.35, so one ratio for both swung from 0.1 to 0.9 with the recent mix and cut good
trees after a run of poor ones), and the n that maximises

    (1 + calibration * sum of the n best confidences) / pass_s(1 + n rows + other rows)

is verified, n = 0 (a plain step) included; each of PROBE_NODES (and the full tree) is tried
twice at its width before widths are predicted. The tree is grown only one depth deeper than
the recent trimmed trees reached (drafting a depth costs a head pass). Whether to grow a
tree at all is measured too:
the recent tree steps' tokens per second (drafting included) against a plain step's; when
trees lose, plain steps run, with one tree every PROBE_EVERY steps to keep measuring. A tree
that costs (nearly) nothing to grow (under FREE_DRAFT of a plain pass: the suffix proposer's)
is always grown, as its trim already verifies no node where none pays.
Where the choice is to draft nothing (k = 0, or no tree), `paused` says why, in numbers; the
engine's settings carry it, so the app shows speculation switched off by itself.
"""
from __future__ import annotations

import statistics
from collections import deque

import math

from engine.metrics import PositionCounts, decode_step_rate, expected_accepted_len

KEEP = 32               # recent measurements per width
PRIOR_ALPHA = 0.6       # until a proposer has been tried: optimistic, or it would never be tried
MIN_ATTEMPTS = 16       # attempted draft positions before the measured alpha is trusted
MIN_TREES = 4           # tree steps before their calibration and speed are trusted
PROBE_EVERY = 64        # while trees lose: one tree step in this many, to keep measuring
FREE_DRAFT = 0.02       # growing a tree costing less than this part of a plain pass is free: the trim decides
# Tree sizes whose pass is measured before any is predicted: a pass's cost need not be linear
# in its rows (torch's CPU int4 kernel works in blocks of 4 rows: 4 rows cost about 1).
PROBE_NODES = (3, 7, 15)


def size_class(nodes: int | None) -> int:
    """A grown tree's size, in classes 1, 2-3, 4-7, 8-15, ... (0: unknown)."""
    return 0 if not nodes else nodes.bit_length()


class SpeculationPolicy:
    def __init__(self):
        self.pass_s: dict[int, deque] = {}          # rows in the pass -> recent pass seconds
        self._points: list | None = None            # predicted_pass_s's medians (None: to compute)
        self.draft_s: deque = deque(maxlen=KEEP)    # seconds per drafted token
        self.positions: dict[str, PositionCounts] = {}
        self.trees: deque = deque(maxlen=KEEP)     # (predicted accepted, accepted, tokens, seconds) per tree step
        # (predicted, accepted) of the recent trees that verified a node, by size_class of the tree grown
        self.verified: dict[int, deque] = {}
        self.tree_depths: deque = deque(maxlen=KEEP)   # the depth each verified (trimmed) tree reached
        self.tree_draft_s: deque = deque(maxlen=KEEP)  # the seconds each recent tree took to grow
        self.skipped_trees = 0                     # plain steps in a row since trees last lost
        self.paused: str | None = None             # why the last choice drafts nothing (None: it drafts)

    # ---- measurements --------------------------------------------------------------
    def record_pass(self, rows: int, seconds: float) -> None:
        self.pass_s.setdefault(rows, deque(maxlen=KEEP)).append(seconds)
        self._points = None

    def record_draft(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_s.append(seconds / tokens)

    def record_verdict(self, proposer: str, accepted_per_position: list[bool]) -> None:
        self.positions.setdefault(proposer, PositionCounts()).add(accepted_per_position)

    def alpha(self, proposer: str) -> float:
        counts = self.positions.get(proposer)
        if counts is None or sum(counts.attempts) < MIN_ATTEMPTS:
            return PRIOR_ALPHA
        return counts.alpha() or 0.0

    def predicted_pass_s(self, rows: int) -> float | None:
        """The median time of passes this wide, else linear between the nearest measured
        widths (past the widest: along the last two). None before any measurement."""
        if self._points is None:        # (rows, median seconds) by width, until the next pass is recorded
            self._points = sorted((r, statistics.median(s)) for r, s in self.pass_s.items())
        points = self._points
        if not points:
            return None
        if len(points) == 1:
            return points[0][1]
        below = [p for p in points if p[0] <= rows]
        above = [p for p in points if p[0] >= rows]
        (r0, t0), (r1, t1) = (below[-1], above[0]) if below and above else \
            (points[-2], points[-1]) if below else (points[0], points[1])
        if r0 == r1:
            return t0
        return max(min(t for _, t in points), t0 + (t1 - t0) * (rows - r0) / (r1 - r0))

    # ---- the choice ----------------------------------------------------------------
    def choose_k(self, proposer: str, batch: int, k_max: int, other_rows: int = 0,
                 draft_token_s: float | None = None) -> int:
        """The k for a step with `batch` decoding sequences (and other_rows prefill rows in
        the same pass). k_max until the pass width has any measurement. draft_token_s: this
        proposer's own drafting seconds per token (`proposer: auto` measures each apart);
        None: the recent drafts' median, whichever proposer drafted them."""
        if batch < 1 or k_max < 1:
            return 0
        widest = batch * (k_max + 1) + other_rows
        if not self.pass_s or max(self.pass_s) < widest:
            return k_max                       # measure the widest pass once before predicting it
        alpha = min(self.alpha(proposer), 0.999)
        draft = draft_token_s if draft_token_s is not None else statistics.median(self.draft_s) if self.draft_s else 0.0

        def throughput(k: int) -> float:
            return decode_step_rate(batch, expected_accepted_len(alpha, k),
                                    self.predicted_pass_s(batch * (k + 1) + other_rows), k * draft)
        best = max(range(k_max + 1), key=throughput)
        self.paused = None if best else (f"{proposer}'s drafts lose here: at α {alpha:.2f}, {k_max} a step would run at "
                                         f"{throughput(k_max) / throughput(0):.2f}x a plain step")
        return best

    # ---- trees -----------------------------------------------------------------------
    def record_tree(self, predicted: float, accepted: int, tokens: int, seconds: float, depth: int = 0,
                    draft_s: float | None = None, grown_nodes: int | None = None) -> None:
        """One tree step: its predicted and accepted nodes, tokens emitted, pass + draft seconds,
        the depth of the tree it verified (0: trimmed to no node), the seconds of its drafting
        (None: not known apart; counted as costing) and its nodes as grown (None: unknown)."""
        self.trees.append((predicted, accepted, tokens, seconds))
        if depth and predicted > 0:      # a tree trimmed to nothing says nothing of the confidences
            self.verified.setdefault(size_class(grown_nodes), deque(maxlen=KEEP)).append((predicted, accepted))
        self.tree_depths.append(depth)
        self.tree_draft_s.append(math.inf if draft_s is None else draft_s)

    def tree_depth(self, depth: int) -> int:
        """How deep to grow the next tree: the setting's depth until MIN_TREES were verified,
        then one deeper than the recent trimmed trees reached (at least 1)."""
        if len(self.tree_depths) < MIN_TREES:
            return depth
        return max(1, min(depth, max(self.tree_depths) + 1))

    def tree_calibration(self, grown_nodes: int | None = None) -> float:
        """Accepted nodes over the draft's predicted ones over the recent verified trees grown
        about as large (size_class), else over every class's (1.0 until MIN_TREES were verified)."""
        recent = self.verified.get(size_class(grown_nodes), ())
        if len(recent) < MIN_TREES:
            recent = [t for trees in self.verified.values() for t in trees]
        if len(recent) < MIN_TREES:
            return 1.0
        return sum(t[1] for t in recent) / sum(t[0] for t in recent)

    def grow_tree(self, rows: int) -> bool:
        """Grow a tree this step? Yes until MIN_TREES were measured; then while the recent tree
        steps emit more tokens per second than a plain pass of `rows` rows (this sequence's one
        row and the others'), and once every PROBE_EVERY steps when they do not."""
        plain = self.predicted_pass_s(rows)
        if len(self.trees) < MIN_TREES or plain is None:
            return True
        if statistics.median(self.tree_draft_s) < FREE_DRAFT * plain:
            # growing costs nothing (a suffix tree's index lookups): the trim verifies no node
            # where none pays, so a tree step that loses is a plain step; a gate on the recent
            # trees' speed would only shut off the steps that pay after a few that did not
            self.skipped_trees, self.paused = 0, None
            return True
        tree_rate = sum(t[2] for t in self.trees) / sum(t[3] for t in self.trees)
        if tree_rate > 1.0 / plain:
            self.skipped_trees, self.paused = 0, None
            return True
        self.paused = f"draft trees lose here: {tree_rate:.0f} tok/s against {1.0 / plain:.0f} plain"
        self.skipped_trees += 1
        if self.skipped_trees >= PROBE_EVERY:
            self.skipped_trees = 0
            return True
        return False

    def choose_tree_nodes(self, scores: list[float], max_nodes: int, other_rows: int = 0) -> int:
        """How many of a grown tree's best nodes to verify (see the module doc); all of them
        until a pass that wide was measured."""
        confidences = sorted((math.exp(s) for s in scores), reverse=True)[:max_nodes]
        for n in [p for p in PROBE_NODES if p < len(confidences)] + [len(confidences)]:
            if len(self.pass_s.get(1 + n + other_rows, ())) < 2:
                return n                       # measure this width before predicting any
        calibration = self.tree_calibration(len(scores))
        best, best_rate, expected = 0, 0.0, 1.0
        for n in range(len(confidences) + 1):
            if n:
                expected += calibration * confidences[n - 1]
            rate = expected / self.predicted_pass_s(1 + n + other_rows)
            if rate > best_rate:
                best, best_rate = n, rate
        return best
