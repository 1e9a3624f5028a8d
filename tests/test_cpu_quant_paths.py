"""Which path our quantized CPU linear runs at each row count, measured on this CPU
(engine.kernels.cpu_quant_paths): the fastest per row count, the widest unless another is
clearly faster, kept per CPU, never measured where a path was forced; the op switches path
at the planned row count."""
import pytest
import torch

from engine.kernels import cpu_quant, cpu_quant_paths
from engine.kernels.cpu_quant_paths import MARGIN, ROW_COUNTS, Plan, measured_plan, plan_from
from engine.layers import quantized_linear
from tests.kernels_required import skip_unless_runs


def _times(**per_path):
    return {path: dict(zip(ROW_COUNTS, ms)) for path, ms in per_path.items()}


def test_each_row_count_runs_the_path_measured_fastest_from_where_it_wins():
    # Zen 4's figures: AVX2 faster at one row, AVX-512 from 4 rows on
    plan = plan_from(_times(avx2=(3.2, 5.0, 10.8), avx512=(3.5, 4.6, 9.3)), widest="avx512")
    assert (plan.few, plan.many, plan.many_from) == ("avx2", "avx512", 4)
    assert [plan.path(rows) for rows in (1, 2, 3, 4, 16, 64)] == ["avx2"] * 3 + ["avx512"] * 3
    assert plan.code(cpu_quant.ISAS) == cpu_quant.ISAS["avx2"] | cpu_quant.ISAS["avx512"] << 4 | 4 << 8
    assert plan.describe() == "avx2 below 4 rows, avx512 from 4, measured fastest here"
    assert "1 rows avx2 3200.00 ms, avx512 3500.00 ms" in plan.why


def test_the_widest_path_keeps_every_row_count_unless_another_is_clearly_faster():
    close = 1 / (1 + MARGIN / 2)          # another path faster by half the margin: noise
    plan = plan_from(_times(avx2=(1.0 * close, 2.0 * close, 4.0), avx512=(1.0, 2.0, 4.0)), widest="avx512")
    assert (plan.few, plan.many_from) == ("avx512", 0) and plan.code(cpu_quant.ISAS) == cpu_quant.ISAS["avx512"]
    assert plan.describe() == "avx512, measured fastest here"
    slower_from_16 = plan_from(_times(avx2=(1.0, 2.0, 8.0), avx512=(2.0, 4.0, 4.0)), widest="avx512")
    assert (slower_from_16.few, slower_from_16.many, slower_from_16.many_from) == ("avx2", "avx512", 16)


def test_the_timings_are_kept_per_cpu_key_and_measured_again_for_other_paths(tmp_path):
    calls = []

    def timer(path, rows):
        calls.append((path, rows))
        return {"avx2": 1.0, "avx512": 2.0}[path] * rows
    first = measured_plan(["avx2", "avx512"], "avx512", "this cpu", tmp_path, lambda: timer)
    assert first.few == first.many == "avx2" and len(calls) == cpu_quant_paths.REPEATS * len(ROW_COUNTS) * 2

    def must_not_time(path, rows):
        raise AssertionError("measured again although kept")
    assert measured_plan(["avx2", "avx512"], "avx512", "this cpu", tmp_path, lambda: must_not_time) == first
    calls.clear()
    measured_plan(["avx2", "avx512"], "avx512", "another cpu", tmp_path, lambda: timer)
    measured_plan(["avx2", "avx_vnni", "avx512"], "avx512", "this cpu", tmp_path,
                  lambda: lambda path, rows: timer(path if path != "avx_vnni" else "avx512", rows))
    assert len(calls) == cpu_quant_paths.REPEATS * len(ROW_COUNTS) * 5        # both measured anew
    (tmp_path / cpu_quant_paths.CACHE_FILE).write_text("{ not json")            # a corrupt file: measured again
    assert measured_plan(["avx2", "avx512"], "avx512", "this cpu", tmp_path, lambda: timer) == first


def test_the_op_switches_path_at_the_planned_row_count():
    skip_unless_runs(cpu_quant.refusal(), "our quantized CPU linear")
    u = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(0))
    w, scales = cpu_quant.pack(u, torch.full((32, 2), 0.5), torch.zeros(32, 2), 4)
    x = torch.randn(5, 64)
    # a plan whose path from 4 rows is no path: the op must refuse exactly there
    plan = cpu_quant.ISAS["scalar"] | 15 << 4 | 4 << 8
    scalar = torch.ops.workbench_cpu.linear_q(x, w, scales, None, 4, 32, cpu_quant.ISAS["scalar"])
    assert torch.equal(torch.ops.workbench_cpu.linear_q(x[:3], w, scales, None, 4, 32, plan), scalar[:3])
    with pytest.raises(RuntimeError, match="isa"):
        torch.ops.workbench_cpu.linear_q(x[:4], w, scales, None, 4, 32, plan)


def test_a_forced_path_runs_at_every_row_count_unmeasured(monkeypatch):
    skip_unless_runs(cpu_quant.refusal(), "our quantized CPU linear")
    monkeypatch.setattr(cpu_quant_paths, "time_paths", lambda *a: pytest.fail("measured a forced path"))
    monkeypatch.setattr(cpu_quant, "_measured", {})
    try:
        cpu_quant.force_isa("scalar")
        assert cpu_quant.plan() == Plan("scalar", "scalar", why="forced (scalar)")
        assert quantized_linear.path() == "ours (scalar), int8 activations per 32"
        assert cpu_quant.code() == cpu_quant.ISAS["scalar"]
    finally:
        cpu_quant.force_isa(None)


def test_in_effect_names_the_paths_and_that_they_were_measured(monkeypatch):
    skip_unless_runs(cpu_quant.refusal(), "our quantized CPU linear")
    if len([p for p in cpu_quant._chosen.get("passed", "").split(",") if p != "scalar"]) < 2:
        pytest.skip("one path runs here: nothing to measure")
    monkeypatch.setitem(cpu_quant._measured, "plan", Plan("avx2", "avx512", 4, "measured on ...", measured=True))
    monkeypatch.setitem(cpu_quant._chosen, "isa", cpu_quant._chosen["passed"].split(",")[-1])
    monkeypatch.setitem(cpu_quant._chosen, "forced", "")
    assert quantized_linear.path() == ("ours (avx2 below 4 rows, avx512 VNNI from 4, measured fastest here), "
                                       "int8 activations per 32")


def test_the_probe_times_each_path_on_weights_the_op_takes():
    skip_unless_runs(cpu_quant.refusal(), "our quantized CPU linear")
    probe = cpu_quant_paths.Probe(cpu_quant.COLS, cpu_quant.ISAS, cpu_quant.KQUANT_BLOCK_BYTES[4])
    weights = sum(w.numel() + s.numel() * s.element_size() for w, s in probe.int4)
    assert weights >= cpu_quant_paths.PROBE_BYTES * 0.8 and sum(w.numel() for w in probe.kq4) >= cpu_quant_paths.PROBE_BYTES * 0.8
    assert all(probe.seconds(cpu_quant.isa(), rows) > 0 for rows in (1, 16))


def test_a_timing_that_fails_keeps_the_widest_path_and_says_why(monkeypatch):
    skip_unless_runs(cpu_quant.refusal(), "our quantized CPU linear")
    passed = [p for p in cpu_quant._chosen.get("passed", "").split(",") if p != "scalar"]
    if len(passed) < 2:
        pytest.skip("one path runs here: nothing to measure")

    def fails(*args):
        raise RuntimeError("linear_q: the probe's call failed")
    monkeypatch.setattr(cpu_quant_paths, "measured_plan", fails)
    monkeypatch.setattr(cpu_quant, "_measured", {})
    monkeypatch.setitem(cpu_quant._chosen, "isa", passed[-1])
    monkeypatch.setitem(cpu_quant._chosen, "forced", "")
    plan = cpu_quant.plan()
    assert (plan.few, plan.many, plan.measured) == (passed[-1], passed[-1], False)
    assert plan.why == "the widest: timing failed (linear_q: the probe's call failed)"
    assert cpu_quant.code() == cpu_quant.ISAS[passed[-1]]
