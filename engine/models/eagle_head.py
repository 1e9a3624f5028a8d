"""The EAGLE draft head: one decoder layer that reads the target's own final hidden state.

At position j it takes the target's final (normed) hidden state f_j and the embedding of the
next token x_{j+1}, and predicts f_{j+1}, the target's hidden state one position on:

    g_j = norm(layer(fc([embed(x_{j+1}) ; f_j])))     (the layer attends over its own KV cache)
    logits_j = g_j @ W_head[R]^T                      (the target's head rows for R tokens)

To draft k tokens it runs on its own predictions: g_j stands in for f_{j+1} at the next step.
The head R is a frequency-ranked reduced vocabulary (FR-Spec): the R tokens the target emits
most often; tokens outside R get probability 0 (logits -inf), which the rejection sampler
handles exactly. The embedding and the head rows are the target's, attached at load time;
the folder stores only fc, the layer, the norm and the token ids (a few MB).

Made by `python -m engine.training.distill` (training is there, never imported by inference); the
proposer that runs it is engine.speculative.eagle_proposer.

The folder: config.json (the target's config with one layer, plus EAGLE_CONFIG_KEY),
model.safetensors (fp16 fc, layer and norm weights under transformers' Llama names, and
head_token_ids).
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch

from engine.cache.kv_cache import CacheShape, KVCache
from engine.layers import packed_linear, quantized_linear
from engine.models.llama import LlamaFamilyModel, Linear, logits_rows

EAGLE_CONFIG_KEY = "workbench_eagle"      # marks an EAGLE head folder in config.json


class EagleHead(LlamaFamilyModel):
    """A one-layer Llama-family stack with an input projection fc and a reduced head."""

    def __init__(self, config, head_size: int, max_positions: int | None = None):
        super().__init__(config, max_positions)
        del self.lm_head                                   # the target's rows, in head_weight
        h = config.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.register_buffer("head_token_ids", torch.zeros(head_size, dtype=torch.int64))
        self.register_buffer("head_weight", torch.zeros(head_size, h), persistent=False)
        self.head_packed: torch.Tensor | None = None      # head_weight in oneDNN's layout, see pack_for_cpu
        self.head_pack_index = -1                          # its place in packed_weights
        self.head_quant: quantized_linear.QuantizedWeight | None = None      # see serve_int8
        # the head's R tokens: ids as a list, each one's row, and their embedding rows (attach_target)
        self.head_ids: list[int] = []
        self.head_row: dict[int, int] = {}
        self.head_embed: torch.Tensor | None = None

    def tie_weights(self) -> None:
        pass

    def attach_target(self, target_model: LlamaFamilyModel) -> None:
        """Share the target's embedding; copy its head rows for the reduced vocabulary, and its
        embedding rows of those tokens (every drafted token is one: see embed)."""
        self.embed_tokens = target_model.embed_tokens
        self.head_weight = target_model.lm_head.dense_weight().detach()[self.head_token_ids].to(self.fc.weight.dtype)
        self.head_ids = self.head_token_ids.tolist()
        self.head_row = {token: row for row, token in enumerate(self.head_ids)}
        with torch.no_grad():
            self.head_embed = self.embed_tokens(self.head_token_ids)

    def embed(self, ids: list[int]) -> torch.Tensor:
        """The target's embedding of ids [N, hidden]: from the head's copy of its R tokens' rows
        where every id is one (a drafted token always is), else from the target's table (a
        quantized one is decoded on the host: 0.2 ms a call, a tenth of a compiled draft step)."""
        rows = [self.head_row.get(token) for token in ids]
        if None in rows:
            return self.embed_tokens(torch.tensor(ids, dtype=torch.int64, device=self.head_token_ids.device))
        if len(rows) == 1:
            return self.head_embed[rows[0]:rows[0] + 1]
        return self.head_embed[torch.tensor(rows, device=self.head_embed.device)]

    def draft_pass(self, embedded: torch.Tensor, features: torch.Tensor, rope_positions: torch.Tensor,
                   rows: torch.Tensor | None, kv: KVCache | None, meta):
        """embedded [N, hidden] (x_{j+1}'s row, see embed), features [N, hidden] (f_j) -> (float32
        logits over the head's R tokens of `rows` [rows, R] (None: every row), predicted
        features g [N, hidden]).
        rope_positions are the target's positions j; the cache slots in meta may be offset from
        them. kv None: inside the compiled step's graph, meta the pass as its attention op takes it
        (engine.layers.attention_op.GraphPass; engine.runtime.eagle_step runs it either way)."""
        x = self.fc(torch.cat([embedded, features.to(self.fc.weight.dtype)], dim=-1))
        rope = self.rotary.at(rope_positions, x.dtype)
        g = self.norm(self.layers[0](x, None if kv is None else kv.layer(0), meta, rope))
        return self.reduced_logits(g if rows is None else logits_rows(g, rows)), g

    def reduced_logits(self, g: torch.Tensor) -> torch.Tensor:
        """g [N, hidden] -> float32 logits over the head's R tokens [N, R]."""
        if self.head_quant is not None:
            return quantized_linear.linear(g, self.head_quant, None).float()
        if self.head_packed is None:
            return (g @ self.head_weight.t()).float()
        if torch.compiler.is_compiling():       # the graph names the packed weight by its index
            return packed_linear.packed_linear(g, self.head_pack_index, self.head_weight.shape[0], None).float()
        return packed_linear.linear(g, self.head_packed, None).float()

    def serve_int8(self) -> None:
        """Serve fc, the layer's linears and the reduced head in int8 per output channel (round to
        nearest, engine.layers.quantized_linear), before pack_for_cpu: the head's weights are
        most of a draft step's cost, and in bf16 they are a fifth of the bytes a quantized
        target's step reads (measured on the default model, 2-core AVX-512 CPU, in one run:
        a k=4 chain cost 0.17 target steps a token in bf16, 0.12 in int8, acceptance the same)."""
        dtype = self.fc.weight.dtype
        for m in self.modules():
            if isinstance(m, Linear) and m.quant is None:
                m.quantize(quantized_linear.quantize_int8(m.dense_weight(), dtype), keep_plain=False)
        self.head_quant = quantized_linear.quantize_int8(self.head_weight, dtype)

    def pack_for_cpu(self) -> None:
        """The layer, fc and the reduced head in oneDNN's layout (engine.layers.packed_linear): a
        draft token's eager step in bf16 re-laid every weight out on each call otherwise. The
        head's packed weight joins the model's packed weights, where a graph finds it."""
        super().pack_for_cpu()
        if self.head_packed is None and self.packed_weights and packed_linear.packable(self.head_weight):
            self.head_packed = packed_linear.pack(self.head_weight)
            self.head_pack_index = len(self.packed_weights)
            self.packed_weights.append(self.head_packed)
            packed_linear.check_rows([self.head_packed])

    def full_logits(self, reduced: torch.Tensor) -> torch.Tensor:
        """[N, R] -> [N, vocab]: tokens outside the head get -inf (probability 0)."""
        full = reduced.new_full((reduced.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.head_token_ids] = reduced
        return full

    def new_cache(self, num_tokens: int, block_size: int, device) -> KVCache:
        """The head's own cache for one request: one layer, contiguous blocks."""
        blocks = -(-num_tokens // block_size)
        shape = CacheShape(1, self.layers[0].self_attn.num_kv_heads, self.head_dim)
        return KVCache(shape, blocks, block_size, self.fc.weight.dtype, device)


def weights_fingerprint(model: LlamaFamilyModel) -> str:
    """A short hash of a sample of the target's weights (every 997th embedding row and the last
    layer's down projection's first row), so a head is never attached to another model of the
    same shape. The rows are rounded to bf16 first, so the same weights loaded in fp32 or bf16,
    from any path, give the same fingerprint; a quantized model keeps the one of its float
    weights (the loader takes it before quantizing)."""
    stored = getattr(model, "source_fingerprint", None)     # taken before a quantized load
    if stored is not None:
        return stored
    return fingerprint_of(model.embed_tokens.weight[::997], model.fingerprint_down()[0].dense_weight()[:1])


def fingerprint_of(embedding_rows: torch.Tensor, down_row: torch.Tensor) -> str:
    """The hash weights_fingerprint takes of its sample: every 997th embedding row and the last
    layer's down projection's first row (the loader gives them as stored where the model holds
    them in another form)."""
    rows = [embedding_rows, down_row]
    h = hashlib.sha256()
    for r in rows:
        h.update(r.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:32]


def eagle_config(target_config, info: dict):
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:1]
    setattr(config, EAGLE_CONFIG_KEY, info)
    return config


def is_eagle_folder(path: Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and EAGLE_CONFIG_KEY in json.loads(config.read_text())


def save_eagle(head: EagleHead, folder: Path, report: dict | None = None) -> None:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    tensors = head.hf_layer_tensors()
    tensors.update({"fc.weight": head.fc.weight, "model.norm.weight": head.norm.weight})
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}
    tensors["head_token_ids"] = head.head_token_ids.to(torch.int32)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    head.config.save_pretrained(folder)
    if report is not None:
        (folder / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
