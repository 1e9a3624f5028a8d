"""Text the window shows, from plain settings and stats dicts (no Qt, no engine)."""
from __future__ import annotations

from html import escape
from pathlib import Path

from app.metrics_history import describe_change


def describe_settings(settings: dict, chosen: dict | None = None) -> str:
    """The settings in effect (engine.settings()), as short HTML lines for the side panel."""
    if not settings:
        return "no model loaded yet"
    if settings.get("backend") == "remote":
        return describe_server(settings)
    proposer = settings.get("proposer", "off")
    speculation = "off" if proposer == "off" else f"{proposer}, k={settings.get('num_speculative_tokens')}"
    if proposer != "off" and settings.get("draft_tree", "off") != "off":
        speculation += f", draft tree {escape(str(settings['draft_tree']))}"
    if settings.get("proposer_choice"):          # proposer auto: which one drafts now, and why
        speculation += f"; now {escape(settings['proposer_choice']['chosen'])}: {escape(settings['proposer_choice']['why'])}"
    if settings.get("speculation_paused"):      # the policy found it loses: plain steps, by itself
        speculation += f"; <i>off by itself: {escape(settings['speculation_paused'])}</i>"
    if proposer == "off" and settings.get("proposer_forecast"):
        speculation += f"; {forecast(settings['proposer_forecast'])}"
    if chosen and chosen.get("proposer") == "draft" and proposer == "off":
        speculation += " <i>(the draft proposer needs a draft model)</i>"
    draft = settings.get("draft_model")
    lines = [
        f"<b>KV cache</b>: {escape(str(settings.get('kv_cache_dtype')))}, block {settings.get('block_size')}, "
        f"{settings.get('kv_pool_blocks')} blocks"
        + (f" <i>({escape(settings['kv_cache_why'])})</i>" if settings.get("kv_cache_why") else ""),
        f"<b>Prefix cache</b>: {'on' if settings.get('enable_prefix_caching') else 'off'}",
        f"<b>Speculation</b>: {speculation}",
        f"<b>Draft model</b>: {escape(_short(draft)) if draft else 'none'}",
        f"<b>Runs on</b>: {escape(str(settings.get('device')))}, {escape(str(settings.get('dtype')))} activations, "
        f"{settings.get('threads')} torch thread{'s' if settings.get('threads') != 1 else ''}"
        + _busy_cores(settings),
    ]
    if settings.get("weight_dtype"):
        per_token = settings.get("weight_bytes_per_token")
        read = f", {per_token / 2**20:.0f} MiB read per token" if per_token else ""
        lines.append(f"<b>Weights</b>: {escape(str(settings['weight_dtype']))}{read}")
    if settings.get("moe"):
        lines.append(describe_moe(settings["moe"]))
    paths = settings.get("paths") or {}
    if "linear" in paths:       # the CPU: which kernels passed their trial here (engine.runtime.cpu_paths)
        lines.append(f"<b>CPU kernels</b> ({escape(paths['isa'])}): linears {escape(paths['linear'])}; "
                     f"quantized weights {escape(paths['quantized'])}; dtype {escape(paths['dtype'])}")
    if "decode_graphs" in paths:
        lines.append(f"<b>Step</b>: compiled {escape(paths['compile'])}; attention {escape(paths['attention'])}; "
                     f"decodes and verifies: {escape(paths['decode_graphs'])}")
    if settings.get("memory_plan"):
        lines.append(describe_memory_plan(settings["memory_plan"]))
    if settings.get("chat_template") is False:
        lines.append("<b>Chat template</b>: none in the model folder; messages are sent as plain text")
    return "<br>".join(lines)


def forecast(figures: dict) -> str:
    """Speculation off: each retrieval proposer's predicted speedup on the replies so far
    (engine.speculative.speculator.Speculator.forecast)."""
    parts = []
    for name, f in figures.items():
        if f.get("speedup") is None:
            parts.append(f"{escape(name)} not yet ({f.get('steps', 0)} drafts asked)")
        else:
            parts.append(f"{escape(name)} {f['speedup']:.2f}x (tau {f['tokens_per_step']:.2f}, {f['steps']} drafts)")
    return "<i>predicted if on, from this chat's replies: " + ", ".join(parts) + "</i>"


def _busy_cores(settings: dict) -> str:
    """" (1 of 2: other programs keep 1 of 2 cores busy)" while the engine gave up cores."""
    policy = str(settings.get("thread_policy") or "")
    return f" ({escape(policy)})" if policy.startswith(f"{settings.get('threads')} of ") else ""


def describe_server(settings: dict) -> str:
    """A remote backend's settings: what the server says, and the launch flag for each
    setting it fixes (a value it does not reveal shows as "not reported")."""
    def shown(key):
        value = settings.get(key)
        return "not reported" if value is None else escape(str(value))
    version = f" {escape(str(settings['server_version']))}" if settings.get("server_version") else ""
    lines = [f"<b>Server</b>: {escape(str(settings.get('server')))}{version} at "
             f"{escape(str(settings.get('url')))}, model {shown('model')}",
             f"<b>Metrics</b>: {escape(str(settings.get('metrics')))}"]
    for key, flag in (settings.get("read_only") or {}).items():
        lines.append(f"<b>{escape(key)}</b>: {shown(key)} <i>(fixed at launch: {escape(flag)})</i>")
    return "<br>".join(lines)


def describe_memory_plan(plan: dict) -> str:
    """engine.cache.memory_plan.MemoryPlan.as_dict() as one line."""
    draft = f" (draft {_size(plan['draft_weights_bytes'])})" if plan.get("draft_weights_bytes") else ""
    return (f"<b>Memory plan</b>: weights {_size(plan['weights_bytes'])}{draft}, "
            f"KV pool {_size(plan['kv_pool_bytes'])} = {plan['tokens_that_fit']:,} tokens, "
            f"reserve {_size(plan['reserve_bytes'])} for a {plan['reserve_tokens']:,}-token prompt "
            f"({escape(str(plan['device']))}, {escape(str(plan['budget']))})" + _window_layers(plan.get("kv_layers"))
            + _state(plan.get("state")))


def _state(state: dict | None) -> str:
    """A hybrid model's linear-layer state: its slots, and the prefix cache's snapshots of it."""
    if not state:
        return ""
    return (f"; linear-layer state {state['state_slots']} slots × {_bytes(state['state_bytes_per_sequence'])} = "
            f"{_bytes(state['state_pool_bytes'])}, prefix snapshots up to {state['prefix_snapshots']} "
            f"({_bytes(state['prefix_snapshot_bytes'])})")


def _window_layers(layers: dict | None) -> str:
    """Sliding-window layers are cached as full ones (every block kept): said, not hidden."""
    if not layers or not layers.get("window"):
        return ""
    return (f"; {layers['window']} of {layers['window'] + layers['full']} layers attend a "
            f"{layers['window_tokens']:,}-token window, cached in full like the others (the window is a mask)")


def describe_moe(moe: dict) -> str:
    """An MoE model's experts (engine.engine.moe_figures) as one line: how many, how many a
    token uses, and the weight bytes a token reads as served (its experts and the dense part)."""
    return (f"<b>MoE</b>: {moe['experts']} experts in each of {moe['moe_layers']} layers, {moe['top_k']} active per "
            f"token; a token reads {_bytes(moe['bytes_read_per_token'])} of weights (its experts "
            f"{_bytes(moe['expert_bytes_per_token'])} + the dense part {_bytes(moe['dense_bytes_per_token'])}); "
            f"all experts resident ({_bytes(moe['expert_weights_bytes'])}), a step of B tokens reads up to "
            f"min({moe['experts']}, B×{moe['top_k']}) per layer")


def _bytes(num_bytes: int) -> str:
    """GiB, MiB or KiB, with three figures or so (an expert of a tiny model is a few KiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            value = num_bytes / size
            return f"{value:.{0 if value >= 100 else 1 if value >= 10 else 2}f} {unit}"
    return f"{num_bytes} B"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def describe_deferred(deferred: dict) -> str:
    """What waits for the running reply to end before it applies."""
    if not deferred:
        return ""
    changes = ", ".join(describe_change(k, v) for k, v in deferred.items())
    return f"⏳ Applies when the current reply ends: {escape(changes)}"


def message_stats(summary: dict | None, finish_reason: str | None, settings: dict | None = None,
                  speculation: dict | None = None) -> str:
    """The line under an assistant message: TTFT, decode speed, tokens, acceptance, and the
    speedup when it speculated (`speculation`: engine.metrics.speculation_report)."""
    if not summary:
        return "stopped before the first token" if finish_reason == "cancelled" else "no reply"
    parts = [f"TTFT {summary['ttft_s'] * 1000:.0f} ms",
             f"decode {summary['decode_tok_s']:.1f} tok/s" + _compile_note(summary),
             f"{summary['generated_tokens']} tokens"]
    if summary.get("acceptance_rate") is not None:
        parts.append(f"acceptance {summary['acceptance_rate'] * 100:.0f}% "
                     f"({summary['accepted']}/{summary['proposed']}{_tau(summary.get('mean_accepted_len'))})")
        if summary.get("drafted_by"):                  # which proposer drafted how many steps (auto's choices)
            parts.append("drafted by " + ", ".join(f"{escape(name)} ×{steps}" for name, steps
                                                   in sorted(summary["drafted_by"].items(), key=lambda kv: -kv[1])))
    else:
        parts.append("acceptance — (speculation off)")
    if speculation:
        parts.append(describe_speedup(speculation))
    if summary.get("prefix_hit_tokens"):
        parts.append(f"prefix hit {summary['prefix_hit_tokens']}/{summary['prompt_tokens']} tokens")
    if summary.get("prefix_recomputed_tokens"):     # a hybrid model's hit cut back to a state snapshot
        parts.append(f"{summary['prefix_recomputed_tokens']} cached tokens recomputed (no state saved there)")
    if settings:
        dtype = settings.get("kv_cache_dtype")
        parts.append(f"KV {dtype}" if dtype else "KV dtype not reported")     # a server may not say
    if finish_reason in ("cancelled", "length"):
        parts.append("stopped" if finish_reason == "cancelled" else "max tokens reached")
    return " · ".join(parts)


def _compile_note(summary: dict) -> str:
    """A reply whose step compiled says how long that took, left out of its decode speed."""
    seconds = summary.get("compile_s") or 0.0
    return f" (a {seconds:.1f} s compile not counted)" if seconds else ""


def describe_speedup(report: dict) -> str:
    """A reply's speedup over plain decoding, measured and predicted (speculation_report)."""
    source = " (plain speed from a calibration)" if report.get("plain_source") == "calibration" else ""
    return (f"speedup {_times(report['measured_speedup'])} measured · "
            f"{_times(report['predicted_speedup'])} predicted{source}")


def speculation_verdict(report: dict | None) -> tuple[str, str, bool] | None:
    """Does speculation pay here? (headline, details, pays) from a speculation_report (the
    session's, over the replies of this set-up); None when there is nothing to say (off, or
    not measured yet). Losing, the details say why: alpha against the break-even alpha for
    this k and these costs, or that no alpha can pay with these costs."""
    if not report or report.get("measured_speedup") is None:
        return None
    measured, predicted, k = report["measured_speedup"], report["predicted_speedup"], report["k"]
    figures = f"{_times(measured)} measured, {_times(predicted)} predicted"
    if measured >= 1.0:
        return f"speculation pays here: {figures}", _notes(report), True
    alpha, even = report.get("alpha"), report["break_even_alpha"]
    if even is None:
        why = (f"it cannot pay at k={k} with these costs (draft {report['draft_cost']:.2f}, "
               f"verify {report['verify_cost']:.2f} of a plain step)")
    elif alpha is not None and alpha < even:
        why = f"α {alpha:.2f} is below break-even {even:.2f} at k={k}"
    else:      # the i.i.d. model says it should pay: the measured costs or α vary more than it assumes
        why = f"α {_number(alpha)} reaches break-even {even:.2f} at k={k}, yet the measured speed does not"
    return f"speculation is losing here: {figures}", "; ".join(filter(None, (why, _notes(report)))), False


def _notes(report: dict) -> str:
    """Which replies, and where the plain speed came from when it was not measured in the session."""
    replies = report.get("replies")
    notes = [f"over {replies} repl{'y' if replies == 1 else 'ies'}"] if replies else []
    if report.get("plain_source") == "calibration":
        notes.append("plain speed from a calibration")
    return ", ".join(notes)


def _times(speedup: float | None) -> str:
    return "—" if speedup is None else f"{speedup:.2f}x"


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _tau(mean_accepted_len: float | None) -> str:
    return "" if mean_accepted_len is None else f", τ={mean_accepted_len:.2f}"    # a server may not say


def _short(reference: str) -> str:
    return reference if reference in ("self", "default") else Path(reference).name
