"""The serving bench's workload and command line (engine.bench.serve): arrivals as vLLM's
bench serve makes them, --compare parsed or refused with a clear message, and --compare
profile=A,B: two profiles' engine settings as the arms, each arm's settings in the output."""
import json
import random
import statistics

import pytest

from engine.bench.cli import main
from engine.bench.serve import arrival_times, parse_compare
from engine.errors import ConfigError
from engine.metrics import RequestStats, percentile, serving_summary
from engine.profiles import SessionProfile, builtin_profiles

# 2 requests of 4 tokens at once on the tiny model, in an 8 MiB pool the command line holds
TINY_WORKLOAD = ["--num-prompts", "2", "--max-concurrency", "2", "--output-len", "4", "--shared-prefix-len", "32",
                 "--kv-cache-bytes", str(8 * 2**20), "--json"]


def test_arrivals_all_at_once_or_a_gamma_process_of_the_rate():
    assert arrival_times(4, float("inf"), 1.0, random.Random(0)) == [0.0] * 4
    times = arrival_times(4000, 8.0, 1.0, random.Random(0))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8, rel=0.08)          # Poisson: std = mean
    steady = arrival_times(4000, 8.0, 4.0, random.Random(0))
    assert statistics.pstdev([b - a for a, b in zip(steady, steady[1:])]) < 0.6 / 8


def test_compare_takes_a_setting_and_two_values():
    assert parse_compare("kv_cache_dtype=auto,fp8_e4m3") == ("kv_cache_dtype", ["auto", "fp8_e4m3"])
    assert parse_compare("enable_prefix_caching=false,true") == ("enable_prefix_caching", [False, True])
    assert parse_compare("num_speculative_tokens=2,4") == ("num_speculative_tokens", [2, 4])
    with pytest.raises(ConfigError, match="KEY=A,B"):
        parse_compare("no_such_setting=1,2")
    with pytest.raises(ConfigError, match="must be one of"):
        parse_compare("kv_cache_dtype=auto,fp4")
    with pytest.raises(ConfigError, match="true or false"):
        parse_compare("enable_prefix_caching=yes,no")
    with pytest.raises(ConfigError, match="the two arms are the same"):
        parse_compare("enable_prefix_caching=true,on")


@pytest.fixture
def profile_file(tmp_path, monkeypatch):
    """write(name, **settings): a profile file as the app saves it; the user's own profiles
    folder is an empty temp dir."""
    monkeypatch.setenv("WORKBENCH_CONFIG_DIR", str(tmp_path / "config"))

    def write(name: str, **settings):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(SessionProfile(name=name, **settings).to_json_dict()), encoding="utf-8")
        return path
    return write


def test_compare_profile_takes_built_in_names_and_profile_files(profile_file):
    key, (a, b) = parse_compare("profile=baseline,all_optimizations")
    assert key == "profile" and (str(a), str(b)) == ("baseline", "all_optimizations")
    assert a.path == builtin_profiles()["baseline"]
    assert (a.profile.proposer, a.profile.kv_cache_dtype, a.profile.enable_prefix_caching) == ("off", "auto", False)
    assert (b.profile.proposer, b.profile.kv_cache_dtype, b.profile.enable_prefix_caching) == \
        ("auto", "fp8_when_short", True)

    mine = profile_file("mine", kv_cache_dtype="fp8_e4m3", num_speculative_tokens=2)
    _, (a, b) = parse_compare(f"profile=baseline,{mine}")
    assert (str(b), b.path, b.profile.name) == (str(mine), mine, "mine")
    assert b.profile.engine_settings()["kv_cache_dtype"] == "fp8_e4m3"


def test_compare_profile_refuses_what_it_cannot_read_naming_the_fix(profile_file, tmp_path):
    with pytest.raises(ConfigError, match=r"no profile named 'nosuch'.*\(all_optimizations, baseline\)"):
        parse_compare("profile=baseline,nosuch")
    with pytest.raises(ConfigError, match="cannot read profile .*missing.json"):
        parse_compare(f"profile=baseline,{tmp_path / 'missing.json'}")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "inference-workbench-profile", "version": 3,', encoding="utf-8")
    with pytest.raises(ConfigError, match="corrupt.json is not valid JSON"):
        parse_compare(f"profile={corrupt},baseline")
    bad = profile_file("bad")
    bad.write_text(bad.read_text().replace('"kv_cache_dtype": "auto"', '"kv_cache_dtype": "fp4"'))
    with pytest.raises(ConfigError, match="bad.json: kv_cache_dtype must be one of"):
        parse_compare(f"profile=baseline,{bad}")
    with pytest.raises(ConfigError, match="KEY=A,B"):
        parse_compare("profile=baseline")
    with pytest.raises(ConfigError, match="the two arms are the same"):
        parse_compare("profile=baseline,baseline")


def bench(capsys, *argv) -> tuple[int, dict | None, str]:
    code = main(["serve", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), out + err


def test_compare_profile_runs_each_arm_with_its_profiles_engine_settings(profile_file, make_tiny_engine,
                                                                        capsys, monkeypatch):
    monkeypatch.setattr("engine.bench.scenarios._engine", lambda args, **config: make_tiny_engine(**config))
    # a draft proposer with no draft model, and sampling the greedy workload does not do
    mine = profile_file("mine", kv_cache_dtype="fp8_e4m3", enable_prefix_caching=True, proposer="draft",
                        num_speculative_tokens=2, temperature=0.7)
    code, out, printed = bench(capsys, "--compare", f"profile=baseline,{mine}", *TINY_WORKLOAD)
    assert code == 0, printed
    base, ours = out["arms"]["baseline"], out["arms"][str(mine)]
    assert out["compare"] == f"profile=baseline,{mine}"
    # what each arm ran with, read back from the engine
    assert base["profile"]["config"]["kv_cache_dtype"] == "auto"          # in effect: the model's dtype
    assert (base["settings"]["kv_cache_dtype"], base["settings"]["enable_prefix_caching"]) == (out["dtype"], False)
    assert (ours["settings"]["kv_cache_dtype"], ours["settings"]["enable_prefix_caching"]) == ("fp8_e4m3", True)
    assert (base["profile"]["name"], base["profile"]["source"]) == ("baseline", str(builtin_profiles()["baseline"]))
    assert (ours["profile"]["name"], ours["profile"]["source"]) == ("mine", str(mine))
    assert ours["profile"]["config"]["num_speculative_tokens"] == 2 and base["profile"]["config"]["proposer"] == "off"
    # the pool the command line fixed held for both; what the run did not do is named, with why
    assert base["profile"]["config"]["kv_cache_bytes"] == ours["profile"]["config"]["kv_cache_bytes"] == 8 * 2**20
    assert "--kv-cache-bytes 8388608 holds for both arms" in ours["profile"]["not_applied"]["kv_cache_bytes"]
    assert ours["settings"]["proposer"] == "off" and "no draft model" in ours["profile"]["not_applied"]["proposer"]
    assert "0.7" in ours["profile"]["not_applied"]["temperature"]
    assert "temperature" not in base["profile"]["not_applied"]
    # B over A, as for any other key
    for field in ("output_throughput", "median_ttft_ms"):
        assert out["ratio"][field] == pytest.approx(ours[field] / base[field])
    assert ours["completed"] == base["completed"] == 2


def test_compare_profile_a_draft_model_that_is_not_there_fails_before_measuring(profile_file, make_tiny_engine,
                                                                               capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("engine.bench.scenarios._engine", lambda args, **config: make_tiny_engine(**config))
    missing = tmp_path / "no-such-draft"
    drafted = profile_file("drafted", proposer="draft", draft_model=str(missing))
    code, _, printed = bench(capsys, "--compare", f"profile=baseline,{drafted}", *TINY_WORKLOAD)
    assert code == 2
    assert f"--compare arm '{drafted}': the engine refused its settings" in printed and str(missing) in printed
    assert "output_throughput" not in printed


def test_serving_summary_uses_vllm_names_and_formulas():
    a = RequestStats(prompt_tokens=10, generated_tokens=5, ttft_s=0.1, decode_time_s=0.4, e2e_s=0.5,
                     itl_s=[0.1, 0.1, 0.1, 0.1])
    b = RequestStats(prompt_tokens=20, generated_tokens=3, ttft_s=0.3, decode_time_s=0.2, e2e_s=0.5,
                     itl_s=[0.1, 0.1], preemptions=1)
    s = serving_summary([a, b], duration_s=2.0)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.0, 4.0, 19.0)
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_e2el_ms"] == pytest.approx(500)
    assert s["mean_tpot_ms"] == pytest.approx(100) and s["p99_itl_ms"] == pytest.approx(100)
    assert s["preemptions"] == 1
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 99) is None
