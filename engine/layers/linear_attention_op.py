"""A linear-attention layer's sequence mixing (the causal convolution and the gated delta rule,
engine.layers.gated_delta) over one pass, reading and writing each sequence's state slot
(engine.cache.state_cache).

Like attention (engine.layers.attention_op), this is where rows meet their sequence's past, so
inside the compiled step it is one opaque op, `workbench::gated_delta(mixed_qkv, g, beta,
conv_weight, layer, num_k_heads, head_k_dim, head_v_dim)`, the graph is split at; the
projections before it and the gated norm and output projection after it are row-wise and stay
in the graph. The eager pass calls the same function. Both read the pass (its state cache and
each sequence's rows and slot) from `serving`, per thread.

Each sequence is computed alone, so a row never depends on what shares its pass. A prefill
chunk takes the chunked form (one token: the recurrent one); a pass whose every row wants
logits (a decode, a verify pass of a chain or a tree of draft tokens) goes row by row from each
row's parent (the row before it, or its parent in the tree) and keeps the state after every
row, for the rollback to the last accepted token. A prefill chunk's chunks of the chunked form lie on
multiples of CHUNK of its sequence wherever the scheduler cut it; the state after each comes
free, and the prefix cache keeps those on block boundaries (engine.cache.state_snapshots) and
the chunk's last block boundary (the chunk is cut there too).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from engine.cache.state_cache import StateCache
from engine.cache.state_snapshots import StateSnapshots
from engine.layers import gated_delta


@dataclass
class LinearSeq:
    """One sequence's rows start..start+count-1 of the pass, its state slot, and how it goes:
    `parents` (a decode or a verify pass: each row's parent row in the pass, -1 for the state
    before it; the states after each row are kept) or None (a prefill chunk)."""
    start: int
    count: int
    slot: int
    computed: int                       # its tokens before the pass
    parents: list[int] | None = None
    snapshots: list[tuple[int, int]] = field(default_factory=list)    # (boundary, snapshot) to save


@dataclass
class LinearPass:
    states: StateCache
    seqs: list[LinearSeq]
    rows: int                           # the pass's rows (the compiled graph may run more)
    snapshots: StateSnapshots | None = None


_pass = threading.local()


@contextlib.contextmanager
def serving(linear_pass: LinearPass | None):
    """The state cache and sequences the linear layers inside the block read (one pass)."""
    before = getattr(_pass, "current", None)
    _pass.current = linear_pass
    try:
        yield
    finally:
        _pass.current = before


def mix(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor, layer: int,
        num_k_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """mixed [N, 2*Hk*Dk + Hv*Dv] (q, k, v before the convolution), g and beta [N, Hv] (float32)
    -> the delta rule's output [N, Hv*Dv] in mixed's dtype; each sequence's state moves past its rows."""
    current: LinearPass | None = getattr(_pass, "current", None)
    if current is None:
        raise RuntimeError("workbench::gated_delta ran outside linear_attention_op.serving (no pass to mix in)")
    shape = Shape(num_k_heads, head_k_dim, beta.shape[1], head_v_dim)
    out = torch.empty(mixed.shape[0], shape.value_dim, dtype=mixed.dtype, device=mixed.device)
    weight = conv_weight.squeeze(1)
    for s in current.seqs:
        rows = slice(s.start, s.start + s.count)
        if s.parents is None:
            out[rows] = _run_chunk(current, layer, s, mixed[rows], g[rows], beta[rows], weight, shape)
        else:
            out[rows] = _run_rows(current.states, layer, s, mixed[rows], g[rows], beta[rows], weight, shape)
    n = current.rows
    if n < out.shape[0]:
        out[n:] = out[n - 1]            # padding rows repeat the last (the compiled step's minimum)
    return out


@dataclass(frozen=True)
class Shape:
    num_k_heads: int
    head_k_dim: int
    num_v_heads: int
    head_v_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, conv_dim] -> q, k [T, Hk, Dk], v [T, Hv, Dv]."""
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        t = x.shape[0]
        return (q.reshape(t, self.num_k_heads, self.head_k_dim), k.reshape(t, self.num_k_heads, self.head_k_dim),
                v.reshape(t, self.num_v_heads, self.head_v_dim))


def _run_chunk(current: LinearPass, layer: int, s: LinearSeq, x, g, beta, weight, shape: Shape) -> torch.Tensor:
    """A prefill chunk of one sequence: the convolution over all of it, then the delta rule in
    pieces (`pieces`) whose chunks of the chunked form lie on multiples of CHUNK of the sequence;
    the state at each staged boundary (a piece's end, or one of its chunks') is saved."""
    states = current.states
    conv_state, state = states.conv[layer, s.slot], states.recurrent[layer, s.slot]
    width = weight.shape[1] - 1
    wanted = dict(s.snapshots)                  # boundary -> snapshot
    # the convolution's inputs at each saved boundary (only when one is saved: no copy otherwise)
    inputs = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=1) if wanted else None
    x, new_conv = gated_delta.causal_conv(x, conv_state, weight)
    q, k, v = gated_delta.prepare(*shape.split(x), shape.num_v_heads)                   # [Hv, T, D]
    g, beta = g.t().float(), beta.t().float()
    out = []
    cuts = [b for b in wanted if b % gated_delta.CHUNK]      # the others are chunk ends of the form
    for begin, end in pieces(s.computed, s.computed + s.count, cuts):
        rows, after = slice(begin - s.computed, end - s.computed), []
        if end - begin > 1:
            o, state = gated_delta.chunked(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows], state,
                                           states_after=after)
        else:
            o, state = gated_delta.recurrent(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows], state)
        out.append(o)
        ends = [min(begin + gated_delta.CHUNK * (i + 1), end) for i in range(len(after))] or [end]
        for boundary, kept in zip(ends, after or [state]):
            if boundary in wanted:
                r = boundary - s.computed
                current.snapshots.save_layer(wanted[boundary], layer, inputs[:, r:r + width], kept)
    conv_state.copy_(new_conv.to(conv_state.dtype))
    states.recurrent[layer, s.slot].copy_(state)
    return torch.cat(out, dim=1).transpose(0, 1).reshape(s.count, shape.value_dim).to(x.dtype)


def pieces(start: int, end: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[start, end) cut at `cuts`, and so that past the first multiple of CHUNK every piece begins
    on one or at a cut (then its first chunk ends on the next multiple): the chunked form's chunks
    lie where they would in one pass from the sequence's first token, and the state at each
    multiple of CHUNK comes with them."""
    points = {c for c in cuts if start < c < end}
    for c in [start, *points]:
        aligned = (c // gated_delta.CHUNK + 1) * gated_delta.CHUNK
        if c % gated_delta.CHUNK and aligned < end:
            points.add(aligned)
    bounds = [start, *sorted(points), end]
    return list(zip(bounds, bounds[1:]))


def _run_rows(states: StateCache, layer: int, s: LinearSeq, x, g, beta, weight, shape: Shape) -> torch.Tensor:
    """A decode or a verify pass: row by row, each from its parent's state; every row's state is kept."""
    kept = states.keep(layer, s.slot, s.computed)
    width = weight.shape[1] - 1
    out = []
    for r, parent in enumerate(s.parents):
        window = torch.cat([kept.conv[parent + 1].to(weight.dtype), x[r:r + 1].t().to(weight.dtype)], dim=1)
        conv_out = torch.nn.functional.silu((window * weight).sum(dim=1)).to(x.dtype)     # [C]
        q, k, v = gated_delta.prepare(*shape.split(conv_out[None]), shape.num_v_heads)
        o, state = gated_delta.recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[r].float(), beta[r].float(),
                                              kept.recurrent[parent + 1])
        kept.conv.append(window[:, window.shape[1] - width:].to(states.conv_dtype))
        kept.recurrent.append(state)
        out.append(o.reshape(shape.value_dim))
    states.conv[layer, s.slot].copy_(kept.conv[-1])
    states.recurrent[layer, s.slot].copy_(kept.recurrent[-1])
    return torch.stack(out).to(x.dtype)


def _mix_shape(mixed, g, beta, conv_weight, layer, num_k_heads, head_k_dim, head_v_dim):
    return mixed.new_empty(mixed.shape[0], beta.shape[1] * head_v_dim)


_LIBRARY = torch.library.Library("workbench", "FRAGMENT")
_LIBRARY.define("gated_delta(Tensor mixed, Tensor g, Tensor beta, Tensor conv_weight, int layer, int num_k_heads, "
                "int head_k_dim, int head_v_dim) -> Tensor", tags=(torch.Tag.cudagraph_unsafe,))
for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("gated_delta", mix, _key)
torch.library.register_fake("workbench::gated_delta", _mix_shape, lib=_LIBRARY)
gated_delta_op = torch.ops.workbench.gated_delta.default
