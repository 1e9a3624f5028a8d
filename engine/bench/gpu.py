"""`python -m engine.bench gpu-check --json`: everything that needs a GPU, in one short run
(well under two minutes on a data-centre GPU), for the day a device is lent.

Everything runs on --model or --synthetic (default: the embedded model).
1. kernels: the Triton decode-attention bench (achieved vs copy bandwidth; at the named
   model's attention shape, engine.bench.kernels);
2. parity: greedy output of the Triton-kernel eager path, the compiled step (torch.compile,
   CUDA graphs) and transformers agree, bf16, on a few prompts;
3. speed: decode tok/s of each path against transformers `generate` in bf16;
4. batching: the prompts submitted at once through the eager Triton path give their solo
   tokens (`batched_equals_solo`; cuBLAS is not known to be row-invariant, so this may say
   false: the CPU path is the one tested invariant), and their output tok/s;
5. graphs: 1, 4 and 16 requests at once through the compiled step (CUDA graphs of the pieces
   between attention calls, one per token-count bucket) against the eager path: output tok/s
   of each, their ratio, how many requests got the eager path's tokens, whether the compiled
   step stayed on, and the CUDA graphs recorded.
Without CUDA it says so and exits 0.
"""
from __future__ import annotations

import time

import torch

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three primes.")
TOKENS = 48


def bench_gpu_check(args) -> dict:
    if not torch.cuda.is_available():
        return {"cuda": False, "message": "no CUDA on this machine: the GPU checks did not run"}
    from engine.bench.kernels import run_kernel_bench
    from engine.bench.model_flags import source_of
    result = {"cuda": True, "device": torch.cuda.get_device_name(), "kernels": run_kernel_bench(source_of(args))}
    outputs, speeds, loads = {}, {}, {}
    for name, compile_mode in (("eager_kernels", "off"), ("compiled", "on")):
        eng = _engine(args, compile_mode)
        outputs[name], speeds[name] = _generate_all(eng)
        result[f"{name}_settings"] = {k: eng.settings()[k] for k in ("kernels", "compile", "dtype")}
        if name == "eager_kernels":
            result["batching"] = _batched(eng, outputs[name])
        loads[name] = {n: _under_load(eng, n) for n in LOAD_LEVELS}
        if name == "compiled":
            result["graphs"] = _graphs_report(eng, loads)
        del eng
        torch.cuda.empty_cache()
    outputs["transformers"], speeds["transformers"] = _transformers(args)
    reference = outputs["transformers"]
    result["greedy_identical_to_transformers"] = {name: out == reference for name, out in outputs.items()}
    result["decode_tok_s"] = speeds
    return result


def _engine(args, compile_mode: str):
    from engine import EngineConfig, LLMEngine
    from engine.bench.model_flags import model_path
    config = EngineConfig(device="cuda", dtype="bfloat16", compile=compile_mode, enable_prefix_caching=False)
    return LLMEngine.load(model_path(args), config)


def _generate_all(eng) -> tuple[list[list[int]], float]:
    from engine import SamplingParams
    params = SamplingParams(max_tokens=TOKENS, stop_on_eos=False)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    eng.generate_text(chats[0], params)                           # warm-up (and compile)
    outputs, tokens, seconds = [], 0, 0.0
    for messages in chats:
        _, ids, stats = eng.generate_text(messages, params)
        outputs.append(ids)
        tokens += stats.decode_tokens
        seconds += stats.decode_time_s
    return outputs, tokens / seconds


def _batched(eng, solo: list[list[int]]) -> dict:
    """The prompts at once, through the engine's scheduler: the same tokens as alone?"""
    together = _under_load(eng, len(PROMPTS))
    return {"batched_equals_solo": together["tokens"] == solo, "output_tok_s": together["output_tok_s"]}


LOAD_LEVELS = (1, 4, 16)


def _under_load(eng, n: int) -> dict:
    """n requests at once (the prompts in turn): their tokens and output tok/s."""
    from engine import SamplingParams
    params = SamplingParams(max_tokens=TOKENS, stop_on_eos=False)
    eng.reset_prefix_cache()
    ids = [eng.submit([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], params) for i in range(n)]
    got = {rid: [] for rid in ids}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.has_work:
        for event in eng.step():
            got[event.request_id].extend(event.token_ids)
    torch.cuda.synchronize()
    return {"tokens": [got[rid] for rid in ids], "output_tok_s": sum(map(len, got.values())) / (time.perf_counter() - t0)}


def _graphs_report(eng, loads: dict) -> dict:
    """The compiled step under 1, 4 and 16 requests against the eager path's run of the same."""
    eager, compiled = loads["eager_kernels"], loads["compiled"]
    rows = {}
    for n in LOAD_LEVELS:
        same = sum(a == b for a, b in zip(compiled[n]["tokens"], eager[n]["tokens"]))
        rows[n] = {"compiled_tok_s": compiled[n]["output_tok_s"], "eager_tok_s": eager[n]["output_tok_s"],
                   "ratio": compiled[n]["output_tok_s"] / eager[n]["output_tok_s"],
                   "requests_with_eager_tokens": f"{same}/{n}"}
    from torch._dynamo.utils import counters
    cudagraph_counters = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    return {"levels": rows, "compile": eng.settings()["compile"], "inductor_cudagraph_counters": cudagraph_counters}


def _timed_generate(hf, ids, tokens: int):
    with torch.inference_mode():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _transformers(args) -> tuple[list[list[int]], float]:
    from transformers import AutoTokenizer
    from engine.bench.model_flags import model_path
    from engine.loading.loader import resolve, transformers_model
    folder = resolve(model_path(args))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = transformers_model(folder, dtype=torch.bfloat16).to("cuda").eval()
    outputs, tokens, seconds = [], 0, 0.0
    _timed_generate(hf, torch.tensor([[1, 2, 3]], device="cuda"), 2)      # warm-up
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device="cuda")
        one, _ = _timed_generate(hf, ids, 1)
        full, out = _timed_generate(hf, ids, TOKENS)
        seconds += full - one                  # decode time: TTFT excluded, as for ours
        outputs.append(out[0, ids.shape[1]:].tolist())
        tokens += TOKENS - 1
    return outputs, tokens / seconds
