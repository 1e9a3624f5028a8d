"""The serving bench's workload and command line (engine.bench.serve): arrivals as vLLM's
bench serve makes them, --compare parsed or refused with a clear message."""
import random
import statistics

import pytest

from engine.bench.serve import arrival_times, parse_compare
from engine.errors import ConfigError
from engine.metrics import RequestStats, percentile, serving_summary


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
