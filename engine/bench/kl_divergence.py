"""`python -m engine.bench agreement --against llama.cpp --model FILE.gguf`: how far our token
distributions are from llama.cpp's on the same file, measured the way llama.cpp judges a
quantized file (issue 48), and beside that file's own quantization error, so each figure has
its scale.

Counting identical greedy continuations cannot tell a fault from a near tie (engine.bench.agreement
showed every first divergence on a quantized file is a tie within 0.3 nats, and our engine
with only its K/V rounded to f16 parts from itself as often). llama.cpp judges a quantized
file by the KL divergence of its token distributions against a reference on the same text
(tools/perplexity/README.md): `llama-perplexity --kl-divergence-base FILE` saves the
reference's log-probs, `--kl-divergence` runs a model on the same tokens and reports mean KLD,
its percentiles, "same top p" and the RMS of Δp. Here llama.cpp itself computes every figure:

  1. the file's own error: llama-perplexity on --reference (the F32 file of the same model)
     writes the base; llama-perplexity on FILE against it (`file_vs_reference`). Without a
     reference the base comes from FILE itself and only its tokens are used;
  2. ours: our engine on FILE (weights as each path serves them, fp32 compute unless --dtype)
     runs llama-perplexity's protocol on the base's tokens (engine.bench.quality.protocol_logits)
     and its log-probs are written as a base file in llama.cpp's format (`write_base`);
     llama-perplexity on FILE against it gives KLD(ours || llama.cpp), "llama.cpp against
     ours", per path (`paths`).
A path is a weight_dtype (`auto`: as stored, a 4-bit GGUF as int4 and 5-8-bit types as int8
groups; `float`: dequantized) and a forced instruction set (WORKBENCH_CPU_ISA; `native`: the
widest this CPU runs); each runs in its own process, since the kernels pick their ISA at load.
`ratio_to_file_error` is ours' mean KLD over the file's own; the targets: same top token >= 98%
of positions and mean KLD <= 0.25x the file's own (or <= 0.001 nats where that is larger); on
the F32 file (passed as its own --reference) mean KLD <= 1e-4.

Each figure's scale, beside it:
  - `llama_cpp_own_noise`: llama.cpp against itself with only its attention's rounding changed
    (K/V f32, flash attention off): what any change of rounding does to these figures on a file
    whose linears round their inputs to 8 bits;
  - `from_exact`: where the float path ran (the weights dequantized, no activation rounding: the
    exact arithmetic up to fp32 sums), each side's distance from it: llama.cpp's, and each of
    our paths' (kld_between, from the two base files);
  - `ours_by_layer` (--by-layer): which of our linears makes our as-stored distance from the
    exact one (by_layer: one group of linears at a time served as stored).

llama.cpp runs as users run it (K/V in f16, flash attention auto), with the same threads as ours.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine.errors import WorkbenchError
from engine.quality.log_probs import LOG_PROB_FLOOR, compressed_log_probs, expand_log_probs, row_width

MAGIC = b"_logits_"
PATHS = ("auto", "float")
ISAS = ("native",)
SAME_TOP_TARGET, KLD_SHARE_TARGET, KLD_FLOOR, F32_TARGET = 0.98, 0.25, 0.001, 1e-4
# llama-perplexity --kl-divergence's summary lines (tools/perplexity/perplexity.cpp)
STATS = {"mean_kld": r"Mean\s+KLD:\s+(-?[\d.]+)", "kld_99": r"99\.0%\s+KLD:\s+(-?[\d.]+)",
         "kld_max": r"Maximum KLD:\s+(-?[\d.]+)", "kld_median": r"Median\s+KLD:\s+(-?[\d.]+)",
         "same_top_pct": r"Same top p:\s+(-?[\d.]+)", "rms_dp_pct": r"RMS Δp\s*:\s+(-?[\d.]+)",
         "ppl": r"Mean PPL\(Q\)\s*:\s+(-?[\d.]+)", "ppl_base": r"Mean PPL\(base\)\s*:\s+(-?[\d.]+)"}


# ---- llama.cpp's base file ------------------------------------------------------------------
def read_header(path: Path) -> tuple[int, int, int, list[int]]:
    """(n_ctx, n_vocab, n_chunk, tokens) of a --kl-divergence-base file: "_logits_", u32 n_ctx,
    i32 n_vocab, i32 n_chunk, then n_chunk x n_ctx i32 tokens (the text as llama.cpp tokenized it)."""
    with open(path, "rb") as f:
        if f.read(8) != MAGIC:
            raise WorkbenchError(f"{path} is not a llama-perplexity --kl-divergence-base file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype="<i4").tolist()
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4").tolist()
    if len(tokens) != n_ctx * n_chunk:
        raise WorkbenchError(f"{path} ends inside its tokens")
    return n_ctx, n_vocab, n_chunk, tokens


def write_base(path: Path, n_ctx: int, n_vocab: int, tokens: list[int], chunk_rows) -> None:
    """A --kl-divergence-base file of our log-probs: the header and tokens as read_header reads
    them, then each chunk's compressed_log_probs rows (n_ctx - 1 - n_ctx/2 of them)."""
    n_chunk = len(tokens) // n_ctx
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes())
        f.write(np.asarray(tokens, dtype="<i4").tobytes())
        for rows in chunk_rows:
            f.write(compressed_log_probs(rows).tobytes())


def read_chunks(path: Path):
    """Each chunk's stored log-probs read back as llama.cpp's kl_divergence reads them
    (scale * q + min_log_prob): [n_ctx - 1 - n_ctx/2, n_vocab] float64 per chunk."""
    n_ctx, n_vocab, n_chunk, tokens = read_header(path)
    rows, width = n_ctx - 1 - n_ctx // 2, row_width(n_vocab)
    offset = len(MAGIC) + 12 + 4 * len(tokens)
    for i in range(n_chunk):
        stored = np.fromfile(path, dtype="<u2", count=rows * width, offset=offset + 2 * i * rows * width)
        yield expand_log_probs(stored.reshape(rows, width), n_vocab)


def kld_between(base: Path, test: Path) -> dict:
    """Two of our base files, the second's distributions against the first's, by llama.cpp's
    formula (its log_softmax against a base): KLD = sum over tokens with log p_base > -16 of
    p_base (log p_base - log p_test), and whether the two put the same token on top. Both are
    read back from 16 bits a log-prob (a step of at most 16 / 65535 nats), which bounds what
    can be told apart here at about 1e-4 nats of mean KLD. The test side is not normalised
    again: below its floor every entry reads as the floor, and over a 49k vocabulary those
    would add up to a few thousandths of probability mass."""
    klds, same = [], []
    for p_log, q_log in zip(read_chunks(base), read_chunks(test)):
        kept = p_log > -LOG_PROB_FLOOR
        klds.extend((np.where(kept, np.exp(p_log) * (p_log - q_log), 0.0)).sum(-1).tolist())
        same.extend((p_log.argmax(-1) == q_log.argmax(-1)).tolist())
    return {"mean_kld": float(np.mean(klds)), "kld_99": float(np.percentile(klds, 99)),
            "same_top": float(np.mean(same))}


# ---- llama-perplexity -----------------------------------------------------------------------
def llama_base(model: Path, text_file: Path, base: Path, n_ctx: int, chunks: int, threads: int) -> None:
    """llama-perplexity on `model` over the text, its log-probs saved to `base`."""
    from engine.remote import llama_tools
    llama_tools.perplexity(model, text_file, n_ctx, chunks, threads=threads, extra=("--kl-divergence-base", str(base)))


def llama_against(model: Path, base: Path, n_ctx: int, threads: int, extra: tuple[str, ...] = ()) -> dict:
    """llama-perplexity on `model` against a base file: its KL divergence statistics."""
    from engine.remote import llama_tools
    from engine.remote.llama_server_binary import binary
    args = [str(binary("llama-perplexity")), "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence",
            "-c", str(n_ctx), "-b", str(n_ctx), "-t", str(threads), *extra]
    return parse_stats(llama_tools.run(args, "llama-perplexity --kl-divergence"), args)


def parse_stats(said: str, args: list[str]) -> dict:
    out = {}
    for name, pattern in STATS.items():
        found = re.search(pattern, said)
        if found is None:
            raise WorkbenchError(f"llama-perplexity printed no {name} (fewer than 100 scored tokens?): "
                                 f"{' '.join(args)}\n{said[-1500:]}")
        out[name] = float(found[1])
    out["same_top"] = out.pop("same_top_pct") / 100
    out["rms_dp"] = out.pop("rms_dp_pct") / 100
    return out


# ---- ours, one path per process -------------------------------------------------------------
def _ours(model: Path, weight_dtype: str, dtype: str):
    from engine.bench.scenarios import _engine
    return _engine(argparse.Namespace(model=str(model), dtype=dtype, device="cpu", weight_dtype=weight_dtype, draft=None),
                   enable_prefix_caching=False, compile="off")


def ours_base(model: Path, base: Path, out: Path, weight_dtype: str, dtype: str) -> dict:
    """Our engine on `model` over `base`'s tokens by llama-perplexity's protocol, written to
    `out` in llama.cpp's format. Returns what served (weights, ISA, dtype)."""
    from engine.bench.quality import _served, protocol_logits
    n_ctx, n_vocab, n_chunk, tokens = read_header(base)
    eng = _ours(model, weight_dtype, dtype)
    vocab = eng.target_model.model.config.vocab_size
    if vocab < n_vocab:
        raise WorkbenchError(f"our logits have {vocab} entries, llama.cpp's vocabulary {n_vocab}")
    rows = (r[:, :n_vocab] for _, r in protocol_logits(eng, tokens, n_ctx, n_chunk))
    write_base(out, n_ctx, n_vocab, tokens, rows)
    settings = eng.settings()
    return {"weight_dtype": settings["weight_dtype"], "dtype": settings["dtype"], "served": _served(eng),
            "isa": settings.get("paths", {}).get("isa"), "quantized": settings.get("paths", {}).get("quantized"),
            "threads": torch.get_num_threads()}


# each group of our linears, by the name its modules end with
LINEAR_GROUPS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "lm_head")


def by_layer(model: Path, base: Path, dtype: str) -> dict:
    """Which of our linears moves our as-stored distributions from the exact arithmetic (the
    weights dequantized, no activation rounding), measured: the float engine with one group
    of linears (LINEAR_GROUPS, in every layer) swapped for the as-stored engine's, KLD(exact ||
    that) and same top on `base`'s tokens, in float64 from the fp32 logits; and all swapped at once."""
    from engine.bench.quality import protocol_logits
    n_ctx, n_vocab, n_chunk, tokens = read_header(base)
    exact, stored = _ours(model, "float", dtype), _ours(model, "auto", dtype)
    reference = [torch.log_softmax(rows[:, :n_vocab].double(), -1) for _, rows in
                 protocol_logits(exact, tokens, n_ctx, n_chunk)]
    out = {}
    for group in (*LINEAR_GROUPS, "all"):
        wanted = LINEAR_GROUPS if group == "all" else (group,)
        names = [n for n, _ in exact.target_model.model.named_modules() if n.endswith(wanted)]
        swapped = {n: _swap(exact.target_model.model, n, stored.target_model.model.get_submodule(n)) for n in names}
        try:
            test = [torch.log_softmax(rows[:, :n_vocab].double(), -1) for _, rows in
                    protocol_logits(exact, tokens, n_ctx, n_chunk)]
        finally:
            for n, module in swapped.items():
                _swap(exact.target_model.model, n, module)
        out[group] = _kld_rows(reference, test)
    return out


def _swap(model, name: str, module):
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, leaf)
    setattr(owner, leaf, module)
    return old


def _kld_rows(reference: list[torch.Tensor], test: list[torch.Tensor]) -> dict:
    """llama.cpp's KLD and same top between log-prob rows (reference first)."""
    p, q = torch.cat(reference), torch.cat(test)
    kld = torch.where(p > -LOG_PROB_FLOOR, p.exp() * (p - q), torch.zeros_like(p)).sum(-1)
    return {"mean_kld": float(kld.mean()), "kld_99": float(kld.quantile(0.99)),
            "same_top": float((p.argmax(-1) == q.argmax(-1)).double().mean())}


def run_ours(model: Path, base: Path, out: Path, weight_dtype: str, isa: str, dtype: str) -> dict:
    """ours_base in a child process with the instruction set forced (none for `native`)."""
    return run_child(["--ours", str(model), str(base), str(out), weight_dtype, dtype], isa, f"{weight_dtype}, {isa}")


def run_child(args: list[str], isa: str, what: str) -> dict:
    """`python -m engine.bench.kl_divergence ARGS` with WORKBENCH_CPU_ISA forced (unless `native`):
    the kernels pick their instruction set at load, so each path is its own process."""
    import json
    env = dict(os.environ)
    env.pop("WORKBENCH_CPU_ISA", None)
    if isa != "native":
        env["WORKBENCH_CPU_ISA"] = isa
    done = subprocess.run([sys.executable, "-m", "engine.bench.kl_divergence", *args], env=env, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise WorkbenchError(f"our side ({what}) failed: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the scenario ---------------------------------------------------------------------------
CHARS_PER_TOKEN = 6        # more than English runs in these vocabularies (3-5): text to spare


def eval_text(tokens: int) -> str:
    """The first whole paragraphs of held_out_text with room for `tokens` tokens (llama-perplexity
    is told how many chunks to score; the base file's header says how many it did)."""
    from engine.workload import held_out_text
    out, size = [], 0
    for paragraph in held_out_text().split("\n\n"):
        out.append(paragraph)
        size += len(paragraph) + 2
        if size >= tokens * CHARS_PER_TOKEN:
            break
    return "\n\n".join(out)


def against_llama_cpp(model: Path, reference: Path | None, *, n_ctx: int = 512, chunks: int = 4,
                      paths=PATHS, isas=ISAS, dtype: str = "float32", threads: int | None = None,
                      noise: bool = True, layers: bool = False) -> dict:
    threads = threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="kld-") as tmp:
        tmp = Path(tmp)
        text_file, base = tmp / "eval.txt", tmp / "llama_cpp_base.bin"
        text_file.write_text(eval_text((chunks + 1) * n_ctx))
        llama_base(reference or model, text_file, base, n_ctx, chunks, threads)
        file_error = llama_against(model, base, n_ctx, threads) if reference else None
        rows, ours = [], {}
        for isa in isas:
            for weight_dtype in paths:
                ours[isa, weight_dtype] = tmp / f"ours-{isa}-{weight_dtype}.bin"
                served = run_ours(model, base, ours[isa, weight_dtype], weight_dtype, isa, dtype)
                rows.append({"path": weight_dtype, "isa_forced": isa, **served,
                             **judge(llama_against(model, ours[isa, weight_dtype], n_ctx, threads), file_error,
                                     model, reference)})
        exact = _from_exact(rows, ours)
        own_noise = _llama_cpp_own_noise(model, text_file, tmp, n_ctx, chunks, threads) if noise else None
        ours_by_layer = run_child(["--by-layer", str(model), str(base), dtype], "native", "by layer") if layers else None
        _, n_vocab, n_chunk, _ = read_header(base)
    return {"model": str(model), "reference": str(reference) if reference else None, "against": "llama.cpp",
            "measure": "llama-perplexity --kl-divergence: KLD(ours || llama.cpp) per scored position",
            "n_ctx": n_ctx, "chunks": n_chunk, "scored_tokens": n_chunk * (n_ctx - 1 - n_ctx // 2),
            "n_vocab": n_vocab, "threads": threads, "dtype": dtype, "eval_text": "pydoc_data.topics (ships with Python)",
            "file_vs_reference": file_error, "llama_cpp_own_noise": own_noise, "from_exact": exact,
            "ours_by_layer": ours_by_layer,
            "paths": rows, "all_pass": all(r["pass"] for r in rows)}


def _llama_cpp_own_noise(model: Path, text_file: Path, tmp: Path, n_ctx: int, chunks: int, threads: int) -> dict:
    """KLD(llama.cpp as users run it || llama.cpp with K/V f32 and flash attention off) on the
    file: how far llama.cpp's own figures move at a change of its attention's rounding alone,
    the scale for "same top"."""
    from engine.bench.quality import LLAMA_KV_F32
    base = tmp / "llama_cpp_self.bin"
    llama_base(model, text_file, base, n_ctx, chunks, threads)
    return {"against": "llama.cpp with " + " ".join(LLAMA_KV_F32), **llama_against(model, base, n_ctx, threads,
                                                                                     LLAMA_KV_F32)}


def _from_exact(rows: list[dict], ours: dict) -> dict | None:
    """Where the float path ran (the file's weights dequantized, no activation rounding: the
    exact arithmetic, up to fp32 sums), each side's distance from it: llama.cpp's is that row's
    figure, each of our other paths' is computed here from the two base files (kld_between)."""
    exact = {isa: path for (isa, weight_dtype), path in ours.items() if weight_dtype == "float"}
    if not exact:
        return None
    out = {"llama_cpp": {r["isa_forced"]: {"mean_kld": r["llama_cpp_vs_ours"]["mean_kld"],
                                           "same_top": r["llama_cpp_vs_ours"]["same_top"]}
                         for r in rows if r["path"] == "float"}}
    for (isa, weight_dtype), path in ours.items():
        if weight_dtype != "float" and isa in exact:
            out[f"ours_{weight_dtype}_{isa}"] = kld_between(exact[isa], path)
    return out


def judge(ours: dict, file_error: dict | None, model: Path, reference: Path | None) -> dict:
    """The issue's targets on one path's figures."""
    if reference is not None and Path(model).resolve() == Path(reference).resolve():
        bound = F32_TARGET                   # the reference file itself: one distribution
    elif file_error is not None:
        bound = max(KLD_SHARE_TARGET * file_error["mean_kld"], KLD_FLOOR)
    else:
        bound = KLD_FLOOR
    ratio = ours["mean_kld"] / file_error["mean_kld"] if file_error and file_error["mean_kld"] > 0 else None
    return {"llama_cpp_vs_ours": ours, "ratio_to_file_error": ratio, "kld_bound": bound,
            "pass": ours["same_top"] >= SAME_TOP_TARGET and ours["mean_kld"] <= bound}


def bench_agreement(args) -> dict:
    """The `agreement` scenario: --against llama.cpp --model FILE.gguf (or --synthetic PRESET-q4_k_m)
    [--reference F32.gguf]."""
    from engine.bench.model_flags import model_path
    against = getattr(args, "against", None) == "llama.cpp"
    path = model_path(args) if against else None          # --model, or --synthetic's GGUF
    if not against or not path or not str(path).endswith(".gguf"):
        raise WorkbenchError("agreement needs --against llama.cpp --model FILE.gguf (or a GGUF --synthetic preset; "
                             "python -m engine.bench.real_files lists the real files; --reference their F32 file)")
    reference = Path(args.reference).expanduser() if getattr(args, "reference", None) else None
    return against_llama_cpp(Path(path).expanduser(), reference, n_ctx=args.window,
                             chunks=max(1, args.eval_tokens // args.window),
                             paths=tuple(args.paths.split(",")), isas=tuple(args.isa.split(",")),
                             dtype=args.dtype or "float32", layers=args.by_layer)


def add_arguments(ap) -> None:
    ap.add_argument("--reference", default=None,
                    help="agreement: the F32 GGUF of the same model, llama.cpp's reference for the file's own error")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="agreement: our weight_dtype paths, comma-separated (auto = as stored, float, int8, int4)")
    ap.add_argument("--by-layer", action="store_true",
                    help="agreement: also which of our linears moves our as-stored distributions from the exact "
                    "arithmetic (by_layer)")
    ap.add_argument("--isa", default=",".join(ISAS),
                    help="agreement: instruction sets to force on our side (native, avx2, avx_vnni, scalar)")


if __name__ == "__main__" and sys.argv[1:2] == ["--ours"]:
    import json
    model_, base_, out_, weight_dtype_, dtype_ = sys.argv[2:7]
    print(json.dumps(ours_base(Path(model_), Path(base_), Path(out_), weight_dtype_, dtype_)))
elif __name__ == "__main__" and sys.argv[1:2] == ["--by-layer"]:
    import json
    model_, base_, dtype_ = sys.argv[2:5]
    print(json.dumps(by_layer(Path(model_), Path(base_), dtype_)))
