"""The serving workload (engine.workload) and the results table's statistics (engine.metrics:
run_figures, bootstrap_ci, bootstrap_difference): seeded, covering, and consistent with the
serving summary's formulas."""
import random
import statistics

import pytest

from engine.errors import ConfigError
from engine.metrics import (RequestStats, bootstrap_ci, bootstrap_difference, excludes_zero, run_figures,
                            run_statistic, serving_summary)
from engine.workload import Workload, WorkloadRun, make_jobs


def mean_of(sample):
    return {"mean": statistics.fmean(sample)}


def requests(n, ttft_ms=(10, 100), seed=0, tokens=8):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ttft, decode = rng.uniform(*ttft_ms) / 1000, rng.uniform(0.05, 0.2)
        out.append(RequestStats(prompt_tokens=20, generated_tokens=tokens, ttft_s=ttft, decode_time_s=decode,
                                e2e_s=ttft + decode, preemptions=rng.random() < 0.2))
    return out


def test_bootstrap_is_seeded_and_its_interval_holds_the_estimate():
    rng = random.Random(1)
    data = [rng.gauss(5, 2) for _ in range(40)]
    a = bootstrap_ci(data, mean_of, seed=3)["mean"]
    assert a == bootstrap_ci(data, mean_of, seed=3)["mean"]
    assert a != bootstrap_ci(data, mean_of, seed=4)["mean"]
    assert a[0] < statistics.fmean(data) < a[1]


def test_a_95_percent_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = random.Random(0)
    covered = 0
    for trial in range(200):
        sample = [rng.gauss(10, 3) for _ in range(30)]
        lo, hi = bootstrap_ci(sample, mean_of, resamples=400, seed=trial)["mean"]
        covered += lo <= 10 <= hi
    assert 0.88 <= covered / 200 <= 0.99


def test_four_times_the_requests_halve_the_interval():
    rng = random.Random(2)
    small, large = [rng.gauss(0, 1) for _ in range(50)], [rng.gauss(0, 1) for _ in range(200)]
    width = lambda d: (lambda lo, hi: hi - lo)(*bootstrap_ci(d, mean_of, seed=0)["mean"])
    assert 0.35 < width(large) / width(small) < 0.7


def test_run_figures_agree_with_the_serving_summary():
    stats = requests(24)
    figures, summary = run_figures(stats, 1.7), serving_summary(stats, 1.7)
    assert figures["output_throughput"] == pytest.approx(summary["output_throughput"])
    for name in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "preemptions"):
        assert figures[name] == pytest.approx(summary[name])


def test_every_run_figure_gets_an_interval_around_it_and_equal_tokens_still_vary_the_throughput():
    stats = requests(32)
    intervals = bootstrap_ci(stats, run_statistic(stats, 2.0))
    point = run_figures(stats, 2.0)
    for name, (lo, hi) in intervals.items():
        assert lo <= point[name] <= hi, name
    lo, hi = intervals["output_throughput"]
    assert hi - lo > 0.02 * point["output_throughput"]      # every request has 8 tokens; their times differ


def test_the_difference_of_two_runs_excludes_zero_only_when_they_differ():
    a, b, c = requests(40, seed=1), requests(40, ttft_ms=(200, 300), seed=2), requests(40, seed=3)
    stat = lambda s: run_statistic(s, 2.0)
    slower = bootstrap_difference(a, stat(a), b, stat(b))
    assert slower["median_ttft_ms"][0] > 100 and excludes_zero(slower["median_ttft_ms"])
    same = bootstrap_difference(a, stat(a), c, stat(c))
    assert not excludes_zero(same["median_ttft_ms"]) and same["median_ttft_ms"][0] < 0 < same["median_ttft_ms"][1]
    assert excludes_zero(None) is None


def test_a_bad_workload_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"num_prompts \(Requests\) must be in 1..100000"):
        Workload(num_prompts=0)
    with pytest.raises(ConfigError, match="request_rate must be float"):
        Workload(request_rate="fast")
    assert Workload().arrival_rate == float("inf") and Workload(request_rate=4).arrival_rate == 4.0


def test_a_run_serves_every_job_at_its_concurrency_and_cancel_frees_every_block(make_tiny_engine):
    eng = make_tiny_engine()
    workload = Workload(num_prompts=12, max_concurrency=3, output_len=6, shared_prefix_len=40)
    jobs = make_jobs(eng, workload)
    assert [j.prompt for j in jobs] == [j.prompt for j in make_jobs(eng, workload)]       # the same requests
    assert all(j.prompt[:30] == jobs[0].prompt[:30] for j in jobs)                        # the shared prefix
    run = WorkloadRun(eng, jobs, workload.max_concurrency)
    while not run.done:
        run.step()
        assert len(run.outstanding) <= 3
    summary = run.summary()
    assert summary["completed"] == 12 and summary["total_output_tokens"] == 72 and summary["max_concurrent"] == 3
    assert eng.runner.blocks.num_used_blocks == 0
    run = WorkloadRun(eng, make_jobs(eng, workload), workload.max_concurrency)
    for _ in range(4):
        run.step()
    assert run.outstanding
    run.cancel()
    while not run.done:
        run.step()
    assert run.cancelled == 3 and len(run.finished) < 12 and not eng.has_work
    assert eng.runner.blocks.num_used_blocks == 0


def _step(batch, step_s, drafted=0, accepted=0, prefill=0):
    return {"batch_size": batch, "prefill_tokens": prefill, "drafted": drafted, "accepted": accepted, "step_s": step_s}


def test_speculation_speedup_by_batch_size_compares_like_batches_of_decode_steps():
    from engine.metrics import speculation_speedup_by_batch
    steps = [_step(1, 0.020), _step(1, 0.022), _step(1, 0.030, drafted=4, accepted=2),     # 3 tokens / 30 ms
             _step(4, 0.040), _step(4, 0.060, drafted=16, accepted=2),                      # 6 / 60 ms vs 4 / 40 ms
             _step(8, 0.050, drafted=8, accepted=8),                                        # no plain step at 8
             _step(2, 0.500, prefill=200), _step(2, 0.5, drafted=8, accepted=8, prefill=10)]   # prefill: left out
    by_batch = speculation_speedup_by_batch(steps)
    assert list(by_batch) == [1, 4, 8]
    assert by_batch[1]["speedup"] == pytest.approx((3 / 0.030) / ((1 / 0.020 + 1 / 0.022) / 2))   # medians of rates
    assert by_batch[4]["speedup"] == pytest.approx(1.0) and (by_batch[4]["spec_steps"], by_batch[4]["plain_steps"]) == (1, 1)
    assert by_batch[8] == {"speedup": None, "spec_steps": 1, "plain_steps": 0}


def test_a_load_run_records_what_the_speedup_by_batch_size_needs(make_tiny_engine):
    eng = make_tiny_engine()
    eng.set_draft_model("self:1")                   # the tiny target's first layer drafts: every step verifies
    eng.reconfigure(proposer="draft")
    workload = Workload(num_prompts=4, max_concurrency=2, output_len=8, prompt_set="repeat", seed=0)
    run = WorkloadRun(eng, make_jobs(eng, workload), workload.max_concurrency)
    seen = []
    while not run.done:
        run.step()
        figures = run.step_figures()
        if figures is not None:
            seen.append(figures["engine_step"])
    assert seen and all(set(s) == {"batch_size", "prefill_tokens", "drafted", "accepted", "step_s"} for s in seen)
    assert any(s["drafted"] for s in seen) and any(s["batch_size"] == 2 for s in seen)
