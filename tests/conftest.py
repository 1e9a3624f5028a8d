import contextlib
import os
import socket
import sys

import pytest
import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
torch.manual_seed(0)


# Each CPU fallback, forced the way a CPU that refuses the fast path would (the next machine
# may have another ISA). The float linears' kernels (engine.layers.packed_linear.BACKENDS):
#   "ours-refused": our CPU linear did not build (no compiler): oneDNN serves;
#   "onednn-refused": oneDNN refuses the dtype (bf16 on an AVX2-only CPU): ours serves;
#   "both-refused": neither runs: torch's matmul serves;
#   "row-tiles": oneDNN serves and its row check failed: fixed ROW_TILE-row tiles;
#   "avx2": ours on its AVX2 path (forced on an AVX-512 CPU);
# The quantized weights' kernels (engine.layers.quantized_linear):
#   "quant-ours-refused": our quantized linear did not build: torch's int4/int8 kernels serve,
#     8-bit groups are dequantized;
#   "quant-avx2": ours on its AVX2 path (vpmaddubsw), forced on an AVX-512 VNNI CPU;
#   "quant-avx-vnni": ours on its AVX-VNNI path (256-bit vpdpbusd), where the CPU has it;
#   "quant-vnni256": the same code in AVX-512 VL's encoding, where the CPU has AVX-512 VNNI;
#   "quant-refused": neither runs, so quantized weights are served as float.
# The FP8 cache read (engine.kernels.cpu_fp8):
#   "fp8-refused": our FP8 cache read did not build: torch's index_select and dequantize serve.
FALLBACKS = ("ours-refused", "onednn-refused", "both-refused", "row-tiles", "avx2",
             "quant-ours-refused", "quant-avx2", "quant-avx-vnni", "quant-vnni256", "quant-refused", "fp8-refused", "attention-refused",
             "attention-scalar")


QUANT_PATHS = {"quant-avx2": "avx2", "quant-avx-vnni": "avx_vnni", "quant-vnni256": "avx512vl_vnni"}


@contextlib.contextmanager
def forced_fallback(name: str | None):
    from engine import cpu_features
    from engine.kernels import cpu_attention, cpu_fp8, cpu_linear, cpu_quant
    from engine.layers import packed_linear, quantized_linear
    from tests.kernels_required import skip_unless_runs
    ours_refused = lambda: "our CPU linear refused (forced by a test)"                       # noqa: E731
    onednn_refused = lambda dtype: "oneDNN refused this dtype (forced by a test)"            # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed_linear, "_preferred", {})         # no probe's choice: the first backend that runs
        if name in ("ours-refused", "both-refused", "row-tiles"):
            mp.setattr(cpu_linear, "refusal", ours_refused)
        if name in ("onednn-refused", "both-refused"):
            mp.setattr(packed_linear, "refusal", onednn_refused)
        if name == "row-tiles":
            mp.setattr(packed_linear, "_fixed_tiles", True)
        elif name == "avx2":
            skip_unless_runs(cpu_linear.refusal(), "our CPU linear")
            if not all(f in cpu_features.flags() for f in cpu_linear.NEEDS["avx2"]):
                pytest.skip("our CPU linear's avx2 path does not run here (no such CPU)")
            mp.setitem(cpu_linear._chosen, "isa", "avx2")
        elif name in ("quant-ours-refused", "quant-refused"):
            mp.setattr(cpu_quant, "refusal", lambda: "our quantized linear refused (forced by a test)")
            if name == "quant-refused":
                mp.setattr(quantized_linear, "refusal", lambda kind, dtype: f"{kind} kernel refused (forced by a test)")
        elif name in QUANT_PATHS:
            isa = QUANT_PATHS[name]
            skip_unless_runs(cpu_quant.refusal(), "our quantized CPU linear")
            if not all(f in cpu_features.flags() for f in cpu_quant.NEEDS[isa]):
                pytest.skip(f"our quantized linear's {isa} path does not run here (no such CPU)")
            mp.setitem(cpu_quant._chosen, "isa", isa)
        elif name == "fp8-refused":
            mp.setattr(cpu_fp8, "refusal", lambda: "our FP8 cache read refused (forced by a test)")
        elif name == "attention-refused":
            mp.setattr(cpu_attention, "refusal", lambda: "our CPU attention refused (forced by a test)")
        elif name == "attention-scalar":
            skip_unless_runs(cpu_attention.refusal(), "our CPU attention")    # its trials ran: undone, the choice stays
            mp.setitem(cpu_attention._chosen, "isa", "scalar")
        elif name is not None and name not in FALLBACKS:
            raise ValueError(f"no fallback {name!r}; known: {FALLBACKS}")
        yield


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model, loaded once per test session (converted on first use)."""
    from engine.loading.loader import load_model
    return load_model("default", weight_dtype="float")     # the fp32 reference: the file dequantized, as transformers reads it


def engine_factory(loaded, pool_bytes: int):
    """make(**config): a fresh engine (own cache and settings) around a shared loaded model."""
    from engine import EngineConfig
    from engine.engine import LLMEngine

    def make(**config):
        config.setdefault("kv_cache_bytes", pool_bytes)
        # Speculation's mechanics are tested on every step's drafts; the batch-size policy
        # (speculation_policy auto, the default) is tested on its own (test_batching.py).
        config.setdefault("speculation_policy", "fixed")
        return LLMEngine(loaded, EngineConfig(**config), torch.device("cpu"))
    return make


def serving_engine(loaded):
    """An engine as the draft head's recipe serves its data (engine.training.served_data): no
    prefix caching, no speculation; eager, to keep the tests short."""
    from engine import EngineConfig
    from engine.engine import LLMEngine
    return LLMEngine(loaded, EngineConfig(enable_prefix_caching=False, proposer="off", compile="off",
                                          kv_cache_bytes=8 * 2**20), torch.device("cpu"))


@pytest.fixture
def make_engine(default_model):
    """A fresh engine around the shared default model."""
    return engine_factory(default_model, 64 * 2**20)


TINY_SEED = 0     # the spec-decode tests' prompts were checked against this seed's model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random-weight Llama with the default model's tokenizer (engine.loading.synthetic
    "tiny"): real code paths at a fraction of the cost. Its head is untied, so greedy
    output wanders instead of repeating one token, and an early-exit draft "self:1" agrees
    with it only sometimes: speculation sees both accepted and rejected drafts."""
    from engine.loading.loader import load_model
    from engine.loading.synthetic import write_checkpoint
    return load_model(str(write_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=TINY_SEED)))


@pytest.fixture
def make_tiny_engine(tiny_model):
    """A fresh engine around the shared tiny model."""
    return engine_factory(tiny_model, 8 * 2**20)


@pytest.fixture
def still_governor(monkeypatch):
    """The engines' thread governor never moves torch's count (a test that counts settings events
    or dtype-cache keys must not see another program's load, e.g. a second test run)."""
    from engine.thread_policy import ThreadGovernor
    monkeypatch.setattr(ThreadGovernor, "tick", lambda self: False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """A test module on one torch thread (its step timings and trees steady), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def together(eng, prompts, params) -> list[list[int]]:
    """Every prompt submitted at once and run to the end in shared steps: each one's tokens."""
    ids = [eng.submit(p, params) for p in prompts]
    got = {i: [] for i in ids}
    while eng.has_work:
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
    return [got[i] for i in ids]


def chat(text: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": text}]


LOGITS_TEXT = "The cat sat on the mat. The dog sat on the log."


def our_logits(loaded, text: str = LOGITS_TEXT) -> torch.Tensor:
    """Our logits for every position of `text`, through the paged cache: [T, V]."""
    from engine import EngineConfig
    from engine.runtime.model_runner import ModelRunner
    ids = loaded.tokenizer.encode(text)
    runner = ModelRunner(loaded, EngineConfig(block_size=4, num_blocks=16), torch.device("cpu"))
    return runner.forward(runner.start(ids), ids, logits_for="all")


def transformers_logits(folder, text: str = LOGITS_TEXT) -> torch.Tensor:
    """transformers' logits for the same text on the same folder, fp32: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ids = AutoTokenizer.from_pretrained(folder).encode(text)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers (a hung server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield listener.getsockname()[1]
    listener.close()


def assert_second_token_follows_the_target(eng, prompt_ids: list[int], requests: int = 300, max_tokens: int = 3) -> None:
    """Temperature 1, top-k 4: run `requests` seeded replies of max_tokens tokens (the prefill
    samples the first token, one speculative step the second; max_tokens - 2 drafts at most).
    Given the commonest first token, the second token's frequencies must match the target's
    own top-4 probabilities (chi-square)."""
    from engine import SamplingParams
    from engine.layers.sampler import probabilities
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=max_tokens, stop_on_eos=False, seed=s)
              for s in range(requests)]
    pairs = [tuple(eng.generate_text(prompt_ids, p)[1][:2]) for p in params]
    first = max(set(a for a, _ in pairs), key=lambda a: sum(x == a for x, _ in pairs))
    seconds = [b for a, b in pairs if a == first]
    runner, ids = eng.runner, prompt_ids + [first]          # the target's own distribution after it
    seq = runner.start(ids)
    logits = runner.forward(seq, ids[seq.num_computed:])
    runner.end(seq)
    p = probabilities(logits[-1], SamplingParams(temperature=1.0, top_k=4))
    support = torch.nonzero(p).flatten().tolist()
    observed = [seconds.count(t) for t in support]
    assert sum(observed) == len(seconds) >= 60                   # nothing outside the target's support
    expected = [float(p[t]) * len(seconds) for t in support]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(support) - 1                    # chi-square survival function: Q(dof/2, x/2)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))
    assert p_value > 0.001, (observed, expected)


def assert_dies_mid_stream(backend, kill) -> None:
    """A long reply streams; `kill()` stops its server after 5 events: the request ends with a
    clear ServerDiedError that says the streamed text was kept (the remote backends' tests)."""
    from engine import SamplingParams
    from engine.errors import ServerDiedError
    request = backend.start(chat("Write a very long story about a baker."),
                            SamplingParams(max_tokens=2000, stop_on_eos=False))
    transcript = []
    try:
        with pytest.raises(ServerDiedError) as info:
            while not request.finished:
                transcript.append(request.step().text_delta)
                if len(transcript) == 5:
                    kill()
        assert request.finished
    finally:
        request.close()
    assert len(transcript) >= 5 and all(transcript[:5])
    assert "stopped in the middle of the reply" in str(info.value) and "kept" in str(info.value)


# Workbenches the app tests opened, closed and shut down but never deleted (tests/test_app.py's
# open_workbench says why); while any exists, the run ends without Python's finalization, which
# would delete them.
KEPT_WINDOWS: list = []


def pytest_sessionfinish(session, exitstatus):
    session.config._workbench_exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After pytest's summary and every other plugin's end: where app windows were kept, leave
    with pytest's exit status and no finalization (Qt deleting them at exit could crash)."""
    if KEPT_WINDOWS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(getattr(config, "_workbench_exit_status", 0))


def pytest_configure(config):
    """WORKBENCH_CRASH_LOG=F: a crash (segfault, abort) writes every thread's Python stack to F
    instead of stderr, so scripts/test.sh can print the crashing thread's stack last, where a
    CI log's tail keeps it (run with -p no:faulthandler: pytest's own handler writes to stderr)."""
    path = os.environ.get("WORKBENCH_CRASH_LOG")
    if path:
        import faulthandler
        config._workbench_crash_log = open(path, "w")       # open for the whole run: the handler writes to its fd
        faulthandler.enable(file=config._workbench_crash_log, all_threads=True)
