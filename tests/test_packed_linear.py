"""oneDNN-packed linear weights (engine.layers.packed_linear), the CPU dtype probe (engine.runtime.cpu_dtype)
and the compiled bf16 step on packed weights."""
import json

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.cache.memory_plan import weights_bytes
from engine.layers import packed_linear
from engine.loading.loader import load_model
from engine.loading.synthetic import write_checkpoint
from engine.models.llama import Linear
from engine.runtime.cpu_dtype import cpu_key, fastest
from engine.runtime.model_runner import prepare_model
from tests.kernels_required import skip_unless_runs

pytestmark = pytest.mark.skipif(not packed_linear.AVAILABLE, reason="this torch has no oneDNN linear")


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {tied: write_checkpoint(root / ("tied" if tied else "untied"), {"preset": "tiny", "tie_word_embeddings": tied},
                                   seed=3)
            for tied in (False, True)}


def test_a_packed_weight_gives_the_plain_weights_result_and_comes_back_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 64, generator=gen), torch.randn(5, 64, generator=gen)
    packed = packed_linear.pack(weight)
    assert torch.equal(packed_linear.unpack(packed), weight)
    assert torch.allclose(packed_linear.linear(x, packed, None), F.linear(x, weight), atol=1e-5)


def test_bf16_rows_do_not_depend_on_how_many_rows_a_pass_has():
    """A verify pass (k + 1 rows) computes each row as a decode step (1 row) would."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(576, 576, generator=gen).bfloat16()
    x = torch.randn(5, 576, generator=gen).bfloat16()
    packed = packed_linear.pack(weight)
    together = packed_linear.linear(x, packed, None)
    alone = torch.cat([packed_linear.linear(x[i:i + 1], packed, None) for i in range(5)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("tied", [False, True])
def test_packing_frees_the_plain_weights_and_keeps_logits_and_byte_counts(tiny_folders, tied):
    plain = load_model(str(tiny_folders[tied]))
    packed = load_model(str(tiny_folders[tied]))
    before = weights_bytes(packed.model)
    prepare_model(packed.model, torch.device("cpu"))
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert len(packed.model.packed_weights) == len(linears) == 4 * 2 + 1
    head = packed.model.lm_head
    head_bytes = head.packed.numel() * head.packed.element_size()
    # Every linear's parameter is now a meta tensor (no memory), except a head tied to the
    # embedding, which keeps its plain rows for the lookup and holds a packed copy beside them.
    assert all(m.weight.is_meta for m in linears if m is not head)
    assert head.weight.is_meta == (not tied)
    assert weights_bytes(packed.model) == before + (head_bytes if tied else 0)
    for m_plain, m_packed in zip((m for m in plain.model.modules() if isinstance(m, Linear)), linears):
        assert torch.equal(m_packed.dense_weight(), m_plain.weight)
    prepare_model(packed.model, torch.device("cpu"))             # idempotent
    assert len(packed.model.packed_weights) == len(linears)

    from engine import EngineConfig, LLMEngine
    prompt = list(range(100, 140))
    outs = [LLMEngine(m, EngineConfig(num_blocks=32, compile="off"), torch.device("cpu")).generate_text(
        prompt, SamplingParams(max_tokens=8, stop_on_eos=False))[1] for m in (plain, packed)]
    assert outs[0] == outs[1]


def test_compiled_bf16_step_on_packed_weights_is_lossless_under_speculation(tiny_folders):
    """bf16 with compile on: greedy output with n-gram speculation equals greedy output without
    it, and the steps ran compiled."""
    from engine import EngineConfig, LLMEngine
    loaded = load_model(str(tiny_folders[False]), dtype=torch.bfloat16)
    eng = LLMEngine(loaded, EngineConfig(num_blocks=64, compile="on", enable_prefix_caching=False,
                                         speculation_policy="fixed"), torch.device("cpu"))
    assert eng.settings()["compile"] == "on" and eng.settings()["dtype"] == "bfloat16"
    question = eng.encode([{"role": "user", "content": "Tell me a story."}])
    greedy = SamplingParams(max_tokens=12, stop_on_eos=False)
    prompt = question + eng.generate_text(question, greedy)[1] + question
    _, plain, _ = eng.generate_text(prompt, greedy)
    eng.reconfigure(proposer="ngram", num_speculative_tokens=4)
    _, speculative, stats = eng.generate_text(prompt, greedy)
    assert speculative == plain
    assert stats.proposed > 0 and set(eng.runner.compiled.row_counts) >= {1, 5}


def test_cpu_dtype_probe_measures_once_and_survives_a_corrupt_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cpu_dtype.json"
    cache.write_text("{not json")
    calls = []
    monkeypatch.setattr(packed_linear, "_preferred", {})
    measured = {"float32": {"ours": 2.0, "onednn": 2.5}, "bfloat16": {"ours": 1.5, "onednn": 1.0}}
    monkeypatch.setattr("engine.runtime.cpu_dtype.measure", lambda: calls.append(1) or measured)
    assert fastest(cache).dtype is torch.bfloat16
    assert json.loads(cache.read_text()) == {cpu_key(): measured}
    assert fastest(cache).dtype is torch.bfloat16 and calls == [1]          # the second answer comes from the file
    # each dtype's fastest linear kernel is the one it prefers
    assert packed_linear._preferred == {torch.float32: "ours", torch.bfloat16: "onednn"}
    cache.write_text(json.dumps({cpu_key(): {"float32": {"onednn": 1.0}, "bfloat16": {"onednn": 3.0}}}))
    assert fastest(cache).dtype is torch.float32


def test_cpu_dtype_probe_times_both_dtypes():
    from engine.runtime.cpu_dtype import measure
    seconds = measure()
    assert set(seconds) == {"float32", "bfloat16"}
    assert all(s > 0 for timed in seconds.values() for s in timed.values())
    assert all(set(timed) <= set(packed_linear.BACKENDS) for timed in seconds.values())


def test_a_dtype_whose_kernels_are_missing_is_skipped_with_its_reason(tmp_path, monkeypatch):
    """The probe never crashes: a candidate whose forward pass cannot run here is not timed,
    and "In effect" says why fp32 was chosen."""
    from engine.runtime import cpu_dtype
    missing = {torch.bfloat16: "bfloat16 kernels are missing on this CPU: no bf16 here"}
    monkeypatch.setattr(cpu_dtype, "compute_refusal", lambda dtype: missing.get(dtype))
    timed = []
    monkeypatch.setattr(cpu_dtype, "probe_seconds", lambda dtype, backend: timed.append(dtype) or 1.0)
    monkeypatch.setattr(packed_linear, "_preferred", {})
    choice = fastest(tmp_path / "cpu_dtype.json")
    assert choice.dtype is torch.float32 and set(timed) == {torch.float32}
    assert "bfloat16 skipped: bfloat16 kernels are missing on this CPU: no bf16 here" in choice.why


def test_where_no_packed_kernel_runs_a_dtype_the_linear_takes_torchs_matmul_with_the_same_rows(monkeypatch):
    """The AVX2-only case without a compiler: oneDNN refuses bf16 (to pack and to run) and our
    CPU linear did not build. The weight stays plain, torch's matmul serves it, a 1-row call
    still pads to MIN_ROWS, and the row check runs on that kernel."""
    from engine.kernels import cpu_linear
    refused = "oneDNN refused bfloat16 here: bf16 path needs the cpu support avx512bw (forced by a test)"
    monkeypatch.setattr(packed_linear, "refusal", lambda dtype: refused if dtype == torch.bfloat16 else None)
    monkeypatch.setattr(cpu_linear, "refusal", lambda: "no compiler (forced by a test)")
    monkeypatch.setattr(packed_linear, "_preferred", {})
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 64, generator=gen).bfloat16(), torch.randn(17, 64, generator=gen).bfloat16()
    assert not packed_linear.packable(weight) and packed_linear.packable(weight.float())
    assert packed_linear.path(torch.bfloat16) == (f"torch matmul (ours: no compiler (forced by a test); "
                                                  f"onednn: {refused})")
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", None)     # any oneDNN call would fail now
    together = packed_linear.linear(x, weight, None)
    assert torch.equal(together, F.linear(x, weight))
    assert torch.equal(torch.cat([packed_linear.linear(x[i:i + 1], weight, None) for i in range(17)]), together)
    assert packed_linear.check_rows([weight])


def test_onednn_is_tried_before_it_serves_a_dtype():
    """On this CPU fp32 ran and matched; a dtype oneDNN is not used for is named."""
    assert packed_linear.refusal(torch.float32) is None
    assert "float32, bfloat16 only" in packed_linear.refusal(torch.float16)


def test_a_width_our_linear_cannot_take_is_packed_by_onednn_with_the_same_results(monkeypatch):
    """Our CPU linear packs whole 32-column blocks; a 40-wide weight goes to oneDNN, not to an
    unpacked call that re-lays the weight out every time."""
    from engine.kernels import cpu_linear
    skip_unless_runs(cpu_linear.refusal(), "our CPU linear")
    if packed_linear.refusal(torch.float32):
        pytest.skip(f"needs oneDNN here: {packed_linear.refusal(torch.float32)}")
    monkeypatch.setattr(packed_linear, "_preferred", {torch.float32: "ours"})
    gen = torch.Generator().manual_seed(2)
    odd, even, x = torch.randn(40, 64, generator=gen), torch.randn(64, 64, generator=gen), torch.randn(3, 64, generator=gen)
    assert packed_linear.pack(odd).is_mkldnn and packed_linear.pack(even).dim() == 3
    for weight in (odd, even):
        torch.testing.assert_close(packed_linear.linear(x, packed_linear.pack(weight), None), F.linear(x, weight),
                                   atol=1e-5, rtol=1e-5)
