"""Does speculation pay? (issue 13) From the engine's reports to what the window says: the
speedup under each reply, the session's figure over the replies of one set-up (combined by
engine.metrics.combine_running), the verdict on the acceptance plot, the CSV columns, and
a server's per-position counters in the per-position plot."""
import csv
import math

import pytest

from app.formatting import message_stats, speculation_verdict
from app.metrics_history import SERVER, STEPS, MetricsHistory
from engine.metrics import PositionCounts, RequestStats, combine_running, combined, speculation_report
from tests.conftest import chat
from test_app import (REPLY_TIMEOUT_MS, FakeRequest, open_workbench, send, set_options,  # noqa: F401 - fixtures
                      tiny_bench, tiny_profile)

K = 4
SETTINGS = {"kv_cache_dtype": "float32", "enable_prefix_caching": True, "proposer": "draft",
            "num_speculative_tokens": K, "draft_model": "self"}
# FakeRequest's verification steps take 0.05 s (0.04 s the target pass, 0.01 s drafting K tokens)
SLOW_PLAIN_STEP_S = 0.04       # speculation pays when drafts are accepted
FAST_PLAIN_STEP_S = 0.02       # it loses when few are
FASTEST_PLAIN_STEP_S = 0.008   # a verification costs 6.25 plain steps, more than the K + 1 tokens it can give


def reply(accepted_per_step, plain_step_s, settings=SETTINGS, source="session", change_at=None):
    """A speculative reply's step events as the worker emits them: the prefill step, then one
    verification of K draft tokens per entry (that many accepted), each with the engine's
    speculation_report of the reply so far. change_at: the step that carries `settings`
    (a change mid-reply) instead of the first."""
    fake = FakeRequest()
    events = [fake.step(0, None if change_at else settings)]
    for step, accepted in enumerate(accepted_per_step, start=1):
        event = fake.step(step, settings if step == change_at else None, proposed=K, accepted=accepted)
        event["speculation"] = speculation_report(event["running"], K, plain_step_s, source)
        events.append(event)
    return fake, events


def recorded(history, events):
    for event in events:
        history.record_step(event)
    return history


# ---- the engine's one combining function ------------------------------------------------
def test_replies_combine_as_the_engine_combines_requests():
    first, _ = reply([4, 4, 0], SLOW_PLAIN_STEP_S)
    second, _ = reply([1, 2], SLOW_PLAIN_STEP_S)
    positions = PositionCounts()
    for fake in (first, second):
        positions.merge(fake.stats.positions)
    together = combine_running([first.stats.as_dict(), second.stats.as_dict()], positions)
    assert together == combined([first.stats, second.stats]).as_dict()
    assert together["decode_tokens"] == 16 and together["alpha"] == pytest.approx(11 / 14)
    # per-position counts are not in the dicts: without them alpha is missing, not guessed
    alone = combine_running([first.stats.as_dict(), second.stats.as_dict()])
    assert alone["alpha"] is None and alone["decode_tok_s"] == together["decode_tok_s"]


# ---- the session's figure --------------------------------------------------------------
def test_the_session_figure_covers_every_speculative_reply_of_the_set_up():
    first, first_events = reply([4, 4, 0], SLOW_PLAIN_STEP_S)
    second, second_events = reply([1, 2], SLOW_PLAIN_STEP_S)
    history = recorded(MetricsHistory(), first_events + second_events[:2])
    assert history.speculation.report["replies"] == 2                  # the reply in progress counts too
    recorded(history, second_events[2:])
    report = history.speculation.report
    expected = speculation_report(combined([first.stats, second.stats]).as_dict(), K, SLOW_PLAIN_STEP_S, "session")
    assert report == expected | {"replies": 2}
    # 16 tokens in 5 decode steps of 0.05 s, against plain steps of 0.04 s
    assert report["measured_speedup"] == pytest.approx(16 / 0.25 * SLOW_PLAIN_STEP_S)


def test_a_new_set_up_starts_a_new_figure_and_a_reply_that_changed_it_is_left_out():
    _, first = reply([4, 4], SLOW_PLAIN_STEP_S)
    k2 = SETTINGS | {"num_speculative_tokens": 2}
    _, changed_mid_reply = reply([4, 4, 4], SLOW_PLAIN_STEP_S, settings=k2, change_at=2)
    history = recorded(MetricsHistory(), first + changed_mid_reply)
    assert history.speculation.report is None            # its counters mix k=4 and k=2
    third, later = reply([1, 1], FAST_PLAIN_STEP_S, settings=k2)
    recorded(history, later)
    assert history.speculation.report == speculation_report(third.stats.as_dict(), K, FAST_PLAIN_STEP_S,
                                                            "session") | {"replies": 1}
    _, plain = reply([], SLOW_PLAIN_STEP_S, settings=SETTINGS | {"proposer": "off"})
    recorded(history, plain)
    assert history.speculation.report is None            # speculation off: nothing to say


def test_each_steps_speedup_is_exported_with_its_break_even_alpha(tmp_path):
    _, losing = reply([0, 0], FASTEST_PLAIN_STEP_S)
    history = recorded(MetricsHistory(), losing)
    history.write_csv(tmp_path / "steps.csv")
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["speedup_measured"] for row in rows[:1]] == [""]          # the prefill step: no report
    last = losing[-1]["speculation"]
    assert float(rows[-1]["speedup_measured"]) == pytest.approx(last["measured_speedup"], rel=1e-5)
    assert float(rows[-1]["speedup_predicted"]) == pytest.approx(last["predicted_speedup"], rel=1e-5)
    assert last["break_even_alpha"] is None and rows[-1]["break_even_alpha"] == "inf"   # no alpha pays


# ---- what the window says ----------------------------------------------------------------
REPORT = {"measured_speedup": 0.6, "predicted_speedup": 0.7, "alpha": 0.22, "k": 4, "draft_cost": 0.05,
          "verify_cost": 1.2, "break_even_alpha": 0.45, "plain_tok_s": 50.0, "plain_source": "session"}
SUMMARY = {"ttft_s": 0.1, "decode_tok_s": 10.0, "generated_tokens": 5, "acceptance_rate": 0.5, "accepted": 2,
           "proposed": 4, "mean_accepted_len": 2.0, "prefix_hit_tokens": 0, "prompt_tokens": 3}


def test_a_reply_line_shows_the_speedup_measured_and_predicted():
    line = message_stats(SUMMARY, "stop", None, REPORT | {"measured_speedup": 1.32, "predicted_speedup": 1.41})
    assert "speedup 1.32x measured · 1.41x predicted" in line and "calibration" not in line
    assert "(plain speed from a calibration)" in message_stats(SUMMARY, "stop", None,
                                                               REPORT | {"plain_source": "calibration"})
    assert "speedup" not in message_stats(SUMMARY, "stop")                 # it did not speculate


def test_the_verdict_says_why_speculation_loses_or_that_it_pays():
    assert speculation_verdict(REPORT | {"replies": 3}) == (
        "speculation is losing here: 0.60x measured, 0.70x predicted",
        "α 0.22 is below break-even 0.45 at k=4; over 3 replies", False)
    headline, why, pays = speculation_verdict(REPORT | {"break_even_alpha": None, "verify_cost": 1.57})
    assert not pays and why == "it cannot pay at k=4 with these costs (draft 0.05, verify 1.57 of a plain step)"
    assert speculation_verdict(REPORT | {"measured_speedup": 1.3, "predicted_speedup": 1.4}) == (
        "speculation pays here: 1.30x measured, 1.40x predicted", "", True)
    assert speculation_verdict(None) is None


def test_the_acceptance_plot_says_whether_speculation_pays_without_a_legend_over_the_data(qtbot):
    from app.plots_panel import PlotsPanel
    history = MetricsHistory()
    plots = PlotsPanel(history)
    qtbot.addWidget(plots)
    plots.refresh()
    assert "speculation" not in plots.acceptance_title.text                # nothing measured yet
    recorded(history, reply([0, 1, 0], FAST_PLAIN_STEP_S)[1])
    plots.refresh()
    assert "speculation is losing here" in plots.acceptance_title.text
    recorded(history, reply([4, 4, 4], SLOW_PLAIN_STEP_S, settings=SETTINGS | {"num_speculative_tokens": 3})[1])
    plots.refresh()
    assert "speculation pays here" in plots.acceptance_title.text and "losing" not in plots.acceptance_title.text
    # the legends sit in the title row, none inside the plots where they could cover data
    for plot in (plots.acceptance_plot, plots.decode_plot):
        assert plot.legend is None and "running (this reply)" in plot.titleLabel.text.replace("&nbsp;", " ")
    top = plots.acceptance_plot.viewRange()[1][1]
    assert top >= 100


# ---- a server's per-position counters -------------------------------------------------------
def test_per_position_acceptance_comes_from_a_servers_counters_when_its_steps_have_none(qtbot):
    from app.plots_panel import PlotsPanel
    history = MetricsHistory()
    plots = PlotsPanel(history)
    qtbot.addWidget(plots)
    fake = FakeRequest()
    history.record_step(fake.step(0, SETTINGS))
    last = fake.step(1)
    last["server"] = {"drafts": 10, "accepted_per_position": [8, 6, 3, 1]}     # engine.remote.server_metrics figures
    history.record_step(last)
    assert history.per_position_source == SERVER
    assert list(history.per_position_acceptance()) == pytest.approx([0.8, 6 / 8, 3 / 6, 1 / 3])
    plots.refresh()
    assert list(plots.positions_bars.opts["height"]) == pytest.approx([80, 75, 50, 100 / 3])
    assert "the server's counters" in plots.positions_plot.titleLabel.text
    history.record_step(FakeRequest().step(0, SETTINGS | {"proposer": "ngram"}))
    plots.refresh()
    assert history.per_position_source is None and len(plots.positions_bars.opts["height"]) == 0
    assert "server" not in plots.positions_plot.titleLabel.text


def test_the_steps_own_positions_come_before_a_servers_counters():
    history = recorded(MetricsHistory(), reply([4, 1], SLOW_PLAIN_STEP_S)[1])
    last = FakeRequest().step(0)
    last["server"] = {"drafts": 10, "accepted_per_position": [1, 1, 1, 1]}
    history.record_step(last)
    assert history.per_position_source == STEPS
    assert list(history.per_position_acceptance()) == [1.0, 0.5, 1.0, 1.0]


# ---- in the app, with the real engine --------------------------------------------------------
def test_a_speculative_reply_shows_its_speedup_and_the_plot_says_whether_it_pays(tiny_bench, qtbot):
    bench = tiny_bench
    set_options(bench, qtbot, proposer="draft", draft_model="self", max_tokens=10)
    done = send(bench, qtbot, "Name three colours.")
    line = bench.window.chat.transcript.toPlainText().splitlines()[-1]
    assert "measured ·" in line and "x predicted" in line and "(plain speed from a calibration)" in line
    report = bench.history.speculation.report
    assert report["replies"] == 1 and report["alpha"] == 1.0            # the target drafting for itself
    assert math.isclose(report["measured_speedup"], done["summary"]["decode_tok_s"] / report["plain_tok_s"])
    plots = bench.window.plots
    qtbot.waitUntil(lambda: "speculation" in plots.acceptance_title.text, timeout=REPLY_TIMEOUT_MS)
    assert ("speculation pays here" in plots.acceptance_title.text) == (report["measured_speedup"] >= 1.0)
    set_options(bench, qtbot, proposer="off")
    send(bench, qtbot, "And three animals?")
    assert "speedup" not in bench.window.chat.transcript.toPlainText().splitlines()[-1]
    qtbot.waitUntil(lambda: "speculation" not in plots.acceptance_title.text, timeout=REPLY_TIMEOUT_MS)


def test_the_prediction_is_the_measurements_model_steps_that_drafted_nothing_count_as_plain():
    """Predicted speedup = tokens a step emits under the measured per-position acceptance, each
    step by the drafts it really verified (none where it drafted nothing), over the measured
    seconds a decoding step took (its pass, its drafting and the rest of its work): 10 steps drafted nothing and 10 drafted 4 with per-position
    rates 1/2, 1/2, 0 -> (10 x 1 + 10 x (1 + 1/2 + 1/4)) / 20 tokens a step; the i.i.d. model,
    which has every step draft k, predicts more."""
    from engine.metrics import expected_chain_accepted, expected_tokens_per_step, predicted_speedup
    assert expected_chain_accepted([0.5, 0.5, 0.0], 4) == pytest.approx(0.75)
    assert expected_tokens_per_step({0: 10, 4: 10}, [0.5, 0.5, 0.0]) == pytest.approx(1.375)
    assert expected_tokens_per_step({2: 3}, [1.0, 1.0], tree_steps=1, tree_accepted=5) == pytest.approx((3 * 3 + 6) / 4)
    stats = RequestStats(decode_tokens=27, decode_time_s=0.4, target_passes=20, proposed=40, accepted=7,
                         draft_time_s=0.02, target_time_s=0.36, draft_lengths={0: 10, 4: 10},
                         positions=PositionCounts(attempts=[10, 5, 2], accepts=[5, 2, 0]))
    report = speculation_report(stats.as_dict(), K, 0.015, "session")
    per_step = 0.4 / 20 / 0.015
    assert report["prediction_model"] == "per step"
    assert report["predicted_speedup"] == pytest.approx(expected_tokens_per_step({0: 10, 4: 10}, [0.5, 0.4, 0.0]) / per_step)
    assert report["predicted_speedup"] < 0.9 * predicted_speedup(stats.positions.alpha(), K, report["draft_cost"],
                                                                 report["verify_cost"])
    # the lengths add up across replies (a session's figures)
    assert combined([stats, stats]).draft_lengths == {0: 20, 4: 20}
    assert combine_running([stats.as_dict(), stats.as_dict()], stats.positions)["draft_lengths"] == {0: 20, 4: 20}


def test_speculation_that_loses_switches_itself_off_within_64_steps_and_the_app_says_why(make_tiny_engine, monkeypatch):
    """A proposer the user turned on, on a machine where a wider pass costs far more than its
    drafts can earn (each extra row 40 ms against a 1 ms plain step): the policy measures it,
    drafts nothing from then on, within 64 steps, and the settings the app shows say
    speculation is off by itself and why, in numbers; greedy output stays the target's."""
    from app.formatting import describe_settings
    from engine import SamplingParams
    from engine.speculative.policy import SpeculationPolicy
    record_pass = SpeculationPolicy.record_pass
    monkeypatch.setattr(SpeculationPolicy, "record_pass",
                        lambda self, rows, seconds: record_pass(self, rows, 0.001 + 0.040 * (rows - 1)))
    base = make_tiny_engine()
    params = SamplingParams(max_tokens=64, stop_on_eos=False)
    first = base.encode(chat("Count to five."))
    prompt = first + base.generate_text(first, params)[1] + first         # repeats itself: n-gram matches
    expected = base.generate_text(prompt, params)[1]
    eng = make_tiny_engine(speculation_policy="auto")        # the default (the tiny engines' is fixed)
    eng.reconfigure(proposer="ngram", num_speculative_tokens=4)
    events = list(eng.generate(prompt, params))
    assert [t for e in events for t in e.token_ids] == expected
    drafted = [i for i, e in enumerate(events) if e.proposed]
    assert drafted and drafted[-1] < 64                              # it tried, then stopped by itself
    paused = eng.settings()["speculation_paused"]
    assert paused.startswith("ngram's drafts lose here: at α") and "x a plain step" in paused
    assert f"off by itself: {paused}" in describe_settings(eng.settings()).replace("&#x27;", "'")
    eng.reconfigure(proposer="off")
    assert eng.settings()["speculation_paused"] is None


def test_before_speculation_is_on_the_panel_predicts_what_each_retrieval_proposer_would_pay(make_engine, monkeypatch):
    """Speculation off: the n-gram and suffix proposers follow each reply and are asked, every
    few steps, what they would draft; held against the tokens the target then produced, those
    drafts give each one's tokens a step, and with the measured pass times its predicted
    speedup (the formula proposer auto weighs candidates by), which the side panel shows."""
    from app.formatting import describe_settings
    from engine import SamplingParams
    from engine.metrics import decode_step_rate
    from engine.speculative.policy import SpeculationPolicy
    record_pass = SpeculationPolicy.record_pass
    monkeypatch.setattr(SpeculationPolicy, "record_pass",          # wider passes cost little here
                        lambda self, rows, seconds: record_pass(self, rows, 0.010 + 0.001 * (rows - 1)))
    from engine.workload import REPEAT_PROMPTS
    eng = make_engine(compile="off")
    assert eng.config.proposer == "off"
    eng.generate_text(eng.encode(chat(REPEAT_PROMPTS[0])), SamplingParams(max_tokens=48, stop_on_eos=False))
    forecast = eng.settings()["proposer_forecast"]
    assert set(forecast) == {"ngram", "suffix"}
    ngram = forecast["ngram"]
    assert ngram["steps"] >= 4 and ngram["tokens_per_step"] > 1.5
    counts = eng.speculator.proposer_choice.counts("ngram")
    pass_s = eng.speculator.policy.predicted_pass_s
    expected = decode_step_rate(1, counts.tokens_per_step, pass_s(round(1 + counts.verified_per_step)),
                                counts.draft_s_per_step) * pass_s(1)
    assert ngram["speedup"] == pytest.approx(expected) and ngram["speedup"] > 1.2
    shown = describe_settings(eng.settings())
    assert "predicted if on, from this chat's replies:" in shown and f"ngram {ngram['speedup']:.2f}x" in shown
    eng.reconfigure(proposer="ngram")
    assert eng.settings()["proposer_forecast"] is None
