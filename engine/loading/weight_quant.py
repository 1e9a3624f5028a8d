"""The `weight_dtype` setting at load: which linears are served quantized, and from what.

  auto   as stored: a GGUF's 4-bit tensors (Q4_0, Q4_1) and an AWQ/GPTQ checkpoint's int4
         linears stay 4-bit, in the int4 kernel's format, exactly (engine.loading.gguf_tensors,
         engine.loading.awq_gptq); every other tensor, and every tensor of a float
         checkpoint, is served in the compute dtype (the `dtype` setting).
  float  every weight dequantized to the compute dtype (what the loader did before).
  int8   every linear quantized at load, round-to-nearest per channel (an int4 source
         dequantized first).
  int4   every linear in int4: 4-bit tensors as stored, the others quantized at load,
         round-to-nearest per group of 32 (gpt-fast's recipe).
torch's CPU kernels are fast with bf16 activations only (engine.layers.quantized_linear), so
`auto` keeps a quantized source quantized only when the compute dtype is bf16; in float32
it dequantizes, and says why. int8 / int4 serve as asked in any dtype, the report noting
a slow one.
The tied head quantizes beside the embedding, which stays in float for its lookups.
Q8_0 and the k-quants have no kernel here that keeps them exact (torch's int8 kernel scales
per channel, Q8_0 per 32 weights), so under `auto` they are dequantized, and the report says so.
An AWQ/GPTQ linear served as stored is never read in float: the loader leaves its parameter
on the meta device (`served_as_stored`) and its int4 groups come straight from the packed
tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.layers import quantized_linear
from engine.layers.quantized_linear import INT4, INT8
from engine.loading.awq_gptq import METHODS as AWQ_GPTQ_TYPES
from engine.loading.gguf_tensors import INT4_TYPES

STORED_INT4_TYPES = INT4_TYPES + AWQ_GPTQ_TYPES      # served as int4 as stored

AUTO, FLOAT = "auto", "float"
FLOAT_SOURCE = "float"          # a tensor of a float checkpoint


@dataclass
class WeightReport:
    """What `weight_dtype` did, for "In effect" and the bench."""
    requested: str
    served: dict[str, str] = field(default_factory=dict)     # source type -> how it is served
    quantized: int = 0          # linears served quantized
    linears: int = 0
    note: str | None = None     # e.g. why the quantized kernels will be slow

    @property
    def identity_tag(self) -> str:
        """Part of the model's identity (and so of the prefix cache's keys): other weights,
        other keys."""
        return "" if not self.quantized else "|weights:" + ",".join(f"{k}={v}" for k, v in sorted(self.served.items()))

    def summary(self) -> str:
        if not self.quantized:
            return next(iter(self.served.values()), FLOAT)
        return "; ".join([f"{source}: {how}" for source, how in self.served.items()]
                         + ([f"slow: {self.note}"] if self.note else []))

    def as_dict(self) -> dict:
        return {"requested": self.requested, "served": dict(self.served), "quantized_linears": self.quantized,
                "linears": self.linears, "note": self.note}


@dataclass
class LinearPlan:
    """How one linear is served."""
    name: str                   # ours: "layers.0.self_attn.qkv_proj"
    module: torch.nn.Module
    parts: list[str]            # the stored tensors its weight is made of
    source_type: str            # "float", "Q4_1", "AWQ", ...
    kind: str | None            # INT4 | INT8 | None (float)
    how: str                    # "stored" | "rtn" | ""
    why_not: str | None         # why `kind` cannot be served here (then: float)

    @property
    def as_stored(self) -> bool:
        return self.how == "stored" and not self.why_not


def plan_linears(model, weight_dtype: str, device: torch.device, stored, dtype: torch.dtype) -> list[LinearPlan]:
    """Per linear: what `weight_dtype` asks for it. `stored` gives the stored type and int4
    groups of a quantized source (a GGUF, an AWQ/GPTQ checkpoint), or is None."""
    from engine.models.llama import Linear
    sources = {s.param: s for s in model.weight_sources()}
    plans = []
    for name, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        parts = [part for part, _ in _source(sources, name, m, model).parts]
        types = [stored.type_of(p) or FLOAT_SOURCE for p in parts] if stored is not None else [FLOAT_SOURCE]
        source_type = types[0] if len(set(types)) == 1 else "+".join(sorted(set(types)))
        kind, how = _choice(weight_dtype, types)
        group = stored.int4_group(m.weight.shape[1]) if how == "stored" else quantized_linear.INT4_GROUP
        why_not = kind and quantized_linear.unsupported(kind, tuple(m.weight.shape), device, dtype, group)
        if kind and weight_dtype == AUTO and not why_not:     # auto never picks a slow kernel
            why_not = quantized_linear.slow_in(dtype)
        plans.append(LinearPlan(name, m, parts, source_type, kind, how, why_not or None))
    return plans


def served_as_stored(model, weight_dtype: str, device: torch.device, stored, dtype: torch.dtype) -> set[str]:
    """The parameters whose values will come from `stored`'s int4 groups, not from a float read
    (`dtype`: the compute dtype the model is loaded in)."""
    return {f"{p.name}.weight" for p in plan_linears(model, weight_dtype, device, stored, dtype) if p.as_stored}


def serve_weights(model, weight_dtype: str, device: torch.device, stored) -> WeightReport:
    """Quantize the model's linears as `weight_dtype` asks (see the module docstring). The
    float weights must be loaded, except those `served_as_stored` left on the meta device;
    a quantized linear's float parameter is then freed."""
    dtype = next(model.parameters()).dtype
    report = WeightReport(weight_dtype)
    float_name = str(dtype).removeprefix("torch.")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    chosen = []
    for p in plan_linears(model, weight_dtype, device, stored, dtype):
        report.linears += 1
        if p.kind is None or p.why_not:
            report.served.setdefault(p.source_type, f"{float_name}" + (
                f" (dequantized: {p.why_not})" if p.why_not else "" if p.source_type == FLOAT_SOURCE else " (dequantized)"))
            continue
        if p.how == "stored":
            q, scale, zero = (torch.cat(t) for t in zip(*(stored.int4_groups(part) for part in p.parts)))
            qw = quantized_linear.from_int4_groups(q, scale, zero, dtype)
            report.served[p.source_type] = f"int4 as stored (group {qw.group_size})"
        else:
            qw = quantized_linear.quantize(p.module.weight, p.kind, dtype)
            report.served.setdefault(p.source_type, f"{qw.describe()} round-to-nearest at load")
        chosen.append((p.module, qw))
    broken = quantized_linear.check_rows([qw for _, qw in chosen])
    if broken:      # a quantized row would depend on its batch: serve float instead
        for m, qw in chosen:
            if m.weight.is_meta:        # never read in float: its values from the int4 groups
                m.weight = torch.nn.Parameter(quantized_linear.dequantize(qw), requires_grad=False)
        return WeightReport(weight_dtype, {"all": f"{float_name} (quantized kernels not batch-invariant here: {broken})"},
                            0, report.linears)
    for m, qw in chosen:
        m.quantize(qw, keep_plain=id(m.weight) in embeddings)
    report.quantized = len(chosen)
    # asked for explicitly (auto does not pick a slow kernel): served, and said
    report.note = quantized_linear.slow_in(dtype) if chosen else None
    return report


def _choice(weight_dtype: str, types: list[str]) -> tuple[str | None, str]:
    """(kernel kind or None, "stored" | "rtn") for a linear whose parts have these types."""
    stored_int4 = all(t in STORED_INT4_TYPES for t in types)
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
