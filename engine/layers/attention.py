"""Paged attention: the torch reference path (runs anywhere) and dispatch to the Triton
kernels on CUDA. Metadata is passed explicitly, never through module globals: a GUI
process runs the engine on a worker thread while other threads exist.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention_metadata import (CPU, KERNELS, MODES, TORCH, AttentionMetadata,  # noqa: F401 (re-exported)
                                              DecodeBatch, KernelLaunch, SeqSlice, TreeRows)
from engine.cache.kv_cache import LayerCache, dequantize_fp8, quantize_fp8
from engine.kernels import cpu_fp8
from engine.layers.rotation import hadamard


def encode_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """k, v [N, H_kv, D] as the cache stores them: (k, v, k_scale, v_scale), scales None
    unless the cache is FP8 (then the values are quantized)."""
    if cache.k_scale is None:
        return k.to(cache.k.dtype), v.to(cache.v.dtype), None, None
    kq, ks = quantize_fp8(k)
    vq, vs = quantize_fp8(v)
    return kq, vq, ks, vs


def write_kv(cache: LayerCache, encoded: tuple, slot_mapping: torch.Tensor) -> None:
    """Write encode_kv's output into the given slots of one layer's pool."""
    k, v, ks, vs = encoded
    if ks is None:
        cache.k.flatten(0, 1).index_copy_(0, slot_mapping, k)
        cache.v.flatten(0, 1).index_copy_(0, slot_mapping, v)
        return
    # index_copy_ has no FP8 kernel on CPU; copy the raw bytes instead.
    cache.k.flatten(0, 1).view(torch.uint8).index_copy_(0, slot_mapping, k.view(torch.uint8))
    cache.v.flatten(0, 1).view(torch.uint8).index_copy_(0, slot_mapping, v.view(torch.uint8))
    cache.k_scale.flatten(0, 1).index_copy_(0, slot_mapping, ks)
    cache.v_scale.flatten(0, 1).index_copy_(0, slot_mapping, vs)


def store_kv(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [N, num_kv_heads, head_dim] into their slots, quantizing if the cache is FP8."""
    write_kv(cache, encode_kv(cache, k, v), slot_mapping)


def gather_kv(cache: LayerCache, block_table: torch.Tensor, context_len: int, dtype: torch.dtype):
    """Read one sequence's keys and values, dequantized: 2 x [context_len, H_kv, D]."""
    def read(values, scales):
        if scales is None:
            return values.index_select(0, block_table).flatten(0, 1)[:context_len].to(dtype)
        return cpu_fp8.gather(values, scales, block_table, dtype).flatten(0, 1)[:context_len]
    return read(cache.k, cache.k_scale), read(cache.v, cache.v_scale)


# Keys per tile of the torch path. A row's result must not depend on how many keys its pass
# read past its own position (another sequence's longer context, a later chunk boundary): the
# context is padded to whole tiles, each tile's weighted values come from one fixed-shape
# matmul, and the tiles are summed in order (a cumulative sum; padded tiles add exact zeros).
KEY_TILE = 64
# Sequences with at most this many new rows (decodes, verify passes, short chunks) attend in
# one batched call, padded to the longest of them; longer chunks attend alone.
SHORT_ROWS = 32


def paged_attention_ref(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
                        window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H_q, D] -> [N, H_q, D]: each sequence's rows attend over its cached keys, a row
    seeing the keys at positions <= its own, and with a sliding window (0: none) only those
    at positions > its own - window. sinks [H_q] (gpt-oss): one more logit per query head in
    every row's softmax, whose column is then dropped (it only adds to the denominator).

    Batch-invariant: a row's result depends only on its query, its position and its
    sequence's keys, never on the other rows of the pass, the padding, or where a prefill
    was chunked (tested in fp32 and bf16). The fixed shapes that make it so: at least two
    query rows per sequence (a 1-row matmul takes another kernel), whole KEY_TILE tiles of
    keys, and tiles summed in order. GQA without copying KV heads: a group's G query heads
    are folded into the query axis, so each KV head is read once for all of them."""
    out = torch.empty_like(q)
    for group in meta.layout:
        if isinstance(group, _TreeGroup):
            out[group.real_rows] = _attend_tree(q, cache, group, scale, window, sinks)
            continue
        result = _attend(q[group.rows], cache, group, scale, window, sinks)  # [B, R, H_q, D]
        out[group.real_rows] = result.flatten(0, 1)[group.real_flat]
    return out


def prepare(mode: str, positions: torch.Tensor, slot_mapping: torch.Tensor, seqs: list[SeqSlice],
            block_size: int, group_size: int) -> AttentionMetadata:
    """A pass's metadata with its mode's layout, built once for every layer: the torch path's
    groups, our CPU kernel's rows, or the Triton kernels' launches (_KernelPass). group_size:
    query heads per KV head."""
    if mode not in MODES:
        raise ValueError(f"unknown attention mode {mode!r}; known: {MODES}")
    if mode == TORCH:
        layout = [_Group(group, positions, block_size, group_size) for group in _groups(seqs)]
        layout += [_TreeGroup(s, positions, block_size, group_size) for s in seqs if s.tree is not None]
    elif mode == CPU:
        from engine.kernels import cpu_attention
        layout = cpu_attention.rows_of(seqs, positions)
    else:
        layout = _KernelPass(positions, slot_mapping, seqs, block_size, group_size)
    return AttentionMetadata(mode=mode, positions=positions, slot_mapping=slot_mapping, seqs=seqs, layout=layout)


def _groups(seqs: list[SeqSlice]) -> list[list["_Keys"]]:
    entries = [_Keys.of(s) for s in seqs if s.tree is None]
    short = [e for e in entries if len(e.rows) <= SHORT_ROWS]
    return ([short] if short else []) + [[e] for e in entries if len(e.rows) > SHORT_ROWS]


class _Keys:
    """Rows of a pass that see the same keys: a sequence's rows, or one row of a draft tree
    with its own chain (`keys`: the cache indices it sees, in order; None: 0..context_len-1)."""

    def __init__(self, rows: list[int], context_len: int, block_table: torch.Tensor, keys: list[int] | None = None):
        self.rows, self.context_len, self.block_table, self.keys = rows, context_len, block_table, keys

    @staticmethod
    def of(s: SeqSlice) -> "_Keys":
        return _Keys(list(range(s.start, s.start + s.count)), s.context_len, s.block_table)


class _TreeGroup:
    """A draft tree's rows. Each row sees the keys a chain of its own path would, in the
    same tiles: the context's whole tiles, the same for every row (read once, attended by
    all rows in one product), then its tail: the rest of the context and its path, laid out
    key by key as that chain would hold them (a _Group of one row per entry, positions
    counted from the first tail key)."""

    def __init__(self, s: SeqSlice, positions: torch.Tensor, block_size: int, group_size: int):
        tree, tile = s.tree, max(KEY_TILE, block_size)
        self.shared = tree.context // tile * tile                    # keys in whole tiles before the tail
        self.real_rows = torch.arange(s.start, s.start + s.count, device=positions.device)
        tail_keys = list(range(self.shared, tree.context))
        entries = [_Keys([s.start + r], tree.context - self.shared + len(path), s.block_table, tail_keys + path)
                   for r, path in enumerate(tree.paths)]
        self.tail = _Group(entries, positions - self.shared, block_size, group_size)
        self.table = s.block_table[:self.shared // block_size]
        self.positions = positions[self.real_rows]
        self._early: dict[int, torch.Tensor] = {}

    def early(self, window: int) -> torch.Tensor:
        """[R, 1, 1, shared]: the shared keys before each row's window (its tail's: tail.mask)."""
        if window not in self._early:
            keys = torch.arange(self.shared, device=self.positions.device)
            self._early[window] = (keys <= self.positions[:, None] - window)[:, None, None, :]
        return self._early[window]


class _Group:
    """Sequences attending in one call, and what every layer's call needs of them."""

    def __init__(self, entries: list[_Keys], positions: torch.Tensor, block_size: int, group_size: int):
        device = positions.device
        width = max(2, max(len(e.rows) for e in entries))         # a short sequence repeats its last row
        self.rows = torch.tensor([[e.rows[min(i, len(e.rows) - 1)] for i in range(width)] for e in entries],
                                 dtype=torch.int64, device=device)                       # [B, R]
        self.real_rows = torch.cat([self.rows[i, :len(e.rows)] for i, e in enumerate(entries)])
        self.real_flat = torch.cat([torch.arange(len(e.rows), device=device) + i * width
                                    for i, e in enumerate(entries)])
        tile = max(KEY_TILE, block_size)
        self.keys = -(-max(e.context_len for e in entries) // tile) * tile
        blocks = self.keys // block_size
        if any(e.keys is not None for e in entries):                # a tree row's chain may lie past its context
            blocks = max(blocks, max(max(e.keys) // block_size + 1 for e in entries if e.keys is not None))
        tables = torch.stack([torch.cat([e.block_table[:blocks],
                                         e.block_table.new_zeros(max(0, blocks - e.block_table.shape[0]))])
                              for e in entries])                    # padding reads block 0, masked
        if all(e.keys is None for e in entries):
            self.table, self.slots = tables[:, :self.keys // block_size].flatten(), None
        else:                                                       # a tree's rows: gather key by key
            index = torch.arange(self.keys, device=device).repeat(len(entries), 1)            # [B, T]
            for i, e in enumerate(entries):
                if e.keys is not None:
                    index[i, :len(e.keys)] = torch.tensor(e.keys, device=device)
                    index[i, len(e.keys):] = 0
            self.table = None
            self.slots = (tables.gather(1, index // block_size) * block_size + index % block_size).flatten()
        contexts = torch.tensor([e.context_len for e in entries], device=device)
        # Slots past a context may hold anything (another sequence's old values, or bytes
        # never written): their keys are masked, and their values must be zeros (0 * NaN).
        self.unwritten = (torch.arange(self.keys, device=device) >= contexts[:, None])[:, :, None, None]
        b = len(entries)
        self.row_positions = positions[self.rows]                                                # [B, R]
        hidden = torch.arange(self.keys, device=device) > self.row_positions[:, None, :, None]   # [B, 1, R, T]
        self.hidden = hidden.expand(b, group_size, width, self.keys).reshape(b, 1, group_size * width, self.keys)
        self._masks = {0: self.hidden}

    def mask(self, window: int) -> torch.Tensor:
        """[B, 1, G*R, T]: the keys each row does not see (later ones; with a window, also those
        at positions <= its own - window), built once per pass for each window its layers use.
        Key t of the group sits at position t (a tree's tail: counted from its first key)."""
        if window not in self._masks:
            b, width = self.rows.shape
            g = self.hidden.shape[2] // width
            early = torch.arange(self.keys, device=self.rows.device) <= (self.row_positions - window)[:, None, :, None]
            early = early.expand(b, g, width, self.keys).reshape(b, 1, g * width, self.keys)
            self._masks[window] = self.hidden | early
        return self._masks[window]


def _gather(cache: LayerCache, group: _Group, dtype: torch.dtype):
    """The group's keys and values, dequantized, padded to whole key tiles: 2 x [B, T, H_kv, D]."""
    b = group.rows.shape[0]

    def rows(pool):                 # by whole blocks, or key by key (a tree's rows)
        return pool if group.slots is None else pool.flatten(0, 1)
    index = group.table if group.slots is None else group.slots

    def read(values, scales):
        x = rows(values).index_select(0, index).to(dtype) if scales is None else \
            cpu_fp8.gather(rows(values), rows(scales), index, dtype)
        return x.view(b, group.keys, *values.shape[2:])
    return read(cache.k, cache.k_scale), read(cache.v, cache.v_scale).masked_fill(group.unwritten, 0)


def _sink_logits(sinks: torch.Tensor | None, num_kv_heads: int, g: int, r: int) -> torch.Tensor | None:
    """sinks [H_q] as the grouped query axis lays them out: [1, H_kv, G*R, 1] fp32."""
    if sinks is None:
        return None
    return sinks.detach().float().view(num_kv_heads, g, 1).expand(num_kv_heads, g, r).reshape(1, num_kv_heads, g * r, 1)


def _softmax_terms(scores: torch.Tensor, sink: torch.Tensor | None) -> tuple:
    """Masked fp32 scores [..., T] -> (exp(scores - m) unnormalised, the sink's exp(sink - m)
    to add to the denominator [...] or None), m the row's max over its scores and its sink.
    The sink's exp is taken at the start of a tile of otherwise -inf logits, as the keys' are
    taken (whole tiles), so its bits do not depend on how many rows the pass has."""
    m = scores.amax(-1, keepdim=True)
    if sink is None:
        return torch.exp(scores - m), None
    m = torch.maximum(m, sink)
    term = torch.exp(F.pad(sink - m, (0, KEY_TILE - 1), value=float("-inf"))).sum(-1)
    return torch.exp(scores - m), term


def _attend_tree(q: torch.Tensor, cache: LayerCache, group: _TreeGroup, scale: float, window: int = 0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A tree's rows of q [N, H_q, D] -> [R, H_q, D]: _attend's arithmetic, each row over the
    shared tiles and its own tail tiles, with every tile's products and sums taken as _attend
    takes them for a chain, so each row's numbers are its chain's."""
    tail = group.tail
    qt = q[tail.rows]                                                        # [R, W, H_q, D]
    r, w, num_q_heads, head_dim = qt.shape
    k_t, v_t = _gather(cache, tail, q.dtype)                                 # [R, Tt, H_kv, D]
    num_kv_heads = k_t.shape[2]
    g = num_q_heads // num_kv_heads
    qg = qt.view(r, w, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(r, num_kv_heads, g * w, head_dim)
    scores = torch.matmul(qg, k_t.permute(0, 2, 3, 1)) * scale              # [R, H_kv, G*W, Tt]
    scores = scores.float().masked_fill(tail.mask(window), float("-inf"))
    shared = group.shared
    if shared:
        k_s, v_s = gather_kv(cache, group.table, shared, q.dtype)            # [S, H_kv, D]
        # every row's queries (the first of its W copies) against the shared keys, in one product
        q_s = qg.view(r, num_kv_heads, g, w, head_dim)[:, :, :, 0].permute(1, 2, 0, 3).reshape(
            num_kv_heads, g * r, head_dim)
        s_s = (torch.matmul(q_s, k_s.permute(1, 2, 0)) * scale).float()      # [H_kv, G*R, S]
        s_s = s_s.view(num_kv_heads, g, r, shared).permute(2, 0, 1, 3)[:, :, :, None].expand(
            r, num_kv_heads, g, w, shared).reshape(r, num_kv_heads, g * w, shared)
        if window:
            s_s = s_s.masked_fill(group.early(window), float("-inf"))
        scores = torch.cat([s_s, scores], -1)
    keys = scores.shape[-1]
    tiles, shared_tiles = keys // KEY_TILE, shared // KEY_TILE
    weights, sink_term = _softmax_terms(scores, _sink_logits(sinks, num_kv_heads, g, w))
    tiled = weights.view(r, num_kv_heads, g * w, tiles, KEY_TILE)
    total = tiled.sum(-1).cumsum(-1)[..., -1]                                # [R, H_kv, G*W]
    if sink_term is not None:
        total = total + sink_term
    v_tiles = v_t.permute(0, 2, 1, 3).reshape(r, num_kv_heads, tiles - shared_tiles, KEY_TILE, head_dim)
    parts = torch.matmul(tiled[:, :, :, shared_tiles:].transpose(2, 3).to(v_t.dtype), v_tiles)  # [R, H_kv, Tt/64, G*W, D]
    if shared:
        vs_tiles = v_s.permute(1, 0, 2).reshape(num_kv_heads, shared_tiles, KEY_TILE, head_dim)
        w_s = tiled[:, :, :, :shared_tiles].permute(1, 3, 0, 2, 4).reshape(
            num_kv_heads, shared_tiles, r * g * w, KEY_TILE).to(v_s.dtype)
        p_s = torch.matmul(w_s, vs_tiles).view(num_kv_heads, shared_tiles, r, g * w, head_dim).permute(2, 0, 1, 3, 4)
        parts = torch.cat([p_s, parts], 2)
    out = (parts.float().cumsum(2)[:, :, -1] / total[..., None]).to(q.dtype)   # [R, H_kv, G*W, D]
    return out.view(r, num_kv_heads, g, w, head_dim)[:, :, :, 0].reshape(r, num_q_heads, head_dim)


def _attend(q: torch.Tensor, cache: LayerCache, group: _Group, scale: float, window: int = 0,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, R, H_q, D] -> [B, R, H_q, D] (see paged_attention_ref)."""
    b, r, num_q_heads, head_dim = q.shape
    k, v = _gather(cache, group, q.dtype)                                    # [B, T, H_kv, D]
    num_kv_heads, keys = k.shape[2], k.shape[1]
    g, tiles = num_q_heads // num_kv_heads, keys // KEY_TILE
    qg = q.view(b, r, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, g * r, head_dim)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale                 # [B, H_kv, G*R, T]
    scores = scores.float().masked_fill(group.mask(window), float("-inf"))
    weights, sink_term = _softmax_terms(scores, _sink_logits(sinks, num_kv_heads, g, r))   # fp32, unnormalised
    tiled = weights.view(b, num_kv_heads, g * r, tiles, KEY_TILE)
    total = tiled.sum(-1).cumsum(-1)[..., -1]                                # [B, H_kv, G*R]
    if sink_term is not None:
        total = total + sink_term
    v_tiles = v.permute(0, 2, 1, 3).reshape(b, num_kv_heads, tiles, KEY_TILE, head_dim)
    parts = torch.matmul(tiled.transpose(2, 3).to(v.dtype), v_tiles)        # [B, H_kv, tiles, G*R, D]
    out = (parts.float().cumsum(2)[:, :, -1] / total[..., None]).to(q.dtype)   # [B, H_kv, G*R, D]
    return out.view(b, num_kv_heads, g, r, head_dim).permute(0, 3, 1, 2, 4).reshape(b, r, num_q_heads, head_dim)


def attention(q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float, window: int = 0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Store the new k, v then attend over the sequence's cached keys, reading them back
    from the cache (so an FP8 cache affects every token's attention, prefill included).
    window: the layer's sliding window (a row sees the keys at positions p - window < j <= p;
    0: all up to p; the cache keeps every block, the window is a mask). sinks [H_q] or None:
    the layer's attention sinks (see paged_attention_ref). Every mode computes the same.
    A rotated cache gets H·q, H·k, H·v and gives H·out back (engine.layers.rotation)."""
    if window < 0:
        raise ValueError(f"a sliding window must be >= 0 (0: full attention), got {window}")
    if cache.rotated:
        q, k, v = (hadamard(x).to(x.dtype) for x in (q, k, v))
        out = _attention(q, k, v, cache, meta, scale, window, sinks)
        return hadamard(out).to(out.dtype)
    return _attention(q, k, v, cache, meta, scale, window, sinks)


def _attention(q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float, window: int,
               sinks: torch.Tensor | None) -> torch.Tensor:
    if meta.mode == KERNELS:
        return _kernel_attention(q, k, v, cache, meta, scale, window, sinks)
    if meta.mode == CPU:
        from engine.kernels import cpu_attention
        if cache.k_scale is None:           # a float pool: stored by our kernel library, one call
            cpu_attention.store(cache, k, v, meta.slot_mapping)
        else:
            store_kv(cache, k, v, meta.slot_mapping)
        return cpu_attention.attend(q, cache, meta.layout, scale, window, sinks)
    store_kv(cache, k, v, meta.slot_mapping)
    return paged_attention_ref(q, cache, meta, scale, window, sinks)


class _KernelPass:
    """A kernels pass's launches, built once for every layer. The sequences that each feed the
    same few new rows (decodes, verify passes of one k; no tree) attend together: one
    DecodeBatch per row count, so a decode pass of any number of sequences is one launch per
    layer. Every other sequence (a prefill chunk, a draft tree) is launched alone: `alone`
    holds (its SeqSlice, _launch's tuple)."""

    def __init__(self, positions: torch.Tensor, slot_mapping: torch.Tensor, seqs: list[SeqSlice], block_size: int,
                 group_size: int):
        from engine.kernels.dispatch import MAX_DECODE_TOKENS
        by_count: dict[int, list[SeqSlice]] = {}
        self.alone = []
        for s in seqs:
            if s.tree is None and s.count <= MAX_DECODE_TOKENS:
                by_count.setdefault(s.count, []).append(s)
            else:
                self.alone.append((s, _launch(positions, slot_mapping, s, block_size, group_size)))
        self.batches = [_decode_batch(positions, same) for same in by_count.values()]

    @property
    def whole(self) -> DecodeBatch | None:
        """The one batch that is every row of the pass in order (a plain decode or verify pass)."""
        if len(self.batches) == 1 and not self.alone and self.batches[0].rows is None:
            return self.batches[0]
        return None


def _decode_batch(positions: torch.Tensor, seqs: list[SeqSlice]) -> DecodeBatch:
    width, device = seqs[0].count, positions.device
    in_order = [s.start for s in seqs] == list(range(0, width * len(seqs), width))
    rows = None
    if not (in_order and width * len(seqs) == positions.shape[0]):
        rows = torch.tensor([s.start + i for s in seqs for i in range(width)], dtype=torch.int64, device=device)
    tables = torch.nn.utils.rnn.pad_sequence([s.block_table for s in seqs], batch_first=True)  # [B, max_blocks]
    return DecodeBatch(rows=rows, positions=(positions if rows is None else positions[rows]).view(len(seqs), width),
                       block_tables=tables, max_context_len=max(s.context_len for s in seqs))


def _kernel_attention(q, k, v, cache: LayerCache, meta: AttentionMetadata, scale: float, window: int,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    """A kernels pass (its layout: _KernelPass): every new row's K/V stored in one launch, then
    each DecodeBatch attended in one launch and every other sequence alone."""
    from engine.kernels import dispatch
    launches = meta.layout
    dispatch.store(cache, k, v, meta.slot_mapping)
    whole = launches.whole
    if whole is not None:                   # a plain decode or verify pass: no gather, no scatter
        return _decode(q, cache, whole, scale, window, sinks)
    out = torch.empty_like(q)
    for batch in launches.batches:
        out[batch.rows] = _decode(q[batch.rows], cache, batch, scale, window, sinks)
    for s, launch in launches.alone:
        rows = slice(s.start, s.start + s.count)
        out[rows] = _attend_alone(q[rows], cache, launch, scale, window, sinks)
    return out


def _decode(q: torch.Tensor, cache: LayerCache, batch: DecodeBatch, scale: float, window: int,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B*Q, H_q, D], a DecodeBatch's rows -> [B*Q, H_q, D]."""
    from engine.kernels import dispatch
    b, width = batch.positions.shape
    return dispatch.decode_attention(q.view(b, width, *q.shape[1:]), cache, batch, scale, window, sinks).flatten(0, 1)


def _attend_alone(q, cache: LayerCache, launch: tuple, scale: float, window: int,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """One sequence's rows where the Triton kernels run, its K/V stored (launch: _launch's). A
    draft tree's rows are masked by their cache index (the causal part) and a bit per tree key
    on their path, the keys past the context (TREE_KEYS of them at most; a wider tree takes the
    torch path); under a window, by the first cache index each one sees as well
    (_TreeMask.window_start)."""
    from engine.kernels import dispatch
    one, mask = launch
    if isinstance(one, AttentionMetadata):                       # a tree too wide for one mask word
        return paged_attention_ref(q, cache, one, scale, window, sinks)
    if mask is None:
        return dispatch.sequence_attention(q, cache, one, scale, window=window, sinks=sinks)
    return dispatch.sequence_attention(q, cache, one, scale, tree=(mask.bits, mask.start), window=window, sinks=sinks,
                                       window_start=mask.window_start(window) if window else None)


def _launch(positions: torch.Tensor, slot_mapping: torch.Tensor, s: SeqSlice, block_size: int,
            group_size: int) -> tuple:
    """(KernelLaunch, _TreeMask or None) for one sequence of a kernels pass, or (torch-path
    metadata, None) for a tree wider than one mask word."""
    rows = slice(s.start, s.start + s.count)
    tree = s.tree
    if tree is None:
        return KernelLaunch(positions=positions[rows], slot_mapping=slot_mapping[rows], block_table=s.block_table,
                            context_len=s.context_len), None
    if max(tree.indices) - tree.context >= TREE_KEYS:
        alone = SeqSlice(0, s.count, s.block_table, s.context_len, tree)
        return prepare(TORCH, positions[rows], slot_mapping[rows], [alone], block_size, group_size), None
    index = torch.tensor(tree.indices, dtype=torch.int64, device=positions.device)
    return KernelLaunch(positions=index, slot_mapping=slot_mapping[rows], block_table=s.block_table,
                        context_len=s.context_len), _TreeMask(tree, positions.device)


TREE_KEYS = 64          # tree keys one int64 mask word covers (the kernels' tree mask)


class _TreeMask:
    """A draft tree's mask in the Triton kernels: `bits` [R] int64 (the key at cache index
    start + i is seen where bit i of the row's bits is set) and `start` [1] int32, and for
    each window its layers use, the first cache index each row sees (window_start)."""

    def __init__(self, tree: TreeRows, device):
        self.tree, self.device = tree, device
        self.bits = torch.tensor([_signed64(sum(1 << (i - tree.context) for i in path)) for path in tree.paths],
                                 dtype=torch.int64, device=device)
        self.start = torch.tensor([tree.context], dtype=torch.int32, device=device)
        self._window_starts: dict[int, torch.Tensor] = {}

    def window_start(self, window: int) -> torch.Tensor:
        """[R] int64. A row sits at position context + len(path) - 1, a context key i at i, a key
        of its path at context + its depth; paths run root first in increasing cache index, so
        the window's keys are the cache indices from this one on (among those the bits allow)."""
        if window not in self._window_starts:
            firsts = [_first_in_window(self.tree.context, path, window) for path in self.tree.paths]
            self._window_starts[window] = torch.tensor(firsts, dtype=torch.int64, device=self.device)
        return self._window_starts[window]


def _first_in_window(context: int, path: list[int], window: int) -> int:
    assert all(a < b for a, b in zip(path, path[1:])), "a tree row's path must run root first, by cache index"
    dropped = len(path) - window                 # its path's keys before the window (if > 0)
    return path[dropped] if dropped > 0 else context + dropped


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
