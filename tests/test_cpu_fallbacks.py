"""Every CPU: each CPU-specific path is tried before the engine relies on it, and each
fallback is forced here (the next machine may have the other ISA) and checked against the
reference: transformers' logits, and the fast path's greedy tokens. Where this CPU has
AVX-512, an AVX2-only CPU is also imitated for real (oneDNN and ATen capped at AVX2), and
the default engine must load and answer there."""
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, SamplingParams, cpu_features
from engine.engine import LLMEngine
from engine.layers import packed_linear, quantized_linear
from engine.loading.loader import load_model
from engine.loading.synthetic import write_checkpoint
from engine.models.llama import Linear
from engine.runtime import compiled_step, kernel_check
from tests.conftest import forced_fallback, our_logits, transformers_logits
from tests.kernels_required import excused

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=24, stop_on_eos=False)
PROMPT = list(range(200, 240))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("fallbacks"), "tiny", seed=5)


def greedy(loaded, **config) -> list[int]:
    eng = LLMEngine(loaded, EngineConfig(num_blocks=32, compile="off", **config), CPU)
    return eng.generate_text(PROMPT, GREEDY)[1]


@pytest.fixture(scope="module")
def fast_path_tokens(folder):
    return {dtype: greedy(load_model(str(folder), dtype=dtype)) for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("fallback", ["ours-refused", "onednn-refused", "both-refused", "row-tiles", "avx2"])
def test_each_linear_fallback_matches_transformers_and_the_fast_paths_tokens(folder, fast_path_tokens, fallback):
    with forced_fallback(fallback):
        loaded = load_model(str(folder))
        ours = our_logits(loaded)
        tokens = greedy(loaded)
        bf16_tokens = greedy(load_model(str(folder), dtype=torch.bfloat16))
    torch.testing.assert_close(ours, transformers_logits(folder), atol=1e-4, rtol=1e-4)
    assert tokens == fast_path_tokens[torch.float32]
    assert len(bf16_tokens) == GREEDY.max_tokens           # bf16 rounds by its kernel: it must run, and batch (test_batching)


def test_where_onednn_refuses_ours_serves_and_in_effect_says_why(folder):
    """bf16 on an AVX2-only CPU: oneDNN refuses it, our CPU linear packs and serves it."""
    with forced_fallback("onednn-refused"):
        loaded = load_model(str(folder), dtype=torch.bfloat16)
        eng = LLMEngine(loaded, EngineConfig(num_blocks=32, compile="off"), CPU)
        assert {p.dim() for p in loaded.model.packed_weights} == {3}           # [out / 32, in, 32] blocks
        assert eng.settings()["paths"]["linear"].startswith("ours (")


def test_where_no_packed_kernel_runs_nothing_is_packed_and_in_effect_says_why(folder):
    with forced_fallback("both-refused"):
        loaded = load_model(str(folder), dtype=torch.bfloat16)
        eng = LLMEngine(loaded, EngineConfig(num_blocks=32, compile="off"), CPU)
        assert loaded.model.packed_weights == []
        assert eng.settings()["paths"]["linear"] == ("torch matmul (ours: our CPU linear refused (forced by a test); "
                                                     "onednn: oneDNN refused this dtype (forced by a test))")


def test_refused_int4_kernels_serve_the_weights_as_float_and_say_why(folder):
    asked = load_model(str(folder), dtype=torch.bfloat16, weight_dtype="int4")
    assert asked.weights.quantized > 0
    with forced_fallback("quant-refused"):
        refused = load_model(str(folder), dtype=torch.bfloat16, weight_dtype="int4")
        eng = LLMEngine(refused, EngineConfig(num_blocks=32, compile="off"), CPU)
        assert refused.weights.quantized == 0
        assert "int4 kernel refused (forced by a test)" in refused.weights.summary()
        assert eng.settings()["paths"]["quantized"] == ("float (our quantized linear refused (forced by a test); "
                                                        "int4 kernel refused (forced by a test))")
        tokens = eng.generate_text(PROMPT, GREEDY)[1]
    assert tokens == greedy(load_model(str(folder), dtype=torch.bfloat16, weight_dtype="float"))   # as the float model


def test_without_our_quantized_kernel_torchs_serve_int4_and_8bit_groups_are_dequantized(folder):
    with forced_fallback("quant-ours-refused"):
        loaded = load_model(str(folder), dtype=torch.bfloat16, weight_dtype="int4")
        eng = LLMEngine(loaded, EngineConfig(num_blocks=32, compile="off"), CPU)
        assert loaded.weights.quantized > 0
        assert all(m.quant.kernel == quantized_linear.TORCH for m in loaded.model.modules()
                   if isinstance(m, Linear) and m.quant is not None)
        assert eng.settings()["paths"]["quantized"] == ("torch's int4/int8 kernels (our quantized linear refused "
                                                        "(forced by a test))")
        assert quantized_linear.unsupported(quantized_linear.INT8_GROUPS, (64, 64), CPU, torch.bfloat16, 32) == (
            "no kernel takes 8-bit groups here (our quantized linear refused (forced by a test))")
        assert len(eng.generate_text(PROMPT, GREEDY)[1]) == GREEDY.max_tokens


@pytest.mark.parametrize("path", ["quant-avx2", "quant-avx-vnni", "quant-vnni256"])
def test_our_quantized_kernel_on_each_256_bit_path_gives_the_widest_paths_tokens(folder, path):
    """Every group's dot is an exact integer on every path, the floats in the same order: the
    same bits, so the same text."""
    def tokens():
        loaded = load_model(str(folder), dtype=torch.bfloat16, weight_dtype="int4")
        return LLMEngine(loaded, EngineConfig(num_blocks=32, compile="off"), CPU).generate_text(PROMPT, GREEDY)[1]
    widest = tokens()
    with forced_fallback(path):
        assert tokens() == widest


def test_without_a_compiler_the_step_stays_eager_and_says_so(folder, monkeypatch, fast_path_tokens):
    monkeypatch.setattr(compiled_step, "compiler_refusal", lambda device_type: "no C++ compiler (forced by a test)")
    loaded = load_model(str(folder))
    eng = LLMEngine(loaded, EngineConfig(num_blocks=32, compile="on"), CPU)
    assert eng.settings()["compile"] == "off: no C++ compiler (forced by a test)" and eng.runner.compiled is None
    assert eng.generate_text(PROMPT, GREEDY)[1] == fast_path_tokens[torch.float32]


def test_the_kernels_are_tried_on_this_cpu():
    """What this CPU runs natively: fp32 on oneDNN and the int4/int8 kernels in bf16 pass
    their trials here (every supported CPU has them); a refusal names the CPU's problem. Each
    of our kernels runs, or on a user's machine did not build (no compiler): a failed trial is
    a broken kernel anywhere, and under scripts/test.sh (WORKBENCH_REQUIRE_KERNELS) so is a
    failed build."""
    assert packed_linear.refusal(torch.float32) is None
    for kind in (quantized_linear.INT4, quantized_linear.INT8):
        assert quantized_linear.refusal(kind, torch.bfloat16) is None
    for key, module in kernel_check.KERNELS.items():
        why = importlib.import_module(module).refusal()
        assert why is None or (excused(why, kernel_check.NAMES[key]) and "did not build" in why), why


def test_the_isa_name_keys_what_is_built_for_a_cpu():
    from engine.remote.llama_server_binary import cmake_flags
    avx2 = frozenset("sse4_2 avx f16c fma bmi2 avx2".split())
    avx512 = avx2 | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni", "avx512_bf16"}
    assert cpu_features.isa_name(avx2) == "avx2" and cpu_features.isa_name(avx512) == "avx512-vnni-bf16"
    assert "-DGGML_AVX512=OFF" in cmake_flags(avx2) and "-DGGML_AVX2=ON" in cmake_flags(avx2)
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AMX_INT8=OFF"} <= set(cmake_flags(avx512 | {"amx_int8"}))
    assert cpu_features.parse_flags("processor : 0\nflags\t\t: fpu avx2 fma\n") == {"fpu", "avx2", "fma"}


AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "WORKBENCH_CPU_ISA": "avx2"}
IMITATED = """
import json, sys
from engine import LLMEngine, SamplingParams
eng = LLMEngine.load("default")
ids = eng.encode([{"role": "user", "content": "Name the capital of France."}])
text = eng.generate_text(ids, SamplingParams(max_tokens=12))[0]
print(json.dumps({"paths": eng.settings()["paths"], "text": text}))
"""


@pytest.mark.slow
@pytest.mark.skipif("avx512f" not in cpu_features.flags(), reason="this CPU is AVX2-only already: every other test runs there")
def test_the_default_engine_loads_and_answers_on_an_imitated_avx2_only_cpu():
    """oneDNN capped at AVX2 refuses bf16 exactly as an AVX2-only EPYC does ("bf16 path needs
    the cpu support avx_ne_convert or avx512bw..."): the dtype probe and the load must not
    crash, and the answer is the default model's."""
    env = {**os.environ, **AVX2_ONLY}       # the dtype probe keys its answer by what oneDNN serves
    done = subprocess.run([sys.executable, "-c", IMITATED], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "Paris" in result["text"]
    if result["paths"]["dtype"].startswith("bfloat16"):
        assert "onednn: oneDNN refused bfloat16 here" in result["paths"]["linear"] or \
            result["paths"]["linear"].startswith("ours (")
    assert result["paths"]["quantized"] == "ours (avx2), int8 activations per 32"


# ---- a busy machine: threads follow the free cores, and never change a reply -------------
def test_the_governor_gives_up_a_busy_core_and_takes_it_back_once_samples_agree(monkeypatch):
    from engine import thread_policy
    busy, now, set_to = [0], [0.0], []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(thread_policy, "_last_set", None)
    governor = thread_policy.ThreadGovernor(2, sample=lambda: busy[0], clock=lambda: now[0], cores=2)

    def tick_at(t):
        now[0] = t
        return governor.tick()
    assert not tick_at(1.0) and governor.threads == 2
    busy[0] = 1
    assert not tick_at(1.1)                           # too soon to look again
    assert not tick_at(1.3)                           # one sample: not yet
    assert tick_at(1.6) and governor.threads == 1 and set_to == [1]
    assert governor.describe() == "1 of 2: other programs keep 1 of 2 cores busy"
    busy[0] = 5                                       # never below one thread
    assert not tick_at(2.0) and not tick_at(2.3) and governor.threads == 1
    busy[0] = 0
    assert not tick_at(2.6) and tick_at(2.9) and governor.threads == 2 and set_to == [1, 2]


def test_a_new_engine_starts_from_the_count_an_earlier_engines_governor_lowered(monkeypatch):
    """An engine gone while other programs were busy leaves torch at the count its governor set:
    the next engine starts from the count that governor started from, not from 1 for good."""
    from engine import thread_policy
    current = [2]
    monkeypatch.setattr(torch, "set_num_threads", lambda n: current.__setitem__(0, n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: current[0])
    monkeypatch.setattr(thread_policy, "_last_set", None)
    now = [0.0]
    governor = thread_policy.ThreadGovernor(2, sample=lambda: 1, clock=lambda: now[0], cores=2)
    for t in (1.0, 1.3, 1.6):
        now[0] = t
        governor.tick()
    assert governor.threads == 1 and current == [1]
    assert thread_policy.starting_threads() == 2 and current == [2]
    current[0] = 3                                    # a count set since by the user is theirs
    assert thread_policy.starting_threads() == 3
    current[0] = 2
    governor = thread_policy.ThreadGovernor(2, sample=lambda: 1, clock=lambda: now[0], cores=2)
    for t in (2.0, 2.3, 2.6):                         # lowered to 1 again; the user then chooses 1
        now[0] = t
        governor.tick()
    assert current == [1]
    thread_policy.choose_threads(1)                   # OMP_NUM_THREADS=1 in the app
    assert thread_policy.starting_threads() == 1 and current == [1]


def test_other_programs_spinning_threads_are_counted():
    from engine import thread_policy
    from engine.bench.busy import BusyCores
    with BusyCores(2, max_s=30):
        import time
        time.sleep(0.5)
        busy = max(thread_policy.runnable_elsewhere() for _ in range(20))
    assert busy >= 2                                # both spinners are runnable, in other processes


@pytest.mark.parametrize("dtype,weights", [(torch.float32, "float"), (torch.bfloat16, "float"), (torch.bfloat16, "int4")])
def test_one_thread_or_two_give_the_same_logits_and_tokens(folder, dtype, weights):
    loaded = load_model(str(folder), dtype=dtype, weight_dtype=weights)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = our_logits(loaded), greedy(loaded)
        torch.set_num_threads(2)
        two = our_logits(loaded), greedy(loaded)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and one[1] == two[1]
