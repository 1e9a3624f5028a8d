"""What a compiled step's layers fold into our ops (engine/kernels/cpu_fused.h, cpu_decoder.cpp):
our quantized linear applies an RMSNorm or a SwiGLU gate to its input rows and adds a residual
to its output, with the unfused modules' roundings (bf16: their bits), on every instruction set
this CPU runs; our C++ attention rotates q and k as apply_rope does; a Llama model's layers run
as one op call (decoder_stack), with the per-layer graph's bits and eager's tokens; a bad
combination is refused with a clear message."""
import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams, cpu_features
from engine.cache.kv_cache import FP8_DTYPE, CacheShape, KVCache
from engine.kernels import cpu_attention, cpu_decoder, cpu_quant
from engine.kernels.cpu_quant import Fused
from engine.layers import attention_op, quantized_linear, sampler
from engine.layers.attention import CPU, SeqSlice, prepare
from engine.models import llama
from engine.models.llama import RMSNorm, apply_rope
from tests.conftest import engine_factory
from tests.kernels_required import every_test_needs

_needs_kernel = every_test_needs(cpu_quant.refusal, "our quantized CPU linear")
GREEDY = SamplingParams(max_tokens=12, stop_on_eos=False)


def _weight(out: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (out, k), generator=gen)
    d = (torch.rand(out, k // 32, generator=gen) / 8 + 1e-3).half().float()
    m = (torch.randn(out, k // 32, generator=gen) / 8).half().float()
    return cpu_quant.pack(u, d, m, 4)


def _paths() -> list[str]:
    """Every instruction-set path of our linear this CPU runs."""
    return [isa for isa, needs in cpu_quant.NEEDS.items() if all(f in cpu_features.flags() for f in needs)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_fused_linear_gives_the_modules_result_on_every_path(dtype):
    w, scales = _weight(64, 576)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 576, generator=gen) * 3).to(dtype)
    gated = (torch.randn(5, 2 * 576, generator=gen) * 3).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    gate, up = gated.chunk(2, dim=-1)
    unfused = {"norm": cpu_quant.linear(norm(x), w, scales, None, 4) + residual,
               "gate": cpu_quant.linear(F.silu(gate) * up, w, scales, None, 4) + residual}
    inputs = {"norm": (x, Fused(norm.weight, 1e-5, residual=residual)), "gate": (gated, Fused(glu=True, residual=residual))}
    for name, (given, fused) in inputs.items():
        by_path = {isa: torch.ops.workbench_cpu.linear_q(given, w, scales, None, 4, 32, cpu_quant.ISAS[isa], *fused)
                   for isa in _paths()}
        for isa, got in by_path.items():
            assert torch.equal(got, by_path["scalar"]), f"{name}: {isa} rounds unlike the scalar path"
        got = by_path["scalar"]
        if dtype == torch.bfloat16:
            assert torch.equal(got, unfused[name]), f"{name}: bf16 differs from the modules' roundings"
        else:       # the norm's sum and exp's last bit may differ; the int8 rows then move by one step
            torch.testing.assert_close(got, unfused[name], atol=2e-2 * unfused[name].abs().max().item(), rtol=0)


def test_a_bad_fusion_is_refused_clearly():
    w, scales = _weight(64, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="a norm or a gated activation before the product, not both"):
        cpu_quant.linear(torch.randn(2, 128), w, scales, None, 4, Fused(torch.ones(64), 1e-5, glu=True))
    with pytest.raises(RuntimeError, match=r"the residual is \[M, N\] in x's dtype"):
        cpu_quant.linear(x, w, scales, None, 4, Fused(residual=torch.zeros(2, 63)))
    with pytest.raises(RuntimeError, match=r"twice it: \[gate \| up\]"):
        cpu_quant.linear(x, w, scales, None, 4, Fused(glu=True))
    with pytest.raises(RuntimeError, match="the norm's weight is in x's dtype"):
        cpu_quant.linear(x, w, scales, None, 4, Fused(torch.ones(64, dtype=torch.bfloat16), 1e-5))


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (FP8_DTYPE, torch.bfloat16)], ids=["fp32", "bf16", "fp8"])
def test_attention_rotates_q_and_k_as_apply_rope_does(kv_dtype, q_dtype, isa):
    """Our C++ op given each row's cos and sin: apply_rope's q and k, bit for bit (the output,
    the stored keys, their FP8 scales), in each build (the AVX2 one rotates 8 lanes at a time, a
    tail of 4 lane by lane: D 72); padding rows repeat the last."""
    if cpu_attention.refusal():
        pytest.skip(cpu_attention.refusal())
    if not all(f in cpu_features.flags() for f in cpu_attention.NEEDS[isa]):
        pytest.skip(f"no {isa} on this CPU")
    cpu_attention.force_isa(isa)
    try:
        for d in (64, 72):
            _rotates_as_apply_rope(kv_dtype, q_dtype, d)
    finally:
        cpu_attention.force_isa(None)


def _rotates_as_apply_rope(kv_dtype, q_dtype, d: int):
    gen = torch.Generator().manual_seed(2)
    shape, block_size = CacheShape(2, 3, d), 4
    pools = [KVCache(shape, 10, block_size, kv_dtype, torch.device("cpu")) for _ in range(2)]
    table = torch.tensor([3, 7, 1, 0])
    seqs = [SeqSlice(start=0, count=3, context_len=11, block_table=table)]
    positions = torch.tensor([8, 9, 10])
    slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in (8, 9, 10)])
    q = (torch.randn(4, 9, d, generator=gen) * 2).to(q_dtype)           # 3 rows and one padding row
    k, v = ((torch.randn(4, 3, d, generator=gen) * 2).to(q_dtype) for _ in range(2))
    angles = torch.rand(4, 1, d // 2, generator=gen) * 6
    rope = tuple(torch.cat((f(angles), f(angles)), dim=-1).to(q_dtype) for f in (torch.cos, torch.sin))
    outs = []
    for pool, given in zip(pools, ((apply_rope(q, rope), apply_rope(k, rope), None), (q, k, rope))):
        graph = attention_op.graph_pass(pool, prepare(CPU, positions, slots, seqs, block_size, 3), True)
        assert attention_op.rotates(graph)
        outs.append(attention_op.paged_attention(given[0], given[1], v, graph, 1, 0.125, 0, None, given[2]))
    assert torch.equal(outs[0][:3], outs[1][:3]) and torch.equal(outs[1][3], outs[1][2])
    for got, want in ((pools[1].k, pools[0].k), (pools[1].k_scale, pools[0].k_scale)):
        if want is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.fixture(scope="module")
def tiny_int4(tiny_model):
    """The tiny Llama with int4 weights our kernel serves (its layers can run as one op)."""
    from engine.loading.loader import load_model
    return load_model(str(tiny_model.folder), weight_dtype="int4")


def _logits(eng, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    seen, greedy = [], sampler.greedy

    def recording(logits):
        seen.append(logits.detach().clone())
        return greedy(logits)
    sampler.greedy = recording
    try:
        tokens = [eng.generate_text(eng.encode(p), GREEDY)[1] for p in prompts]
    finally:
        sampler.greedy = greedy
    return tokens, seen


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8_DTYPE], ids=["fp32", "fp8"])
def test_the_layers_as_one_op_are_the_per_layer_ops_bit_for_bit(tiny_int4, monkeypatch, kv_dtype):
    """decoder_stack against the per-layer ops it calls (both run eagerly over the graph's pass):
    the same hidden states and the same pool bytes, for a prompt of 5 rows and then a decode row."""
    if cpu_attention.refusal():
        pytest.skip(cpu_attention.refusal())
    model = tiny_int4.model
    key = quantized_linear.register_graph_weights(
        [m for m in model.modules() if getattr(m, "quant", None) is not None and hasattr(m, "quant_indices")])
    quantized_linear.use(key)
    block_size, table = 4, torch.tensor([2, 0, 3])
    pools = [KVCache(model.cache_shape, 4, block_size, kv_dtype, torch.device("cpu")) for _ in range(2)]
    ids = [[5, 900, 17, 4000, 23], [77]]
    dtype = model.embed_tokens.weight.dtype
    plan = llama.LlamaFamilyModel.stack_plan
    hidden = []
    try:
        for pool, stacked in zip(pools, (True, False)):
            monkeypatch.setattr(llama.LlamaFamilyModel, "stack_plan", plan if stacked else (lambda *a: None))
            for start, rows in ((0, ids[0]), (5, ids[1])):
                positions = torch.arange(start, start + len(rows))
                slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in positions.tolist()])
                meta = prepare(CPU, positions, slots, [SeqSlice(0, len(rows), table, start + len(rows))], block_size,
                               model.config.num_attention_heads // model.config.num_key_value_heads)
                graph = attention_op.graph_pass(pool, meta, True)
                assert attention_op.rotates(graph) and isinstance(plan(model, dtype), cpu_decoder.Stack)
                hidden.append(model.decode_layers(model.embed_tokens(torch.tensor(rows)), positions, None, graph))
    finally:
        cpu_quant.forget(key)
    assert torch.equal(hidden[0], hidden[2]) and torch.equal(hidden[1], hidden[3])
    for got, want in ((pools[0].k, pools[1].k), (pools[0].v, pools[1].v), (pools[0].k_scale, pools[1].k_scale)):
        if want is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "fp8_e4m3")])
def test_a_compiled_step_runs_the_layers_as_one_op_with_the_same_tokens(tiny_int4, monkeypatch, dtype, kv):
    """Compiled, every pass (prefill and decodes) is one decoder_stack call: the per-layer graph's
    tokens, its logits up to the final norm's summation order (inductor's, per graph); fp32:
    eager's tokens too."""
    if cpu_attention.refusal():
        pytest.skip(cpu_attention.refusal())
    make = engine_factory(tiny_int4, 8 * 2**20)
    prompts = ["Write a short poem about the sea.", "List three prime numbers."]
    planned = []
    plan = llama.LlamaFamilyModel.stack_plan
    monkeypatch.setattr(llama.LlamaFamilyModel, "stack_plan", lambda *a: planned.append(plan(*a)) or planned[-1])
    stacked = _logits(make(dtype=dtype, kv_cache_dtype=kv, compile="on"), prompts)
    assert planned and all(isinstance(p, cpu_decoder.Stack) for p in planned)
    assert len(planned[-1].weights) == 4 * 2 and len(planned[-1].norms) == 2 * 2
    monkeypatch.setattr(llama.LlamaFamilyModel, "stack_plan", lambda *a: None)
    per_layer = _logits(make(dtype=dtype, kv_cache_dtype=kv, compile="on"), prompts)
    assert stacked[0] == per_layer[0]
    for a, b in zip(stacked[1], per_layer[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if dtype == "float32":
        assert stacked[0] == _logits(make(dtype=dtype, kv_cache_dtype=kv, compile="off"), prompts)[0]
