"""Train the EAGLE draft head for a target: `python -m engine.training.distill`.

The recipe, offline and on the CPU, from the target alone:
  1. data (engine.training.served_data): the engine's own greedy answers to a fixed, varied set
     of conversations (distill_data: subject x task chat, code requests, Python documentation
     excerpts from pydoc_data.topics, two-turn chats; each with and without the app's system
     prompt), served as a user's engine serves them (the target as loaded, int4 where it is
     stored so, compiled), 32 at a time, with the final hidden state of every position
     exactly as the proposer is handed it; kept in resumable files of 256 conversations;
  2. shape (engine.models.eagle_head): fc([embed(x_{j+1}) ; f_j]) -> one decoder layer
     initialised from the target's last layer -> the target's final norm -> the target's
     head rows for a frequency-ranked reduced vocabulary (FR-Spec: the special and byte
     tokens, then the tokens the target emits most often in the data);
  3. training, as EAGLE: smooth-L1 regression of the next hidden state plus cross-entropy to
     the target's next-token distribution (soft labels, over the reduced vocabulary: the
     target's head rows applied to its feature, so an epoch never runs the target again),
     with training-time test (EAGLE-3, HASS): the head is unrolled for `depth` steps on its
     own predicted features, attending exactly as it will at inference (true-feature keys up
     to the last accepted position, then its own guesses), so later draft positions are
     trained as they are used. The embedding is frozen. Fixed seed, data order and step
     count; the state is saved at every evaluation and a run that stops resumes there;
  4. held-out evaluation at every checkpoint: the engine's answers to conversations training
     never saw (the bench's chat prompts among them), greedy speculation at k replayed
     exactly with the unrolled head: per-position acceptance and tau, beside the same on a
     fixed sample of the training answers (their gap tells memorisation from capacity). The
     head kept is the evaluation's best on the held-out prompts no bench uses;
     `python -m engine.training.diagnose` measures a finished head further (top-k recall by
     depth, vocabulary, alignment with the proposer and the engine);
  5. the folder: config.json, model.safetensors (fp16, a few MB) and distill_report.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.loading.loader import SHIPPED_EAGLE_FOLDER, cache_dir
from engine.metrics import PositionCounts, attempted_positions, ratio
from engine.models.eagle_head import EagleHead, eagle_config, save_eagle, weights_fingerprint
from engine.models.llama import Linear, apply_rope
from engine.training.distill_data import HELD_OUT_PROMPTS, Sequence
from engine.workload import CHAT_PROMPTS

BENCH_PROMPTS = set(CHAT_PROMPTS)      # a bench's prompts: never used to pick the kept checkpoint


@dataclass
class Recipe:
    seed: int = 0
    conversations: int = 5632       # training conversations (distill_data.served_conversations)
    max_new_tokens: int = 256
    concurrency: int = 32           # requests the engine serves at once while making the data
    serve_dtype: str = "float32"    # the engine's dtype for the data ("auto": its own timing's pick)
    head_vocab: int = 8192
    depth: int = 3                  # training-time test: draft steps unrolled per position
    steps: int = 1200
    batch_size: int = 16            # sequences per step
    lr: float = 2e-3
    reg_weight: float = 0.2         # smooth-L1 on the next hidden state (EAGLE-1: 1.0)
    cls_weight: float = 1.0         # cross-entropy to the target's distribution (EAGLE-1: 0.1)
    eval_every: int = 100
    k: int = 4


# ---- the head ---------------------------------------------------------------------------------------
def build_head(target, head_token_ids: torch.Tensor) -> EagleHead:
    """fc passes the feature through (identity on its half, small random on the embedding's);
    the layer and norm are copies of the target's last layer and final norm."""
    info = {"target": target.display_name, "target_fingerprint": weights_fingerprint(target.model),
            "head_vocab": len(head_token_ids)}
    src = target.model
    with torch.device("meta"):
        head = EagleHead(eagle_config(target.hf_config, info), len(head_token_ids), max_positions=src.max_positions)
    head.materialize()
    layer = src.layers[-1].state_dict()         # a packed target's linears: their dense weights
    layer.update({f"{name}.weight": m.dense_weight() for name, m in src.layers[-1].named_modules() if isinstance(m, Linear)})
    head.load_state_dict({f"layers.0.{k}": v.detach().float().clone() for k, v in layer.items()}, strict=False)
    hidden = src.config.hidden_size
    with torch.no_grad():
        head.norm.weight.copy_(src.norm.weight.float())
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.weight[:, :hidden].normal_(0.0, 0.02)
        head.head_token_ids.copy_(head_token_ids)
    head = head.float()
    head.attach_target(src)
    return head


def choose_head_vocab(train: list[Sequence], vocab_size: int, size: int, pinned_ids) -> torch.Tensor:
    """FR-Spec: the `size` most frequent tokens of the target's answers (ties by id), the pinned
    ones (special and byte tokens, pinned_tokens) first; sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in train:
        counts.index_add_(0, torch.tensor(s.answer_ids), torch.ones(len(s.answer_ids), dtype=torch.float64))
    for tid in pinned_ids:
        counts[tid] = float("inf")
    order = sorted(range(vocab_size), key=lambda i: (-float(counts[i]), i))
    return torch.tensor(sorted(order[:min(size, vocab_size)]), dtype=torch.int64)


def pinned_tokens(tokenizer) -> list[int]:
    """Tokens the head always holds: the special tokens, and the byte-level tokens a text can
    always fall back on (those whose token string is one character)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for tok, i in tokenizer.get_vocab().items() if len(tok) == 1)
    return sorted(ids)


# ---- the unrolled forward (training and evaluation) ------------------------------------------------
def batched_qkv(layer, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer's q, k, v for [B, N, hidden] inputs, normed and rotated: [B, N, H, D]."""
    a = layer.self_attn
    b, n, _ = h.shape
    q, k, v = a.qkv_proj(layer.input_layernorm(h)).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
    q = q.view(b, n, a.num_heads, a.head_dim)
    k = k.view(b, n, a.num_kv_heads, a.head_dim)
    v = v.view(b, n, a.num_kv_heads, a.head_dim)
    if a.qk_norm:
        q, k = a.q_norm(q), a.k_norm(k)
    return apply_rope(q, rope), apply_rope(k, rope), v


def unrolled(head: EagleHead, tokens: torch.Tensor, feats: torch.Tensor, depth: int, detach: bool = True) -> list[torch.Tensor]:
    """tokens [B, T+depth] (x_1.. : tokens[:, j] = x_{j+1}), feats [B, T, H] (f_0..f_{T-1}).
    Returns g^(1..depth), each [B, T, H]: g^(d)[:, j] is the head's guess at f_{j+d} after
    d draft steps from the last true position j. Step d's query at j attends to the true
    entries 0..j and to steps 2..d's own entries at j, as the proposer's cache holds them."""
    b, t, _ = feats.shape
    layer = head.layers[0]
    levels: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs, g = [], feats
    for d in range(depth):
        x = head.fc(torch.cat([head.embed_tokens(tokens[:, d:d + t]), g.to(head.fc.weight.dtype)], dim=-1))
        positions = torch.arange(d, d + t)
        cos = head.rotary.cos[positions].to(x.dtype)[None, :, None, :]
        sin = head.rotary.sin[positions].to(x.dtype)[None, :, None, :]
        h, kv = _layer(layer, x, (cos, sin), levels)
        levels.append(kv)
        g = head.norm(h)
        outs.append(g)
        if detach:
            g = g.detach()
    return outs


def _layer(layer, x, rope, levels):
    a = layer.self_attn
    b, t, _ = x.shape
    q, k, v = batched_qkv(layer, x, rope)
    if not levels:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=a.scale, enable_gqa=True).transpose(1, 2)
    else:
        group = a.num_heads // a.num_kv_heads
        rep = lambda z: z.repeat_interleave(group, dim=2)          # noqa: E731  [B, T, Hq, D]
        base_k, base_v = levels[0]
        scores = torch.einsum("bthd,bshd->bhts", q, rep(base_k)) * a.scale          # [B, Hq, T, T]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag_k = [kk for kk, _ in levels[1:]] + [k]
        diag_v = [vv for _, vv in levels[1:]] + [v]
        diag = torch.stack([(q * rep(kk)).sum(-1) for kk in diag_k], dim=-1) * a.scale   # [B, T, Hq, m]
        probs = torch.cat([scores, diag.permute(0, 2, 1, 3)], dim=-1).softmax(-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("bhts,bshd->bthd", probs[..., :t], rep(base_v))
        for m, vv in enumerate(diag_v):
            out = out + probs[..., t + m].permute(0, 2, 1).unsqueeze(-1) * rep(vv)
    h = x + a.o_proj(out.reshape(b, t, a.q_size))
    return h + layer.mlp(layer.post_attention_layernorm(h)), (k, v)


def _batch(seqs: list[Sequence], depth: int):
    """Right-padded tokens [B, T+depth+1] (x_1..), features [B, T, H], and per row the number
    of features and the prompt length."""
    t = max(len(s.features) for s in seqs)
    hidden = seqs[0].features.shape[1]
    tokens = torch.zeros(len(seqs), t + depth + 1, dtype=torch.int64)
    feats = torch.zeros(len(seqs), t, hidden)
    lengths = torch.tensor([[len(s.features), len(s.prompt_ids)] for s in seqs])
    for i, s in enumerate(seqs):
        ids = s.ids[1:]
        tokens[i, :len(ids)] = torch.tensor(ids)
        feats[i, :len(s.features)] = s.features.float()
    return tokens, feats, lengths


def loss_fn(head: EagleHead, tokens, feats, lengths, depth: int, recipe: Recipe):
    """EAGLE's loss summed over the unrolled steps, on the positions that predict an answer
    token (drafting happens only there); also the step-1 top-1 agreement. The target's
    distribution at each position is computed once and shared by every step; the head-sized
    matmuls run in bf16 (AMX on this CPU), the softmaxes in fp32."""
    t = feats.shape[1]
    w = head.head_weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = unrolled(head, tokens, feats, depth)
        with torch.no_grad():
            p_all = (feats @ w.t()).float().softmax(-1)                       # [B, T, R]
    total, agree = 0.0, 0.0
    for d, g in enumerate(outs, start=1):
        j = torch.arange(t - d)[None, :]
        # f_{j+d} exists, and the token it predicts, x_{j+d+1}, is part of the answer
        valid = (j + d < lengths[:, :1]) & (j + d + 1 >= lengths[:, 1:])
        if not bool(valid.any()):
            continue
        g = g[:, :t - d][valid]
        target_f, p = feats[:, d:][valid], p_all[:, d:][valid]
        reg = F.smooth_l1_loss(g.float(), target_f)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = g @ w.t()
        logq = logits.float().log_softmax(-1)
        ce = -(p * logq).sum(-1).mean()
        total = total + recipe.reg_weight * reg + recipe.cls_weight * ce
        if d == 1:
            agree = float((logq.argmax(-1) == p.argmax(-1)).float().mean())
    return total / depth, agree


# ---- evaluation: greedy speculation replayed ------------------------------------------------------
@torch.no_grad()
def evaluate(head: EagleHead, held: list[Sequence], k: int) -> dict:
    """Greedy speculation at k replayed on the target's held-out answers: from each last
    true position the head drafts k tokens (unrolled on its own features), the run that
    matches the target's tokens is accepted, and one target token follows."""
    positions = PositionCounts()
    proposed = accepted = tokens_out = passes = 0
    ids_of = head.head_token_ids
    for s in held:
        tokens, feats, lengths = _batch([s], k)
        outs = unrolled(head, tokens, feats, k)
        drafts = torch.stack([ids_of[(g[0] @ head.head_weight.t()).argmax(-1)] for g in outs])   # [k, T]
        ids = s.ids
        j = len(s.prompt_ids) - 1                  # the prompt's last position; x_{j+1} is the first answer token
        while j + 2 < len(ids):
            n = min(k, len(ids) - j - 2)
            m = 0
            while m < n and int(drafts[m, j]) == ids[j + 2 + m]:
                m += 1
            positions.add(attempted_positions(m, n))
            proposed, accepted, tokens_out, passes = proposed + n, accepted + m, tokens_out + m + 1, passes + 1
            j += m + 1
    return {"per_position": positions.rates(), "acceptance_rate": ratio(accepted, proposed),
            "alpha": positions.alpha(), "mean_accepted_len": ratio(tokens_out, passes),
            "eval_tokens": sum(len(s.answer_ids) for s in held), "k": k}


# ---- training ---------------------------------------------------------------------------------------
def train(head: EagleHead, train_set: list[Sequence], held: list[Sequence], recipe: Recipe, log=print,
          checkpoint: Path | None = None, select: list[Sequence] | None = None) -> dict:
    """Returns the training time, the evaluation curve (at every eval: greedy acceptance per
    position on the held-out answers and on a fixed sample of the training answers, side by
    side; a wide gap is memorisation) and the final loss. The head keeps the weights of the
    eval with the best tau on `select` (held-out answers no bench of ours uses; default all
    of `held`). `checkpoint`: a file the state is saved to at every eval and resumed from."""
    probe = training_probe(train_set, max(len(held), 64))
    select = held if select is None else select
    names = [n for n, _ in head.named_parameters() if not n.startswith("embed_tokens.")]
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens.")]
    for p in head.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, recipe.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, recipe.steps) / recipe.steps)))
    rng = random.Random(recipe.seed)
    state = {"step": 0, "batches": [], "curve": [], "history": [], "seconds": 0.0, "best": None}
    if checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        if saved["recipe"] == asdict(recipe):
            with torch.no_grad():
                for n, p in zip(names, params):
                    p.copy_(saved["params"][n])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
            rng.setstate(_rng_state(saved["rng"]))
            state = saved["state"]
            log(f"  resumed at step {state['step']} from {checkpoint}")
    t0 = time.perf_counter() - state["seconds"]
    history, curve, batches = state["history"], state["curve"], state["batches"]
    head.train()
    for step in range(state["step"] + 1, recipe.steps + 1):
        if not batches:
            batches = epoch_batches(train_set, recipe.batch_size, rng)
        loss, agree = loss_fn(head, *_batch([train_set[i] for i in batches.pop()], recipe.depth),
                              recipe.depth, recipe)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history.append((float(loss.detach()), agree))
        if step % 25 == 0:
            recent = history[-25:]
            log(f"  step {step}/{recipe.steps}  loss {sum(h[0] for h in recent) / 25:.4f}  "
                f"train step-1 agreement {sum(h[1] for h in recent) / 25:.3f}  {time.perf_counter() - t0:.0f} s")
        if step % recipe.eval_every == 0 or step == recipe.steps:
            head.eval()
            ev, ev_train, ev_sel = evaluate(head, held, recipe.k), evaluate(head, probe, recipe.k), evaluate(head, select, recipe.k)
            head.train()
            curve.append({"step": step, "seconds": round(time.perf_counter() - t0, 1),
                          "per_position": [round(x, 4) for x in ev["per_position"]],
                          "mean_accepted_len": round(ev["mean_accepted_len"] or 0.0, 4),
                          "train_per_position": [round(x, 4) for x in ev_train["per_position"]],
                          "train_mean_accepted_len": round(ev_train["mean_accepted_len"] or 0.0, 4),
                          "select_mean_accepted_len": round(ev_sel["mean_accepted_len"] or 0.0, 4)})
            c = curve[-1]
            if state["best"] is None or c["select_mean_accepted_len"] > state["best"]["tau"]:
                state["best"] = {"step": step, "tau": c["select_mean_accepted_len"],
                                 "params": {n: p.detach().clone() for n, p in zip(names, params)}}
            state.update(step=step, batches=batches, curve=curve, history=history,
                         seconds=time.perf_counter() - t0)
            if checkpoint is not None:
                _save_checkpoint(checkpoint, recipe, names, params, opt, sched, rng, state)
            log(f"  step {step}: per-position acceptance  train {c['train_per_position']} tau {c['train_mean_accepted_len']}"
                f"  |  held-out {c['per_position']} tau {c['mean_accepted_len']}  (saved)")
    best = state["best"]
    with torch.no_grad():
        for n, p in zip(names, params):
            p.copy_(best["params"][n])
    head.eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return {"train_seconds": time.perf_counter() - t0, "heldout_curve": curve, "best_step": best["step"],
            "final_train_loss": sum(h[0] for h in history[-50:]) / max(len(history[-50:]), 1)}


def _save_checkpoint(path: Path, recipe: Recipe, names, params, opt, sched, rng: random.Random, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    torch.save({"recipe": asdict(recipe), "params": {n: p.detach().clone() for n, p in zip(names, params)},
                "opt": opt.state_dict(), "sched": sched.state_dict(), "rng": list(rng.getstate()[1]) + [rng.getstate()[0]],
                "state": state}, tmp)
    tmp.replace(path)


def _rng_state(saved: list) -> tuple:
    """random.Random's state from _save_checkpoint's list (version last)."""
    return (saved[-1], tuple(saved[:-1]), None)


def training_probe(train_set: list[Sequence], n: int) -> list[Sequence]:
    """n training sequences spread evenly over the set: the training side of the evaluation."""
    return train_set[::max(1, len(train_set) // n)][:n]


def epoch_batches(seqs: list[Sequence], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch in a seeded order, batches drawn from length-sorted windows (little padding)."""
    order = list(range(len(seqs)))
    rng.shuffle(order)
    window = batch_size * 8
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: (len(seqs[i].features), i))
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


# ---- the command --------------------------------------------------------------------------------
def run(recipe: Recipe, out: Path, threads: int = 2, data_cache: Path | None = None, log=print, engine=None) -> dict:
    """The recipe end to end. engine: the engine whose served features are the data (default:
    served_data.served_engine on the default model in recipe.serve_dtype)."""
    from engine.training import served_data
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(recipe.seed)
        t_start = time.perf_counter()
        cache = data_cache or cache_dir() / "distill"
        log(f"recipe: {json.dumps(asdict(recipe))}")
        eng = engine or served_data.served_engine("default", recipe.serve_dtype)
        target = eng.target_model
        train_set, held, data_info = served_data.dataset(eng, recipe.conversations, recipe.seed, recipe.max_new_tokens,
                                                         recipe.concurrency, cache, log)
        data_minutes = (time.perf_counter() - t_start) / 60
        head_ids = choose_head_vocab(train_set, target.hf_config.vocab_size, recipe.head_vocab,
                                     pinned_tokens(target.tokenizer))
        head = build_head(target, head_ids)
        log(f"training the EAGLE head: {len(head_ids)}-token head, depth {recipe.depth}, {recipe.steps} steps "
            f"of {recipe.batch_size} sequences, {sum(len(s.answer_ids) for s in train_set)} answer tokens")
        coverage = _coverage(train_set, held, head_ids)
        log(f"target tokens outside the head's vocabulary: train {1 - coverage['head_coverage_train']:.4f}, "
            f"held-out {1 - coverage['head_coverage_heldout']:.4f}")
        select = [s for p, s in zip(HELD_OUT_PROMPTS, held) if p not in BENCH_PROMPTS]
        key = hashlib.sha256(json.dumps([asdict(recipe), target.identity]).encode()).hexdigest()[:16]
        training = train(head, train_set, held, recipe, log, cache / f"checkpoint-{key}.pt", select)
        report = {"recipe": asdict(recipe), "command": "python -m engine.training.distill " + " ".join(sys.argv[1:]),
                  "threads": threads, "data": {**data_info, **coverage, "minutes": round(data_minutes, 1)},
                  **training, "heldout": training["heldout_curve"][-1], "torch": torch.__version__,
                  "python": platform.python_version()}
        save_eagle(head, out, report)
        report["parity"] = served_data.parity(eng, held[0], out, recipe.k)
        log(f"parity on the first held-out prompt: {report['parity']}")
        report["total_seconds"] = time.perf_counter() - t_start
        (out / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {out} in {report['total_seconds'] / 60:.1f} min")
        return report
    finally:
        torch.set_num_threads(before)


def _coverage(train_set, held, head_ids) -> dict:
    inside = set(head_ids.tolist())

    def share(seqs):
        toks = [t for s in seqs for t in s.answer_ids]
        return sum(t in inside for t in toks) / max(len(toks), 1)
    return {"train_answer_tokens": sum(len(s.answer_ids) for s in train_set), "heldout_answers": len(held),
            "heldout_answer_tokens": sum(len(s.answer_ids) for s in held),
            "head_coverage_train": share(train_set), "head_coverage_heldout": share(held)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    d = Recipe()
    ap = argparse.ArgumentParser(prog="python -m engine.training.distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=SHIPPED_EAGLE_FOLDER)
    for name, value in asdict(d).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-cache", type=Path, default=None, help="where the generated data is kept (default: the user cache)")
    a = ap.parse_args(argv)
    recipe = Recipe(**{name: getattr(a, name) for name in asdict(d)})
    report = run(recipe, a.out, a.threads, a.data_cache, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(report["heldout"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
