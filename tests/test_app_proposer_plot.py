"""The acceptance plot says which proposer drafted each step: under `proposer: auto` the
engine picks one per step (engine StepEvent.proposer), and each point takes its colour, with
the proposers drawn named in the legend. A step that does not say (a server's) keeps one colour."""
import re

from app.metrics_history import MetricsHistory
from app.plots_panel import PlotsPanel
from app.theme import PLOT_COLOURS, PROPOSER_COLOURS
from engine.metrics import ACCEPTED, RESAMPLED, TARGET, RequestStats, StepEvent

AUTO = {"kv_cache_dtype": "float32", "enable_prefix_caching": True, "proposer": "auto",
        "num_speculative_tokens": 4, "draft_tree": "off"}


def step_event(stats: RequestStats, step: int, proposer: str | None, accepted: int, proposed: int = 4) -> dict:
    """A decode step that drafted `proposed` tokens with `proposer`, `accepted` of them kept."""
    kinds = [ACCEPTED] * accepted + [RESAMPLED] if proposed else [TARGET]
    event = StepEvent(step=step, token_ids=[1] * len(kinds), token_kinds=kinds, pieces=[("x" * len(kinds), TARGET)],
                      time_s=0.1 * (step + 1), step_time_s=0.05, target_time_s=0.04, draft_time_s=0.01,
                      target_passes=1, proposed=proposed, accepted=accepted,
                      accepted_per_position=[True] * accepted + [False] * (accepted < proposed),
                      kv_bytes_used=2**20, kv_bytes_capacity=2**29, kv_bytes_per_token=2**10, kv_dtype="float32",
                      prefix_hit_tokens=0, prompt_tokens=10, generated_tokens=stats.generated_tokens + len(kinds),
                      ttft_s=0.2 if step == 0 else None, settings=AUTO if step == 0 else None, proposer=proposer)
    stats.record_step(event)
    event.running = stats.as_dict()
    return event.as_dict()


def drawn(item) -> tuple[list, list]:
    x, y = item.getData()
    return ([] if x is None else list(x)), ([] if y is None else list(y))


def legend_colours(title: str) -> dict[str, str]:
    """{name: colour} of the legend's points in a title built by plots_panel._title_with_legend."""
    entries = re.findall(r"<span style='color:([^']+)'>●</span>&nbsp;(.+?)(?=&nbsp; |</span>)", title)
    return {name.replace("&nbsp;", " "): colour for colour, name in entries}


def test_acceptance_points_take_the_colour_of_the_proposer_that_drafted_the_step(qtbot):
    history, stats = MetricsHistory(), RequestStats(prompt_tokens=10)
    for step, (proposer, accepted) in enumerate([(None, 0), ("suffix", 4), ("suffix", 2), ("eagle", 1),
                                                 ("ngram", 3), ("suffix", 0)]):
        history.record_step(step_event(stats, step, proposer, accepted, proposed=4 if proposer else 0))
    panel = PlotsPanel(history)
    qtbot.addWidget(panel)
    panel.refresh()
    points = {name: drawn(panel.acceptance_by_drafter[name]) for name in ("suffix", "eagle", "ngram", "draft")}
    assert points == {"suffix": ([1, 2, 5], [100.0, 50.0, 0.0]), "eagle": ([3], [25.0]), "ngram": ([4], [75.0]),
                      "draft": ([], [])}
    assert drawn(panel.acceptance_points) == ([], [])           # every drafting step said which
    for name in ("suffix", "eagle", "ngram"):
        assert panel.acceptance_by_drafter[name].opts["symbolBrush"] == PROPOSER_COLOURS[name]
    legend = legend_colours(panel.acceptance_title.text)
    assert legend == {name: PROPOSER_COLOURS[name] for name in ("eagle", "ngram", "suffix")}
    assert len(set(PROPOSER_COLOURS.values()) | {PLOT_COLOURS["acceptance"], PLOT_COLOURS["running"]}) == len(
        PROPOSER_COLOURS) + 2
    assert [label["drafted_by"] for label in history.step_labels] == ["", "suffix", "suffix", "eagle", "ngram",
                                                                      "suffix"]


def test_steps_that_do_not_say_which_proposer_drafted_keep_one_colour(qtbot):
    history, stats = MetricsHistory(), RequestStats(prompt_tokens=10)
    for step, accepted in enumerate([0, 3, 1]):
        history.record_step(step_event(stats, step, None, accepted, proposed=4 if step else 0))
    panel = PlotsPanel(history)
    qtbot.addWidget(panel)
    panel.refresh()
    assert drawn(panel.acceptance_points) == ([1, 2], [75.0, 25.0])
    assert all(drawn(item) == ([], []) for item in panel.acceptance_by_drafter.values())
    assert legend_colours(panel.acceptance_title.text) == {"per step": PLOT_COLOURS["acceptance"]}
