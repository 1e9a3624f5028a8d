"""Colours and the style sheet, in one place so the chat, legend and plots agree."""
from __future__ import annotations

from resources import APP_ICON, STYLE_SHEET

# Token kinds (engine.metrics) -> (text colour, background) in the chat.
TOKEN_COLOURS = {
    "target": ("#1f2328", None),
    "accepted": ("#116329", "#d1f5d9"),
    "resampled": ("#7d4e00", "#fff1c2"),
    "bonus": ("#0a4fa6", "#dcecff"),
}
TOKEN_LEGEND = (
    ("target", "sampled by the target"),
    ("accepted", "accepted draft token"),
    ("resampled", "resampled after a rejection"),
    ("bonus", "bonus token (all k accepted)"),
)

# Plot pens: one colour per series, readable on white.
PLOT_COLOURS = {
    "acceptance": "#2f81f7",
    "running": "#cf222e",
    "positions": "#8250df",
    "kv_model": "#1a7f37",
    "kv_fp8": "#bf3989",
    "capacity": "#57606a",
    "kv_share": "#0969da",
    "ttft": "#2f81f7",
    "prefix": "#d4a72c",
    "tok_s": "#8c959f",
    "running_tok_s": "#cf222e",
    "marker": "#9a6700",
    "compile": "#9a6700",       # a decode step that compiled (not counted in decode speed)
    "tree_path": "#1a7f37",     # a draft tree's accepted path (green, as accepted tokens in the chat)
    "tree_predicted": "#8250df",
    "tree_nodes": "#2f81f7",
}
# The acceptance plot's points, by the proposer that drafted the step (a step that does not
# say which keeps PLOT_COLOURS["acceptance"]).
PROPOSER_COLOURS = {"suffix": "#bf3989", "ngram": "#bc4c00", "eagle": "#8250df", "draft": "#1a7f37",
                    "assistant": "#0550ae"}
# The load panel's series.
LOAD_COLOURS = {
    "running": "#1a7f37", "waiting": "#d4a72c", "kv_used": "#1a7f37", "capacity": "#57606a",
    "throughput": "#2f81f7", "p50": "#2f81f7", "p99": "#cf222e", "preemptions": "#8250df", "speedup": "#bf3989",
    "experts": "#bf3989", "all_experts": "#57606a",
}
ERROR_COLOUR = "#cf222e"
CODE_BACKGROUND = "#f3f5f7"   # a code block's box in a rendered reply
PAYS_COLOUR = "#1a7f37"       # "speculation pays here"
MUTED_COLOUR = "#57606a"


def style_sheet() -> str:
    try:
        return STYLE_SHEET.read_text(encoding="utf-8")
    except OSError:
        return ""     # unstyled is still usable
