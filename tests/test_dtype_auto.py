"""`dtype auto` on the CPU weighs the whole decode step of the model being loaded
(engine.runtime.cpu_dtype.fastest_step and DtypeTrial, engine.engine.pick_dtype): the choice
given measured timings, refusals, the cache's key, and that a trial's winner is the model the
engine keeps. No timing is asserted: which dtype wins is this machine's business
(`python -m engine.bench decode` reports both arms)."""
import json

import pytest
import torch

from engine.runtime import cpu_dtype
from engine.runtime.cpu_dtype import dtype_name, fastest_step, measure_steps, step_choice, step_key


def test_the_faster_step_is_picked_whichever_dtype_it_is():
    assert step_choice({"float32": 0.010, "bfloat16": 0.012}).dtype is torch.float32
    assert step_choice({"float32": 0.012, "bfloat16": 0.010}).dtype is torch.bfloat16
    why = step_choice({"float32": 0.010, "bfloat16": 0.012}).why
    assert "float32 10.00 ms" in why and "bfloat16 12.00 ms" in why


def test_a_dtype_that_wins_one_user_but_loses_many_is_not_picked():
    """The trial times one user and eight at once: each count's time over the best there,
    averaged. fp32 10% faster alone but 4x slower with eight users (float weights, issue 62)
    loses; a dtype faster at both wins; the figures are said."""
    fp32_alone = {"float32": {"1": 0.009, "8": 0.080}, "bfloat16": {"1": 0.010, "8": 0.020}}
    choice = step_choice(fp32_alone)
    assert choice.dtype is torch.bfloat16 and "80.00 ms at 8 users" in choice.why and "one user and many" in choice.why
    assert step_choice({"float32": {"1": 0.008, "8": 0.015}, "bfloat16": {"1": 0.010, "8": 0.020}}).dtype is torch.float32


def test_timings_within_noise_of_each_other_give_the_same_answer_every_time():
    """Within 3% the tie goes to bf16 whichever way the noise fell; a refused bf16 leaves fp32."""
    for fp32_first in (0.0099, 0.0100, 0.0101):
        measured = {"float32": {"1": fp32_first, "8": 0.020}, "bfloat16": {"1": 0.0100, "8": 0.0201}}
        assert step_choice(measured).dtype is torch.bfloat16
    assert step_choice({"float32": {"1": 0.0099, "8": 0.020}, "bfloat16": "refused"}).dtype is torch.float32


def test_a_refused_dtype_is_never_picked_and_its_reason_is_said():
    refused = "bfloat16 kernels are missing on this CPU: no bf16 here"
    choice = step_choice({"float32": 0.050, "bfloat16": refused})
    assert choice.dtype is torch.float32 and f"bfloat16 skipped: {refused}" in choice.why
    nothing = step_choice({"float32": "float32 did not run the model here: x", "bfloat16": "refused"})
    assert nothing.dtype is torch.float32 and "no candidate ran" in nothing.why


def test_a_dtype_refused_here_is_not_tried_and_a_failed_trial_is_recorded_not_raised(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "compute_refusal",
                        lambda dtype: "bf16 refused (forced by a test)" if dtype is torch.bfloat16 else None)
    tried = []
    measured = measure_steps(lambda dtype: tried.append(dtype) or 0.02)
    assert tried == [torch.float32] and measured == {"float32": 0.02, "bfloat16": "bf16 refused (forced by a test)"}

    monkeypatch.setattr(cpu_dtype, "compute_refusal", lambda dtype: None)

    def fails_in_bf16(dtype):
        if dtype is torch.bfloat16:
            raise RuntimeError("no kernel for this dtype\nmore lines")
        return 0.5
    measured = measure_steps(fails_in_bf16)
    assert measured["bfloat16"] == "bfloat16 did not run the model here: no kernel for this dtype"
    assert step_choice(measured).dtype is torch.float32


def test_the_step_is_measured_once_per_cpu_and_model_format(tmp_path, monkeypatch):
    cache = tmp_path / "cpu_dtype_step.json"
    monkeypatch.setattr(cpu_dtype, "compute_refusal", lambda dtype: None)
    calls = []

    def step_seconds(dtype):
        calls.append(dtype)
        return 0.01 if dtype is torch.float32 else 0.02
    q4 = "llama config abc, GGUF Q4_1 x210 | weight_dtype auto | compile auto"
    assert fastest_step(cache, q4, step_seconds).dtype is torch.float32 and len(calls) == 2
    assert fastest_step(cache, q4, step_seconds).dtype is torch.float32 and len(calls) == 2     # from the file
    assert json.loads(cache.read_text()) == {step_key(q4): {"float32": 0.01, "bfloat16": 0.02}}
    # another weight format of the same model is measured on its own, and both are kept
    float_weights = "llama config abc, safetensors | weight_dtype float | compile auto"
    fastest_step(cache, float_weights, step_seconds)
    assert len(calls) == 4 and set(json.loads(cache.read_text())) == {step_key(q4), step_key(float_weights)}
    # read back under the engine's starting thread count, whatever its governor lowered torch's to since
    from engine.runtime.cpu_dtype import known_steps
    starting = torch.get_num_threads()
    assert known_steps(cache, q4, threads=starting) == {"float32": 0.01, "bfloat16": 0.02}
    assert known_steps(cache, q4, threads=starting + 1) is None
    # another CPU (or thread count, torch, ISA cap: all in cpu_key) measures again
    monkeypatch.setattr(cpu_dtype, "cpu_key", lambda threads=None: "another CPU")
    fastest_step(cache, q4, step_seconds)
    assert len(calls) == 6
    # a corrupt file is measured again, not a crash
    cache.write_text("{not json")
    fastest_step(cache, q4, step_seconds)
    assert len(calls) == 8


def test_a_model_that_does_not_load_fails_with_its_error_and_nothing_is_kept(tmp_path, monkeypatch):
    from engine.errors import CheckpointError
    monkeypatch.setattr(cpu_dtype, "compute_refusal", lambda dtype: None)
    cache = tmp_path / "cpu_dtype_step.json"

    def broken(dtype):
        raise CheckpointError("model.safetensors is truncated")
    with pytest.raises(CheckpointError):
        fastest_step(cache, "broken format", broken)
    assert not cache.exists()
    # nor is a trial in which no dtype ran: the next load tries again
    fastest_step(cache, "broken format", lambda dtype: (_ for _ in ()).throw(RuntimeError("kernel failed")))
    assert not cache.exists()


class FakeTrial:
    model_format = "fake format"

    def __init__(self, seconds):
        self.seconds, self.asked = seconds, []

    def step_seconds(self, dtype):
        self.asked.append(dtype)
        return self.seconds[dtype]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_dtype, "measure", lambda: {"float32": {"onednn": 1.0}, "bfloat16": {"onednn": 0.5}})
    monkeypatch.setattr(cpu_dtype, "compute_refusal", lambda dtype: None)
    return tmp_path


def test_pick_dtype_auto_takes_the_whole_step_over_the_float_linear(cache_dir):
    """The linear probe says bf16 reads faster; the model's step says fp32 runs faster: fp32."""
    from engine.engine import pick_dtype
    cpu = torch.device("cpu")
    trial = FakeTrial({torch.float32: 0.010, torch.bfloat16: 0.015})
    dtype, why = pick_dtype("auto", cpu, trial)
    assert dtype is torch.float32 and "decode step" in why
    assert pick_dtype("auto", cpu)[0] is torch.bfloat16          # no model at hand: the linear probe
    asked = FakeTrial({torch.float32: 1.0, torch.bfloat16: 1.0})
    assert pick_dtype("bfloat16", cpu, asked) == (torch.bfloat16, "asked for") and asked.asked == []


def test_load_with_dtype_auto_keeps_the_trials_model_and_loads_once_after(cache_dir, monkeypatch, tiny_model,
                                                                        still_governor):
    """The first load of a model format times each dtype, and the engine keeps the model the
    trial loaded in the winning dtype (no third load); the next load reads the cache (one load)."""
    from engine import EngineConfig, LLMEngine
    from engine.loading import loader
    folder = str(tiny_model.folder)
    real_load, loads = loader.load_model, []
    monkeypatch.setattr(loader, "load_model", lambda *a, **kw: loads.append(kw["dtype"]) or real_load(*a, **kw))
    config = EngineConfig(compile="off", num_blocks=32)
    progress = []
    engine = LLMEngine.load(folder, config, progress=lambda message, fraction: progress.append((message, fraction)))
    assert sorted(map(str, loads)) == ["torch.bfloat16", "torch.float32"]
    # the trial says what it does, and the load's bar only grows through it, to full
    fractions = [f for _, f in progress]
    assert any(m.startswith("dtype auto: timing bfloat16") for m, _ in progress) and fractions == sorted(fractions)
    assert fractions[-1] == 1.0
    assert engine.dtype_why.startswith("auto: the cheaper decode steps of this model here, one user and many")
    recorded = json.loads((cache_dir / "cpu_dtype_step.json").read_text())
    (key, timed), = recorded.items()
    assert loader.weights_format(tiny_model.folder) in key and "weight_dtype auto | compile off" in key
    assert set(timed) == {"float32", "bfloat16"} and all(set(t) == {"1", "8"} and min(t.values()) > 0 for t in timed.values())
    picked = dtype_name(step_choice(timed).dtype)
    assert engine.runner.model_dtype is getattr(torch, picked)
    loads.clear()
    again = LLMEngine.load(folder, config)
    assert loads == [getattr(torch, picked)] and again.dtype_why == engine.dtype_why


def test_a_large_candidate_is_freed_before_the_next_loads(monkeypatch):
    """Two 8B candidates side by side would double a load's peak memory: a model over
    KEEP_WHILE_LOADING_BYTES is not kept while the next dtype loads, however much memory is free."""
    from engine.cache import memory_plan
    monkeypatch.setattr(cpu_dtype, "_available_ram", lambda: 2**40)
    monkeypatch.setattr(memory_plan, "weights_bytes", lambda model: cpu_dtype.KEEP_WHILE_LOADING_BYTES)
    assert cpu_dtype._room_for_another(object())
    monkeypatch.setattr(memory_plan, "weights_bytes", lambda model: cpu_dtype.KEEP_WHILE_LOADING_BYTES + 1)
    assert not cpu_dtype._room_for_another(object())
