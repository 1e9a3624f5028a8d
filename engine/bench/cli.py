"""The command line of `python -m engine.bench SCENARIO [--json]`: one argparse table and
the scenario registry. The scenarios themselves live beside it (scenarios.py: parity,
prefix, kv, memory, decode, speculative; kernels.py, load.py, peer.py, gpu.py).

Scenarios: parity, prefix, kv, memory, decode, speculative, kernels, load, peer, gpu-check, quality
(engine.bench.quality: what --weight-dtype costs in perplexity and greedy agreement; with
--against llama.cpp, ours beside llama.cpp on the same GGUF), agreement (engine.bench.kl_divergence:
--against llama.cpp, the KL divergence of llama.cpp's token distributions against ours on the
same file, as llama-perplexity measures it, beside the file's own against --reference),
serve (many requests at once: engine.bench.serve; with --backend URL against a server:
engine.bench.serve_remote), all. Each prints one JSON object with --json (field names are a
contract: scripts read them) and exits 0 when it ran; an error it can name (an unreachable
server, a bad option) is one line on stderr and exit code 2. Timings are medians;
comparisons are ratios measured in the same run, since the machine may be shared and noisy. Every scenario with a model runs on --model (a HF folder
or a .gguf; default: the embedded model) or --synthetic (a preset's random-weight checkpoint, written once to the
user cache), with --draft, --device and --dtype where given; a scenario that cannot take one of them says so and
exits 2 before anything runs (engine.bench.model_flags: which scenario takes which).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

import torch

from engine.bench.gpu import bench_gpu_check
from engine.bench.peer import BUSY_BUDGET_S, bench_peer
from engine.bench.quality import bench_quality
from engine.bench import kl_divergence, quality, serve, serve_remote
from engine.bench.model_flags import model_source
from engine.bench.scenarios import (BUILTIN_SHAPES, bench_decode, bench_kv, bench_memory, bench_parity, bench_prefix,
                                    bench_speculative)
from engine.config import BY_KEY
from engine.errors import WorkbenchError
from engine.loading.synthetic import PRESETS
from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS
from engine.workload import WORKLOAD_BY_KEY


def bench_kernels(args) -> dict:
    from engine.bench.kernels import run_kernel_bench
    return run_kernel_bench(model_source("kernels", args))


def bench_load(args) -> dict:
    from engine.bench.load import run_load_bench
    return run_load_bench(args.model, args.synthetic, args.device, args.dtype, args.layers)


def bench_serve(args) -> dict:
    return serve_remote.bench_serve_remote(args) if args.backend else serve.bench_serve(args)


SCENARIOS = {"parity": bench_parity, "prefix": bench_prefix, "kv": bench_kv, "memory": bench_memory,
             "decode": bench_decode, "speculative": bench_speculative, "kernels": bench_kernels,
             "load": bench_load, "peer": bench_peer, "gpu-check": bench_gpu_check, "serve": bench_serve,
             "quality": bench_quality, "agreement": kl_divergence.bench_agreement}


def exit_on_signals() -> None:
    """SIGTERM (what `timeout` and `kill` send) and SIGINT end the bench as an exception would:
    SystemExit(128 + signal) unwinds every `with` block, so each server and spinning process a
    scenario started is stopped before the process exits (engine.remote.server_process). For
    the command line (engine.bench.__main__): tests call main() inside pytest's own process."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)

NOT_IN_ALL = ("agreement",)          # needs --against and a real file


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=[*SCENARIOS, "all"])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--model", default=None, help="a HF model folder or a .gguf file (default: the embedded model)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: each scenario's own)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="weights dtype (default: each scenario's own)")
    ap.add_argument("--weight-dtype", default=None, choices=list(BY_KEY["weight_dtype"].choices),
                    help="weights as served (the weight_dtype setting; default: each scenario's own, the engine's "
                    "auto for most; parity and kv: float, the weights transformers reads); quality: the one to judge")
    ap.add_argument("--synthetic", default=None, choices=sorted(PRESETS) + sorted(SYNTHETIC_GGUF_PRESETS),
                    help="instead of --model: a random-weight checkpoint of this architecture (or a GGUF of it: "
                    "*-q4_k_m), written once to the user cache")
    ap.add_argument("--layers", type=int, default=None,
                    help="load --synthetic: write and load the preset's first N layers (default: all that fit "
                    "this machine's free memory; qwen3-30b-a3b and gpt-oss-20b do not fit whole)")
    ap.add_argument("--compile", default="auto", choices=["off", "on", "auto"],
                    help="parity, decode, speculative: run our decode and verify steps compiled "
                    "(engine.runtime.compiled_step)")
    ap.add_argument("--dry-run", action="store_true",
                    help="gpu-check: the whole script at sizes that take seconds (the tiny synthetic preset unless "
                    "--model/--synthetic; with --device cpu, on the CPU): for tests and a first look at a machine")
    ap.add_argument("--out", default=None, metavar="FOLDER",
                    help="gpu-check: also write the results to FOLDER/gpu_check.json, after every section")
    ap.add_argument("--prompts", type=int, default=8, help="parity: number of prompts")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per prompt (parity, decode, speculative)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", default="llama-server", choices=["llama-server", "vllm"],
                    help="peer: the server to compare with (vllm: scripts/build_vllm.sh installs it)")
    ap.add_argument("--peer-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="peer --engine vllm: the dtype vLLM computes in (default: the one our side runs in; "
                    "float32 is vLLM's fastest on a CPU without native bf16); llama-server has none to choose")
    ap.add_argument("--busy-cores", type=int, default=0,
                    help="peer: also decode beside this many spinning processes, in every other of --repeats rounds")
    ap.add_argument("--busy-budget-s", type=float, default=BUSY_BUDGET_S,
                    help="peer --busy-cores: the seconds its rounds may take; a reply running at the end of its "
                    "share is cut and counted for what it decoded (default %(default)s)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="prefix: system prompt length")
    ap.add_argument("--eval-tokens", type=int, default=10240, help="kv: perplexity tokens")
    ap.add_argument("--window", type=int, default=1024, help="kv: perplexity window")
    ap.add_argument("--config", default="default", help="memory: config.json folder, a .gguf, 'default', a "
                    "synthetic preset (the released model's shapes: " + ", ".join(sorted(PRESETS)) + "; or a GGUF "
                    "preset, its weights counted as stored, nothing written: "
                    + ", ".join(sorted(SYNTHETIC_GGUF_PRESETS)) + "), " + ", ".join(BUILTIN_SHAPES))
    ap.add_argument("--context", type=int, default=4096, help="memory: tokens per sequence")
    ap.add_argument("--k", type=int, default=4, help="speculative: draft tokens per step")
    ap.add_argument("--proposer", choices=["draft", "eagle", "ngram", "suffix", "auto"], default="eagle",
                    help="speculative: auto chooses each step among suffix, n-gram, the EAGLE head (where one fits) "
                    "and the draft model (with --draft), or none")
    ap.add_argument("--tree", default="off", help="speculative: the draft_tree setting (off, auto, TOPK:DEPTH:NODES)")
    ap.add_argument("--speculation-policy", default="auto", choices=list(BY_KEY["speculation_policy"].choices),
                    help="speculative: the speculation_policy setting (fixed: every step drafts k tokens, or the "
                    "whole tree)")
    ap.add_argument("--draft", default=None,
                    help="speculative: the draft model (--proposer draft; default self:8, the target's first 8 layers) or the "
                    "EAGLE head folder (--proposer eagle; default the shipped head); memory: counted in the plan")
    ap.add_argument("--prompt-set", dest="prompts_set", choices=list(WORKLOAD_BY_KEY["prompt_set"].choices), default=None,
                    help="edit: multi-turn chats that revise an earlier answer; random: serve only (--input-len random "
                    "token ids)")
    serve.add_arguments(ap)
    serve_remote.add_arguments(ap)
    quality.add_arguments(ap)
    kl_divergence.add_arguments(ap)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    names = [n for n in SCENARIOS if n not in NOT_IN_ALL] if args.scenario == "all" else [args.scenario]
    try:
        for name in names:          # every refusal before anything runs or is written
            model_source(name, args)
    except WorkbenchError as e:
        runs_all = " (all runs every scenario on the one model: run the others one by one)" if len(names) > 1 else ""
        print(f"python -m engine.bench {args.scenario}: {e}{runs_all}", file=sys.stderr)
        return 2
    try:
        results = {name: SCENARIOS[name](args) for name in names}
    except WorkbenchError as e:
        print(f"python -m engine.bench {args.scenario}: {e}", file=sys.stderr)
        return 2
    out = results if args.scenario == "all" else results[args.scenario]
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
