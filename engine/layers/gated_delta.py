"""The gated delta rule (Gated DeltaNet, arXiv 2412.06464) of Qwen3.5's and Qwen3-Next's
linear-attention layers, for one sequence at a time, and their short causal convolution.

Each value head keeps a state S [Dk, Dv]. For every token, with k and q L2-normalised and
q scaled by 1/sqrt(Dk):
    S <- exp(g) * S                                  (the gate: g <= 0, a decay)
    S <- S + k^T (beta * (v - k S))                   (the delta rule: write what S mispredicts)
    o  = q S
`recurrent` is that loop (decodes, and verify passes, whose state after each row is kept for a
rollback); `chunked` computes the same in chunks of CHUNK tokens (prefill): within a chunk the
sequential updates are condensed by the UT transform (one triangular solve), and only the chunk
boundaries are sequential. Both read the state as it was before the pass and return it as it is
after. Everything runs in float32 whatever the activation dtype, as transformers' torch path does.

The convolution mixes each channel with its own last K inputs (K = linear_conv_kernel_dim,
4): its state is the last K - 1 inputs of the sequence, zeros before the first.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64          # tokens per chunk of the chunked form (transformers' and FLA's)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim, as FLA's kernels (and transformers) compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] (the pass's new inputs), state [C, K-1] (the sequence's last inputs before them),
    weight [C, K] -> (silu(depthwise causal conv) [T, C] in x's dtype, the new state [C, K-1])."""
    width = weight.shape[1] - 1
    window = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)      # [C, K-1+T]
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).t().to(x.dtype), window[:, window.shape[1] - width:].to(state.dtype)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_v_heads: int) -> tuple:
    """q, k [T, Hk, Dk], v [T, Hv, Dv] -> float32 [Hv, T, D] each: q and k normalised (q also
    by 1/sqrt(Dk)), each key head repeated for its Hv / Hk value heads."""
    repeat = num_v_heads // k.shape[1]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q, k [H, Dk], v [H, Dv], g, beta [H] (float32), state [H, Dk, Dv] -> (o [H, Dv],
    the state after it)."""
    state = state * g.exp()[:, None, None]
    predicted = (state * k[:, :, None]).sum(dim=1)                     # k S: [H, Dv]
    state = state + k[:, :, None] * ((v - predicted) * beta[:, None])[:, None, :]
    return (state * q[:, :, None]).sum(dim=1), state


def recurrent(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [H, T, Dk], v [H, T, Dv], g, beta [H, T], state [H, Dk, Dv] -> (o [H, T, Dv], the
    state after the last token)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        out[:, t], state = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return out, state


def chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK,
            states_after: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What `recurrent` computes, a chunk of tokens at a time (same arguments and result).
    states_after: a list to append the state after each chunk to (the last one: after the last
    token), which come free (the prefix cache keeps some: engine.layers.linear_attention_op)."""
    heads, length, dk = k.shape
    pad = -length % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)).view(heads, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).view(heads, -1, chunk) for x in (g, beta))
    decay = g.cumsum(dim=-1)                                         # log decay since the chunk's start
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(above, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + strictly-lower(k_beta k^T * decay))^-1, applied to v_beta and to the decayed k_beta
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * pairwise                   # causal, the diagonal included
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(values.shape[1]):
        corrected = values[:, i] - k_decayed[:, i] @ state               # what the old state does not predict
        out[:, i] = q[:, i] @ state + within[:, i] @ corrected
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ corrected
        if states_after is not None:
            states_after.append(state)
    return out.reshape(heads, -1, out.shape[-1])[:, :length], state
