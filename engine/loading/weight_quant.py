"""The `weight_dtype` setting at load: which linears are served quantized, and from what.

  auto   as stored: a GGUF's 4-bit tensors (Q4_0, Q4_1) stay 4-bit, in the int4 kernel's
         format, exactly (engine.loading.gguf_tensors); every other tensor, and every tensor
         of a float checkpoint, is served in the compute dtype (the `dtype` setting).
  float  every weight dequantized to the compute dtype (what the loader did before).
  int8   every linear quantized at load, round-to-nearest per channel.
  int4   every linear in int4: a GGUF's 4-bit tensors as stored, the others quantized at
         load, round-to-nearest per group of 32 (gpt-fast's recipe).
The tied head quantizes beside the embedding, which stays in float for its lookups.
Q8_0 and the k-quants have no kernel here that keeps them exact (torch's int8 kernel scales
per channel, Q8_0 per 32 weights), so under `auto` they are dequantized, and the report says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.layers import quantized_linear
from engine.layers.quantized_linear import INT4, INT8
from engine.loading.gguf_tensors import INT4_TYPES, GGUFTensors

AUTO, FLOAT = "auto", "float"
FLOAT_SOURCE = "float"          # a tensor of a float checkpoint


@dataclass
class WeightReport:
    """What `weight_dtype` did, for "In effect" and the bench."""
    requested: str
    served: dict[str, str] = field(default_factory=dict)     # source type -> how it is served
    quantized: int = 0          # linears served quantized
    linears: int = 0

    @property
    def identity_tag(self) -> str:
        """Part of the model's identity (and so of the prefix cache's keys): other weights,
        other keys."""
        return "" if not self.quantized else "|weights:" + ",".join(f"{k}={v}" for k, v in sorted(self.served.items()))

    def summary(self) -> str:
        if not self.quantized:
            return next(iter(self.served.values()), FLOAT)
        return "; ".join(f"{source}: {how}" for source, how in self.served.items())

    def as_dict(self) -> dict:
        return {"requested": self.requested, "served": dict(self.served), "quantized_linears": self.quantized,
                "linears": self.linears}


def serve_weights(model, weight_dtype: str, device: torch.device, gguf: GGUFTensors | None) -> WeightReport:
    """Quantize the model's linears as `weight_dtype` asks (see the module docstring). The
    float weights must be loaded; a quantized linear's float parameter is then freed."""
    from engine.models.llama import Linear
    dtype = next(model.parameters()).dtype
    report = WeightReport(weight_dtype)
    float_name = str(dtype).removeprefix("torch.")
    sources = {s.param: s for s in model.weight_sources()}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    chosen = []
    for name, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        report.linears += 1
        parts = [part for part, _ in _source(sources, name, m, model).parts]
        types = [gguf.type_of(p) or FLOAT_SOURCE for p in parts] if gguf is not None else [FLOAT_SOURCE]
        source_type = types[0] if len(set(types)) == 1 else "+".join(sorted(set(types)))
        kind, how = _choice(weight_dtype, types)
        why_not = kind and quantized_linear.unsupported(kind, tuple(m.weight.shape), device)
        if kind is None or why_not:
            report.served.setdefault(source_type, f"{float_name}" + (f" (dequantized: {why_not})" if why_not else
                                                                     "" if source_type == FLOAT_SOURCE else " (dequantized)"))
            continue
        if how == "stored":
            q, scale, zero = (torch.cat(t) for t in zip(*(gguf.int4_groups(p) for p in parts)))
            qw = quantized_linear.from_int4_groups(q, scale, zero, dtype)
            report.served[source_type] = f"int4 as stored (group {qw.group_size})"
        else:
            qw = quantized_linear.quantize(m.weight, kind, dtype)
            report.served.setdefault(source_type, f"{qw.describe()} round-to-nearest at load")
        chosen.append((m, qw))
    broken = quantized_linear.check_rows([qw for _, qw in chosen])
    if broken:      # a quantized row would depend on its batch: serve float instead
        return WeightReport(weight_dtype, {"all": f"{float_name} (quantized kernels not batch-invariant here: {broken})"},
                            0, report.linears)
    for m, qw in chosen:
        m.quantize(qw, keep_plain=id(m.weight) in embeddings)
    report.quantized = len(chosen)
    return report


def _choice(weight_dtype: str, types: list[str]) -> tuple[str | None, str]:
    """(kernel kind or None, "stored" | "rtn") for a linear whose parts have these types."""
    stored_int4 = all(t in INT4_TYPES for t in types)
    if weight_dtype in (AUTO, INT4) and stored_int4:
        return INT4, "stored"
    if weight_dtype in (INT4, INT8):
        return weight_dtype, "rtn"
    return None, ""


def _source(sources: dict, name: str, module, model):
    """The checkpoint tensors a linear's weight comes from (a tied head: the embedding's)."""
    source = sources.get(f"{name}.weight")
    if source is None and module.weight is model.embed_tokens.weight:
        source = sources["embed_tokens.weight"]
    return source
