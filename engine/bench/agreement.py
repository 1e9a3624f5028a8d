"""`python -m engine.bench.agreement --model FILE.gguf`: why our greedy tokens part from
llama-server's on a quantized file (issue 40), measured. A diagnostic: nothing here serves.

Both engines compute with the file's weights as stored and quantize each linear's input to
8 bits before an integer dot product, each its own way. Ours: int8 per row in blocks of 32,
scale amax / 127 in fp32, for every format. llama.cpp's CPU backend (ggml-cpu.c,
type_traits_cpu[type].vec_dot_type): Q8_K for the K-quants (blocks of 256, the integers
round(-127 / max * x) against the block's signed largest value, clamped to 127, the scale
1 / iscale in fp32: quantize_row_q8_K_ref, which x86 calls as is), Q8_0 for Q4_0, Q5_0 and
Q8_0, Q8_1 for Q4_1 and Q5_1 (blocks of 32, the integers round(x * 127 / amax), the scale
amax / 127 rounded to fp16). The integers of the 32-blocks are ours; the 256-blocks are
coarser. Its K/V are f16.

For each chat prompt this runs, on the same prompt ids:
  - llama-server's greedy reply (as users run it: K/V f16, flash attention auto, 1 thread);
  - ours as served (weights as stored, fp32 compute);
  - the reference: the same file's weights dequantized (weight_dtype float), fp32, no
    activation rounding, K/V fp32;
  - `emulated`: the reference with each linear's input fake-quantized as llama.cpp's
    vec_dot_type for that tensor's type in the file (fused linears by their parts), and
    the same with K/V in float16 (`emulated_kv_f16`).
At each first divergence between ours and llama-server: which of the two tokens the
reference prefers, and the reference's own top-2 log-prob margin there (a near tie, a few
hundredths of a nat, is one any rounding flips). Then agreement (prompts of 10 whose 32 tokens
all agree) of each arm with llama-server.

The fake quantization runs in Python over the dequantized weights (each arm's linear replaced
on the loaded model, never in the kernels); it does not copy llama.cpp's block-wise fp32
accumulation order, Q8_1's fp16 block sums or its flash attention's f16 arithmetic, only its
rounding of the activations.

`agree_pairs` measures how far a tiny change carries: our own engine beside itself with only
its K/V rounded to float16 (`ours / ours_kv_f16`). With 8-bit activations a change in the last
bits of a linear's input flips some roundings by a whole step, and the flips compound layer by
layer: on the F32 file that change leaves 10 of 10 replies as they were, on the K-quant files
it parts 6-8 of 10 (docs/benchmarks.md, "Quantized weights and agreement with llama.cpp"). Two engines that are not
bit-identical agree no better than that, whichever rounding each uses.
"""
from __future__ import annotations

import argparse
import json
import sys
import types

import torch
import torch.nn.functional as F

QK_K, QK8 = 256, 32
K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}
# our modules' linears -> the file's tensors, in the fused rows' order
PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
         "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


# ---- llama.cpp's activation rounding, as fake quantization ------------------------------------
def fake_q8_K(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_K_ref then dequantized: per block of 256, iscale = -127 / max (max the
    block's value of largest magnitude, sign kept), q = min(127, nearest_int(iscale * x)),
    d = 1 / iscale (fp32)."""
    n, k = x.shape
    b = x.float().reshape(n, k // QK_K, QK_K)
    big = b.gather(-1, b.abs().argmax(-1, keepdim=True))               # [n, blocks, 1]
    iscale = torch.where(big != 0, -127.0 / big, torch.zeros_like(big))
    q = torch.round(iscale * b).clamp(max=127.0)                       # nearest_int: ties to even
    d = torch.where(big != 0, 1.0 / iscale, torch.zeros_like(big))
    return (q * d).reshape(n, k).to(x.dtype)


def fake_q8_0(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0 / q8_1 on x86 then dequantized: per block of 32, q = round(x * 127 /
    amax) (ties to even, the AVX rounding), d = amax / 127 stored in fp16."""
    n, k = x.shape
    b = x.float().reshape(n, k // QK8, QK8)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    d = (amax / 127.0).half().float()
    return (torch.round(b * inv) * d).reshape(n, k).to(x.dtype)


def vec_dot_rounding(tensor_type: str):
    """The activation rounding llama.cpp's CPU dot product takes for weights of this type."""
    if tensor_type in K_QUANTS:
        return fake_q8_K
    if tensor_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return fake_q8_0
    return None                      # F32 / F16 / BF16: float activations (F16: rounded to f16)


def tensor_types(gguf_path) -> dict[str, tuple[str, int]]:
    """Each tensor's stored type and rows (output features): {"blk.3.attn_q": ("Q8_0", 576), ...}."""
    from gguf import GGUFReader
    return {t.name.removesuffix(".weight"): (t.tensor_type.name, int(t.shape[-1]) if len(t.shape) > 1 else 1)
            for t in GGUFReader(str(gguf_path)).tensors}


class Emulation:
    """Replaces each linear of a model loaded with dequantized weights by one that rounds its
    input as llama.cpp does for that weight's stored type (each fused part its own way)."""

    def __init__(self, model, stored: dict[str, tuple[str, int]]):
        self.model, self.stored = model, stored
        self.plans = {}            # module -> (its dense weight, [(rows, rounding)] per fused part)
        for i, layer in enumerate(model.layers):
            for path, parts in PARTS.items():
                module = layer.get_submodule(path)
                kinds = [stored[f"blk.{i}.{p}"] for p in parts]
                self.plans[module] = (module.dense_weight().float().clone(),
                                      [(rows, vec_dot_rounding(kind)) for kind, rows in kinds])
                assert sum(rows for _, rows in kinds) == module.weight.shape[0], path
        head = "output" if "output" in stored else "token_embd"
        self.plans[model.lm_head] = (model.lm_head.dense_weight().float().clone(),
                                     [(model.lm_head.weight.shape[0], vec_dot_rounding(stored[head][0]))])

    @property
    def types(self) -> set[str]:
        return {kind for kind, _ in self.stored.values()}

    def __enter__(self):
        for module, (weight, parts) in self.plans.items():
            module.forward = types.MethodType(_emulated_forward(weight, parts), module)
        return self

    def __exit__(self, *exc):
        for module in self.plans:
            module.__dict__.pop("forward", None)


def _emulated_forward(weight: torch.Tensor, parts: list[tuple[int, object]]):
    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1]).float()
        outs, start = [], 0
        for rows, rounding in parts:
            xq = rounding(x2) if rounding is not None else x2
            outs.append(F.linear(xq, weight[start:start + rows]))
            start += rows
        y = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
    return forward


# ---- the measurement ----------------------------------------------------------------------------
def first_divergence(a: list[int], b: list[int]) -> int | None:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if at is None and len(a) != len(b):
        at = min(len(a), len(b))
    return at


def log_probs(eng, context: list[int]) -> torch.Tensor:
    runner = eng.runner
    seq = runner.start(context)
    try:
        return torch.log_softmax(runner.forward(seq, context, logits_for="last")[-1].double(), -1)
    finally:
        runner.end(seq)


def run(model_path: str, tokens: int = 32, threads: int = 1) -> dict:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.bench.scenarios import CHAT_PROMPTS, chat
    from engine.remote import llama_tools
    from engine.remote.llama_server import LlamaServer
    torch.set_num_threads(threads)
    common = dict(device="cpu", dtype="float32", compile="off", enable_prefix_caching=False)
    stored = LLMEngine.load(model_path, EngineConfig(**common))
    reference = LLMEngine.load(model_path, EngineConfig(**common, weight_dtype="float"))
    prompts = [stored.encode(chat(p)) for p in CHAT_PROMPTS]
    with LlamaServer(model_path, ctx_size=1024, threads=threads, metrics=False) as server:
        theirs = [llama_tools.greedy(server.url, p, tokens) for p in prompts]
    eos = stored.eos_ids
    params = SamplingParams(max_tokens=tokens)           # stops at EOS, as llama-server does

    def replies(eng):
        return [[t for t in eng.generate_text(p, params)[1] if t not in eos] for p in prompts]
    llama = [[t for t in r.tokens if t not in eos] for r in theirs]
    arms = {"ours": replies(stored)}
    stored.reconfigure(kv_cache_dtype="float16")        # a perturbation of ~5e-4 relative, as llama.cpp's cache
    arms["ours_kv_f16"] = replies(stored)
    arms["reference"] = replies(reference)
    emulation = Emulation(reference.target_model.model, tensor_types(model_path))
    with emulation:
        arms["emulated"] = replies(reference)
        reference.reconfigure(kv_cache_dtype="float16")
        arms["emulated_kv_f16"] = replies(reference)
        reference.reconfigure(kv_cache_dtype="auto")
    rows = []
    for prompt, ours, other, reply in zip(prompts, arms["ours"], llama, theirs):
        at = first_divergence(ours, other)
        row = {"first_divergence": at}
        if at is not None and at < min(len(ours), len(other)):
            ref = log_probs(reference, prompt + ours[:at])
            top2 = torch.topk(ref, 2)
            their = dict(reply.top_logprobs[at]) if at < len(reply.top_logprobs) else {}
            row |= {"ours": ours[at], "theirs": other[at],
                    "reference_prefers": "ours" if ref[ours[at]] > ref[other[at]] else "llama.cpp",
                    "reference_ours_minus_theirs_nats": float(ref[ours[at]] - ref[other[at]]),
                    "reference_top2_margin_nats": float(top2.values[0] - top2.values[1]),
                    "reference_top1_is": ("ours" if int(top2.indices[0]) == ours[at] else "llama.cpp"
                                          if int(top2.indices[0]) == other[at] else "neither"),
                    "llama_cpp_margin_nats": (their[other[at]] - their[ours[at]]) if ours[at] in their else None}
        rows.append(row)
    agree = {name: [first_divergence(mine, other) for mine, other in zip(reply, llama)] for name, reply in arms.items()}
    arms["llama_cpp"] = llama
    pairs = {f"{a} / {b}": [first_divergence(x, y) for x, y in zip(arms[a], arms[b])]
             for a, b in (("ours", "reference"), ("llama_cpp", "reference"), ("ours", "ours_kv_f16"),
                          ("emulated", "emulated_kv_f16"), ("reference", "emulated"))}
    parted = [r for r in rows if "reference_prefers" in r]
    return {"model": model_path, "tokens": tokens, "prompts": len(prompts),
            "agree_with_llama_cpp": {name: sum(a is None for a in v) for name, v in agree.items()},
            "first_divergence_from_llama_cpp": agree,
            # the same arithmetic twice, one side perturbed a little: how far 8-bit rounding carries it
            "agree_pairs": {name: sum(a is None for a in v) for name, v in pairs.items()},
            "first_divergence_pairs": pairs,
            "at_divergence": rows,
            "reference_prefers": {side: sum(r["reference_prefers"] == side for r in parted)
                                  for side in ("ours", "llama.cpp")},
            "tensor_types": sorted(emulation.types)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.agreement", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a quantized .gguf (python -m engine.bench.real_files lists them)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    json.dump(run(args.model, args.tokens, args.threads), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
