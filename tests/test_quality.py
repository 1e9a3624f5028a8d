"""engine.quality: what a configuration costs in quality against the loaded model's most exact
one (the app's Quality tab and `bench quality --compare` share it)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from engine.quality import figures, text
from engine.errors import WorkbenchError
from engine.profiles import ProfileError, ProfileStore, SessionProfile, read_profile
from engine.quality import Configuration, QualityRun, QualityTextError, pareto_front
from engine.quality.figures import compare

TOKENS = 96          # scored tokens: enough to tell FP8 from exact, short enough for CI
CHECK = dict(check_prompts=2, check_tokens=6)


def _run(eng, configurations, **kw):
    run = QualityRun(eng, configurations, tokens=TOKENS, **CHECK, **kw)
    progress = list(run.steps())
    fractions = [p.fraction for p in progress]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    return run.results, progress


def test_the_reference_measured_against_itself_costs_nothing_and_fp8_costs_something(make_engine):
    eng = make_engine(compile="off")
    before = dict(vars(eng.config))
    rows, progress = _run(eng, [Configuration("current"), Configuration("fp8", {"kv_cache_dtype": "fp8_e4m3"})])
    same, fp8 = rows
    assert [p.result["label"] for p in progress if p.result] == ["current", "fp8"]
    # the loaded weights are dequantized and the cache is fp32: the reference itself
    assert same["in_effect"] == same["reference"] == {"dtype": "float32", "weight_dtype": "float",
                                                      "kv_cache_dtype": "float32"}
    assert same["lossy"] is False and same["tokens_scored"] == TOKENS
    assert same["kld_mean"] < 2e-4            # the reference is kept in 16 bits a log-prob, as llama.cpp keeps it
    assert same["same_top_pct"] == 100.0
    assert same["ppl_change_pct"] == pytest.approx(0.0, abs=1e-9)
    assert same["ppl"] == pytest.approx(same["ppl_reference"])
    assert fp8["in_effect"]["kv_cache_dtype"] == "fp8_e4m3" and fp8["lossy"] is True
    assert fp8["kld_mean"] > 10 * same["kld_mean"]
    lo, hi = fp8["kld_mean_ci95"]
    assert lo <= fp8["kld_mean"] <= hi and fp8["kld_p99"] >= fp8["kld_median"]
    for row in rows:       # lossless settings in effect: prefix caching, batching; token for token
        assert row["lossless"]["identical"] is True, row["lossless"]
        assert any("prefix caching" in c for c in row["lossless"]["checked"])
        assert row["decode_tok_s"] > 0
        json.dumps(row)                       # a profile and the CSV carry it as data
    assert dict(vars(eng.config)) == before    # the engine ends with the settings it had


def test_speculation_is_checked_token_for_token_and_stopping_mid_run_restores_the_settings(make_engine):
    eng = make_engine(compile="off", enable_prefix_caching=False)
    (row,), _ = _run(eng, [Configuration("ngram", {"proposer": "ngram", "num_speculative_tokens": 3})])
    assert row["lossless"]["identical"] is True
    assert any("speculation (ngram)" in c for c in row["lossless"]["checked"])
    assert row["kld_mean"] < 2e-4             # speculation changes no distribution
    run = QualityRun(eng, [Configuration("fp8", {"kv_cache_dtype": "fp8_e4m3", "proposer": "suffix"})],
                     tokens=TOKENS, **CHECK)
    steps = run.steps()
    for _ in range(4):                        # into the configuration's own pieces (the reference is kept)
        next(steps)
    assert eng.config.kv_cache_dtype == "fp8_e4m3"
    run.close()
    assert (eng.config.kv_cache_dtype, eng.config.proposer) == ("auto", "off")
    assert run.results == []
    text, ids, _ = eng.generate_text("Hello", _greedy(4))    # still serving
    assert len(ids) == 4


def test_weights_the_loaded_model_does_not_have_are_measured_on_an_engine_of_their_own(make_engine):
    eng = make_engine(compile="off")
    (row,), _ = _run(eng, [Configuration("int4", {"weight_dtype": "int4"})])
    assert row["in_effect"]["weight_dtype"] != "float" and "int4" in row["in_effect"]["weight_dtype"]
    assert row["lossy"] is True and row["kld_mean"] > 1e-3
    assert row["lossless"]["identical"] is True
    assert eng.config.weight_dtype == "auto" and not eng.target_model.weights.quantized   # the loaded one untouched


def test_bad_configurations_and_a_missing_or_changed_text_get_clear_messages(make_engine, monkeypatch, tmp_path):
    eng = make_engine(compile="off")
    with pytest.raises(WorkbenchError, match="device is set when a model loads"):
        QualityRun(eng, [Configuration("x", {"device": "cpu"})])
    with pytest.raises(WorkbenchError, match="'temperature' is not an engine setting"):
        QualityRun(eng, [Configuration("x", {"temperature": 0.5})])
    with pytest.raises(WorkbenchError, match="kv_cache_dtype must be one of"):
        QualityRun(eng, [Configuration("x", {"kv_cache_dtype": "fp4"})])
    missing = tmp_path / "gone.txt"
    monkeypatch.setattr(text, "QUALITY_TEXT_FILE", missing)
    with pytest.raises(QualityTextError, match="cannot be read.*reinstall"):
        list(QualityRun(eng, [Configuration("current")], tokens=TOKENS).steps())
    changed = tmp_path / "reference_text.txt"
    changed.write_text(text.reference_text(text.QUALITY_TEXT) + "x")
    with pytest.raises(QualityTextError, match="not the one shipped"):
        text.reference_text(changed, check_digest=True)
    changed.write_bytes(b"\xff\xfe broken")
    with pytest.raises(QualityTextError, match="not UTF-8"):
        text.reference_text(changed)
    assert eng.config.kv_cache_dtype == "auto"


def test_every_lossy_setting_names_an_exact_value_it_can_take():
    from engine.config import LOADED, SETTINGS
    lossy = {s.key: s.exact for s in SETTINGS if s.lossy}
    assert lossy == {"kv_cache_dtype": "auto", "dtype": LOADED, "weight_dtype": "float"}
    assert all(s.exact == LOADED or s.exact in s.choices for s in SETTINGS if s.lossy)


def test_the_figures_follow_llama_perplexitys_formulas():
    ref = np.array([1.0, 2.0, 3.0, 2.0])
    nll = ref + np.array([0.1, 0.0, 0.2, 0.1])
    kld = np.array([0.01, 0.02, 0.03, 0.02])
    same = np.array([True, True, False, True])
    f = compare(ref, nll, kld, same)
    d = nll - ref
    se = np.std(d, ddof=1) / 2
    assert f["ppl_change_pct"] == pytest.approx(100 * (math.exp(d.mean()) - 1))
    assert f["ppl_change_pct_ci95"] == pytest.approx([100 * (math.exp(d.mean() - figures.Z95 * se) - 1),
                                                      100 * (math.exp(d.mean() + figures.Z95 * se) - 1)])
    assert f["ppl"] == pytest.approx(math.exp(nll.mean())) and f["ppl_reference"] == pytest.approx(math.exp(2.0))
    assert f["kld_mean"] == pytest.approx(0.02) and f["kld_max"] == pytest.approx(0.03)
    assert f["same_top_pct"] == pytest.approx(75.0)
    assert f["same_top_pct_ci95"][0] == pytest.approx(100 * (0.75 - figures.Z95 * math.sqrt(0.75 * 0.25 / 3)))


def test_the_pareto_front_keeps_what_nothing_beats_on_both_axes():
    rows = [{"label": "a", "kld_mean": 0.0, "decode_tok_s": 10.0},
            {"label": "b", "kld_mean": 0.01, "decode_tok_s": 12.0},
            {"label": "c", "kld_mean": 0.02, "decode_tok_s": 11.0},     # b is better on both
            {"label": "d", "kld_mean": 0.05, "decode_tok_s": 20.0},
            {"label": "e", "kld_mean": 0.0, "decode_tok_s": 9.0},       # a is as exact and faster
            {"label": "f", "kld_mean": None, "decode_tok_s": 30.0}]     # not measured
    assert [rows[i]["label"] for i in pareto_front(rows)] == ["a", "b", "d"]


def test_a_profile_carries_its_measured_quality(tmp_path):
    store = ProfileStore(tmp_path)
    measured = {"label": "current", "kld_mean": 0.01, "model": "SmolLM2-135M-Instruct (embedded)",
                "measured_at": "2026-12-07T15:00:00+00:00", "ppl_change_pct": 0.8}
    path = store.save(SessionProfile(name="fp8", kv_cache_dtype="fp8_e4m3", quality=measured))
    data = json.loads(path.read_text())
    assert data["version"] == 4 and data["quality"] == measured
    assert read_profile(path).quality == measured
    old = {k: v for k, v in data.items() if k != "quality"} | {"version": 3}
    path.write_text(json.dumps(old))
    assert read_profile(path).quality is None
    path.write_text(json.dumps(data | {"quality": [1, 2]}))
    with pytest.raises(ProfileError, match="quality must be a measurement"):
        read_profile(path)


def _greedy(n):
    from engine import SamplingParams
    return SamplingParams(max_tokens=n, stop_on_eos=False)
