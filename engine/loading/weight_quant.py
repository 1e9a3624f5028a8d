"""The `weight_dtype` setting at load: which linears are served quantized, and from what.

  auto   as stored, in the form engine.loading.stored_formats gives each stored type on this
         device: a GGUF's Q4_0, Q4_1, Q4_K and an AWQ/GPTQ checkpoint's int4 linears in the
         int4 kernel's groups, a GGUF's Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 in the 8-bit group
         kernel's (groups of 32, Q6_K's of 16), exactly (engine.loading.gguf_tensors,
         engine.loading.awq_gptq). A fused linear whose parts are stored in different types
         (q, k in Q4_K and v in Q6_K) runs each part in its own kernel (quantized_linear.stack).
         A type the table gives no form here (MXFP4, Q2_K, ...; every type on CUDA) is
         dequantized, and the report says why; every tensor of a float checkpoint is served
         in the compute dtype (the `dtype` setting).
  float  every weight dequantized to the compute dtype.
  int8   every linear quantized at load, round-to-nearest per channel (a quantized source
         dequantized first).
  int4   every linear in int4: 4-bit tensors as stored, the others quantized at load,
         round-to-nearest per group of 32 (gpt-fast's recipe).
`auto` keeps a quantized source quantized only where its kernel is fast for the compute
dtype (quantized_linear.slow_in: torch's CPU kernels are fast with bf16 activations only);
in float32 it dequantizes, and says why. int8 / int4 serve as asked in any dtype, the
report noting a slow one.
A head tied to the embedding and served as stored by our kernel also serves the embedding's
lookups (no float table); an embedding no head shares is looked up in its own stored blocks
where every linear is served as stored (`embedding_plan`: an 8B's table costs its 0.35 GB as
stored, not 2.5 GB in fp32); elsewhere the table is held in the compute dtype.
A linear served as stored is never read in float: the loader leaves its parameter on the
meta device (`served_as_stored`) and its groups come straight from the stored blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.layers import quantized_linear
from engine.layers.quantized_linear import INT4, INT5_GROUPS, INT8, INT8_GROUPS
from engine.loading.stored_formats import AT_LOAD_FORMATS, CHECKPOINT_GROUP, FLOAT_SOURCE, FLOAT_TYPES, format_of

AUTO, FLOAT = "auto", "float"
PART_VALUES = 2**25             # a stored tensor larger than this is packed in slices of rows
PART_ROWS = 256                 # ... of a multiple of this many rows (the kernels' row tiles divide it)


@dataclass
class WeightReport:
    """What `weight_dtype` did, for "In effect" and the bench."""
    requested: str
    served: dict[str, str] = field(default_factory=dict)     # source type -> how it is served
    quantized: int = 0          # linears served quantized
    linears: int = 0
    note: str | None = None     # e.g. why the quantized kernels will be slow
    embedding: str | None = None    # an untied embedding looked up in its stored blocks: how

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
                "linears": self.linears, "note": self.note, "embedding": self.embedding}


@dataclass
class LinearPlan:
    """How one linear is served."""
    name: str                   # ours: "layers.0.self_attn.qkv_proj"
    module: torch.nn.Module
    parts: list[str]            # the stored tensors its weight is made of
    types: list[str]            # each part's stored type: "float", "Q4_K", "Q6_K", "AWQ", ...
    kind: str | None            # INT4 | INT8 (at load) | "stored" (each part its own form) | None (float)
    how: str                    # "stored" | "rtn" | ""
    why_not: str | None         # why `kind` cannot be served here (then: float)
    forms: list[tuple[str, int]] = field(default_factory=list)     # as stored: each part's (form, group)
    part_rows: list[int] = field(default_factory=list)              # each part's rows (out features)

    @property
    def source_type(self) -> str:
        return self.types[0] if len(set(self.types)) == 1 else "+".join(sorted(set(self.types)))

    @property
    def as_stored(self) -> bool:
        return self.how == "stored" and not self.why_not


def plan_linears(model, weight_dtype: str, device: torch.device, stored, dtype: torch.dtype) -> list[LinearPlan]:
    """Per linear: what `weight_dtype` asks for it, and what the table of stored formats
    (engine.loading.stored_formats) gives each of its parts on `device`. `stored` gives the
    stored type and the quantized groups of a quantized source (a GGUF, an AWQ/GPTQ
    checkpoint), or is None."""
    from engine.models.llama import Linear
    sources = {s.param: s for s in model.weight_sources()}
    plans = []
    for name, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        parts = [(part, shape) for part, shape in _source(sources, name, m, model).parts]
        types = [stored.type_of(p) or FLOAT_SOURCE for p, _ in parts] if stored is not None else [FLOAT_SOURCE]
        kind, how = _choice(weight_dtype, types, device)
        forms = [_form(source_type, stored, part, shape, device, dtype) for (part, shape), source_type in zip(parts, types)]
        if how == "stored":
            why_not = _why_not_stored(parts, forms, device, dtype, weight_dtype == AUTO, stored)
        elif how == "rtn":
            why_not = _why_not_at_load(kind, tuple(m.weight.shape), device, dtype)
        else:       # auto, with a part the table gives no form here (a float checkpoint: none to give)
            why_not = _no_form(types, device)
        plans.append(LinearPlan(name, m, [p for p, _ in parts], types, kind, how, why_not or None,
                                forms if how == "stored" else [], [int(shape[0]) for _, shape in parts]))
    return plans


def _form(source_type: str, stored, part: str, shape, device: torch.device, dtype: torch.dtype
          ) -> tuple[str | None, int | None]:
    """(the kernel form the table gives a stored type on `device`, its group): a GGUF type's
    group is the table's, an AWQ/GPTQ checkpoint's its config's; a K-quant whose super-blocks
    cannot be read here (its kernel refused, the shape, reordered columns) its widened form's."""
    fmt = format_of(source_type)
    group = stored.int4_group(shape[1]) if fmt.group is CHECKPOINT_GROUP and fmt.cpu.form else fmt.group
    form = fmt.on(device).form
    if form in quantized_linear.KQUANTS and (stored.moves_columns(part) or quantized_linear.unsupported(
            form, tuple(shape), device, dtype, group)):
        return fmt.widened
    return form, group


def _no_form(types: list[str], device: torch.device) -> str | None:
    """Under auto, why a quantized source is dequantized: the table's reason for each stored
    type it gives no kernel form on `device`."""
    servings = [format_of(t).on(device) for t in sorted(set(types)) if t not in FLOAT_TYPES]
    return "; ".join(dict.fromkeys(s.why for s in servings if s.form is None)) or None


def _why_not_stored(parts, forms, device, dtype, auto: bool, stored) -> str | None:
    """Why some part of a linear cannot be served in its stored form here (None: all can)."""
    for (part, shape), (form, group) in zip(parts, forms):
        if form in quantized_linear.GPU_FORMS and stored.moves_columns(part):
            return "the file's columns are reordered (a hybrid's), which the GPU kernel's blocks cannot follow"
        why_not = quantized_linear.unsupported(form, tuple(shape), device, dtype, group)
        if not why_not and auto and form not in quantized_linear.GPU_FORMS:     # auto never picks a slow kernel
            why_not = quantized_linear.slow_in(dtype)
        if why_not:
            return why_not
    return None


def _why_not_at_load(kind: str, shape: tuple[int, int], device, dtype) -> str | None:
    """Why `weight_dtype` int4 / int8 cannot quantize a weight of this shape at load here."""
    serving = AT_LOAD_FORMATS[kind].on(device)
    if serving.form is None:
        return serving.why
    return quantized_linear.unsupported(kind, shape, device, dtype, AT_LOAD_FORMATS[kind].group)


def served_as_stored(model, weight_dtype: str, device: torch.device, stored, dtype: torch.dtype) -> set[str]:
    """The parameters whose values will come from `stored`'s quantized groups, not from a float
    read (`dtype`: the compute dtype the model is loaded in)."""
    plans = plan_linears(model, weight_dtype, device, stored, dtype)
    names = {f"{p.name}.weight" for p in plans if p.as_stored}
    if any(_embedding_in_head(model, p, device, dtype) for p in plans) or embedding_plan(model, plans, device, stored, dtype):
        names.add("embed_tokens.weight")          # looked up in stored bytes, never read in float
    return names


def embedding_plan(model, plans: list[LinearPlan], device: torch.device, stored, dtype: torch.dtype
                   ) -> LinearPlan | None:
    """An embedding no head shares (an 8B's 151936 x 4096 Q4_K table: 2.5 GB in fp32, 0.35 GB
    as stored) looked up in its own stored blocks, as a tied one is in its head's: the plan of
    its weight when every plan's linear is served as stored (the weights stay quantized) and
    our kernel's layout takes its stored type (so rows can be read); else None (a float table)."""
    embedding = getattr(model, "embed_tokens", None)
    name = "model.embed_tokens.weight"
    if (stored is None or not hasattr(embedding, "serve_from")
            or getattr(getattr(model, "lm_head", None), "weight", None) is embedding.weight
            or not plans or not all(p.as_stored for p in plans)):
        return None
    source_type = stored.type_of(name)
    if source_type is None or source_type in FLOAT_TYPES or format_of(source_type).on(device).form is None:
        return None
    shape = tuple(embedding.weight.shape)
    form = _form(source_type, stored, name, shape, device, dtype)
    if form[0] is None or not quantized_linear.looks_up(form[0], shape, form[1], device, dtype):
        return None
    return LinearPlan("embed_tokens", embedding, [name], [source_type], "stored", "stored", None, [form], [shape[0]])


def _embedding_in_head(model, plan: LinearPlan, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the embedding's lookups come from this plan's weight: a head tied to it, served
    as stored by a kernel whose rows can be read, so no float table is held."""
    if plan.name != "lm_head" or not plan.as_stored or model.lm_head.weight is not model.embed_tokens.weight:
        return False
    shape = tuple(model.lm_head.weight.shape)
    return all(quantized_linear.looks_up(form, shape, group, device, dtype) for form, group in plan.forms)


def serve_weights(model, weight_dtype: str, device: torch.device, stored,
                  packed: Callable[[LinearPlan], None] = lambda plan: None) -> WeightReport:
    """Quantize the model's linears as `weight_dtype` asks (see the module docstring). The
    float weights must be loaded, except those `served_as_stored` left on the meta device;
    a quantized linear's float parameter is then freed. `packed(plan)` follows each weight
    read as stored (the load's progress)."""
    dtype = next(model.parameters()).dtype
    report = WeightReport(weight_dtype)
    float_name = str(dtype).removeprefix("torch.")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    chosen = []
    plans = plan_linears(model, weight_dtype, device, stored, dtype)
    for p in plans:
        report.linears += 1
        if p.kind is None or p.why_not:
            report.served.setdefault(p.source_type, f"{float_name}" + (
                f" (dequantized: {p.why_not})" if p.why_not else "" if p.source_type == FLOAT_SOURCE else " (dequantized)"))
            continue
        if p.how == "stored":
            qw = stored_weight(p, stored, dtype, device)
            packed(p)
            forms = {t: format_of(t).describe(form, group) for t, (form, group) in zip(p.types, p.forms)}
        else:
            qw = quantized_linear.quantize(p.module.weight, p.kind, dtype)
            forms = {p.source_type: f"{qw.describe()} round-to-nearest at load"}
        chosen.append((p, qw, forms))
    table = embedding_plan(model, plans, device, stored, dtype)
    if table is not None:           # looked up in its stored blocks: no float table
        model.embed_tokens.serve_from(stored_weight(table, stored, dtype, device))
        packed(table)
        report.embedding = f"{table.source_type} looked up as stored"
    broken = _row_variant_kinds([qw for _, qw, _ in chosen])
    served = 0
    for p, qw, forms in chosen:
        why = next((broken[k] for k in _kinds(qw) if k in broken), None)
        if why is None:
            looked_up = _embedding_in_head(model, p, device, dtype) and quantized_linear.can_look_up(qw)
            p.module.quantize(qw, keep_plain=id(p.module.weight) in embeddings and not looked_up)
            if looked_up:
                model.embed_tokens.serve_from(qw)
            served += 1
            for source_type, form in forms.items():
                report.served.setdefault(source_type, form)
            continue
        # a quantized row would depend on its batch: this linear is served in float instead
        if p.module.weight.is_meta:         # never read in float: its values from the stored groups
            p.module.weight = torch.nn.Parameter(quantized_linear.dequantize(qw).to(dtype), requires_grad=False)
            if _embedding_in_head(model, p, device, dtype):        # the tied table comes back with it
                model.embed_tokens.weight = p.module.weight
        report.served[p.source_type] = f"{float_name} (quantized kernels not batch-invariant here: {why})"
    report.quantized = served
    # asked for explicitly (auto does not pick a slow kernel): served, and said
    report.note = quantized_linear.slow_in(dtype) if served else None
    return report


def _kinds(qw) -> list[str]:
    return [part.kind for part in getattr(qw, "parts", [qw])]


def _row_variant_kinds(weights: list) -> dict[str, str]:
    """Per kernel kind whose rows depend on the row count here (quantized_linear.check_rows,
    over every part of the kind): what differed."""
    parts = [part for qw in weights for part in getattr(qw, "parts", [qw])]
    broken = {}
    for kind in dict.fromkeys(part.kind for part in parts):
        why = quantized_linear.check_rows([part for part in parts if part.kind == kind])
        if why:
            broken[kind] = why
    return broken


def stored_weight(plan: LinearPlan, stored, dtype: torch.dtype, device: torch.device = torch.device("cpu")):
    """The linear's weight from its stored parts on `device`: each run of parts of one form and
    group concatenated into one kernel's weight, runs of different forms stacked (a q/k in Q4_K
    with a v in Q6_K)."""
    runs: list[tuple[tuple[str, int], list[str]]] = []
    for part, form in zip(plan.parts, plan.forms):
        if runs and runs[-1][0] == form:
            runs[-1][1].append(part)
        else:
            runs.append((form, [part]))
    weights = []
    for (form, _), parts in runs:
        groups = _reader(stored, form)
        joined = quantized_linear.Joined(sum(r for p, r in zip(plan.parts, plan.part_rows) if p in parts))
        for chunk in _row_chunks(plan, parts):
            tensors = _cat(form, [groups(part) if rows == slice(None) else groups(part, rows) for part, rows in chunk])
            if form in quantized_linear.KQUANTS:
                joined.add_kquant(*tensors, form, dtype)
            else:
                joined.add(_from_groups(form, tensors, dtype, device))
            del tensors
            release_freed_memory()
        weights.extend(joined.weights())
    return quantized_linear.stack(weights)


def _reader(stored, form: str):
    """The stored source's method giving a part's (rows') tensors in `form`."""
    if form == quantized_linear.GPU_INT4_ZP:
        return stored.int4_zero_points
    if form in quantized_linear.KQUANTS or form in quantized_linear.GPU_FORMS:
        return stored.blocks
    return getattr(stored, {INT4: "int4_groups", INT5_GROUPS: "int5_groups"}.get(form, "int8_groups"))


def _from_groups(form: str, tensors: tuple[torch.Tensor, ...], dtype: torch.dtype, device: torch.device):
    """A kernel's weight from a stored form's tensors: int4 and int5 (q, scale, zero); 8-bit
    groups (q, scale) or, where the format has a zero point (Q5_K widened), (q, scale, zero);
    on the GPU a GGUF's blocks (raw,) or AWQ/GPTQ's (q, z, s)."""
    if form == quantized_linear.GPU_INT4_ZP:
        return quantized_linear.from_int4_zero_points(*tensors, dtype, device)
    if form in quantized_linear.GPU_FORMS:
        return quantized_linear.from_gpu_blocks(*tensors, quantized_linear.GPU_FORMS[form], dtype, device)
    if form == INT4:
        return quantized_linear.from_int4_groups(*tensors, dtype)
    if form == INT5_GROUPS:
        return quantized_linear.from_int5_groups(*tensors, dtype)
    if form in quantized_linear.KQUANTS:
        return quantized_linear.from_kquant(*tensors, form, dtype)
    q, scale, *zero = tensors
    return quantized_linear.from_int8_groups(q, scale, dtype, *zero)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim). Decoding and packing
    free tens of MB of temporaries per weight between the weights that stay; glibc keeps
    those pages, fragmented, so without this a Qwen3-1.7B load held 470 MB it had freed.
    Elsewhere (no glibc): nothing."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    import ctypes
    import ctypes.util
    import platform
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _glibc()


def _row_chunks(plan: LinearPlan, parts: list[str]) -> list[list[tuple[str, slice]]]:
    """The run of `parts` (stored tensors of one form, their rows concatenated) as the chunks
    it is decoded and packed in, each chunk [(part, its rows)] one weight of the stack. A run
    up to PART_VALUES values is one chunk of whole parts; a larger one (a tied head: 151936 x
    2048; an 8B's fused gate/up: 2 x 12288 x 4096) is cut part by part, each part into slices
    of its own rows, so the load's transient memory is a slice's (packing copies a weight
    several times over), not the run's."""
    rows = dict(zip(plan.parts, plan.part_rows))
    inp = plan.module.weight.shape[1]
    if sum(rows[p] for p in parts) * inp <= PART_VALUES:
        return [[(part, slice(None)) for part in parts]]
    step = max(PART_ROWS, PART_VALUES // inp // PART_ROWS * PART_ROWS)
    return [[(part, slice(None) if rows[part] <= step else slice(start, min(start + step, rows[part])))]
            for part in parts for start in range(0, rows[part], step)]


def _cat(form: str, groups: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The parts' (q, scale[, zero]) stacked along the rows (one part: as it is, no copy); 8-bit
    groups with and without a zero point (a Q5_0 q/k with a Q8_0 v) all in the unsigned form
    with a zero (quantized_linear.unsigned8), the same bytes as each packed alone."""
    if len(groups) == 1:
        return groups[0]
    if form == INT8_GROUPS and len({len(g) for g in groups}) > 1:
        groups = [quantized_linear.unsigned8(*g) for g in groups]
    return tuple(torch.cat(t) for t in zip(*groups))


def _choice(weight_dtype: str, types: list[str], device: torch.device) -> tuple[str | None, str]:
    """(kernel kind or None, "stored" | "rtn") for a linear whose parts have these types."""
    forms = [format_of(t).on(device).form for t in types]
    if weight_dtype == AUTO and all(forms):
        return "stored", "stored"
    if weight_dtype == INT4 and all(form in (INT4, quantized_linear.Q4_K) for form in forms):
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
