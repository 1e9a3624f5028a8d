"""Why the EAGLE head accepts what it does: `python -m engine.training.diagnose [--head FOLDER]`.

For a head and its target, on the engine's greedy answers and served features for the first N
training conversations of the recipe and for the held-out prompts (engine.training.served_data;
the recipe's own files when it made them, else served once and cached, a minute for N = 256):
  a. greedy acceptance per position at k (distill.evaluate's replay), training beside
     held-out: a wide gap is memorisation (more data helps); both low and close is capacity,
     vocabulary or a bug;
  b. top-k recall per depth: from each true position j the head is unrolled on its own
     features (distill.unrolled, the true tokens as inputs), and at depth d we ask whether the
     target's token x_{j+d+1} is among its k best. `path`: only positions whose tokens at the
     depths before d were among the k best too (what a tree of top-k children holds); `any`:
     every position. `tree_tau` = 1 + sum over d of the share whose tokens are in the top-k at
     every depth <= d: the mean accepted length of a full k-ary tree of that depth, the
     ceiling for a tree drafted by this head (k = 1 is the chain);
  c. the share of the target's greedy tokens outside the head's reduced vocabulary (a draft
     can never propose them);
  d. alignment: (i) the head's depth-1 best token scored against x_{j+1}, x_{j+2}, x_{j+3}
     (it is trained for x_{j+2}; a higher score at another offset would be an off-by-one);
     (ii) the proposer's own greedy draft (engine.speculative.eagle_proposer, the inference code) at
     every held-out position against the training forward's; (iii) with --engine, the real
     engine at a fixed k on the first held-out prompts against the replay on the same tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from engine.metrics import ratio
from engine.training.distill import Recipe, _batch, evaluate, unrolled
from engine.training.distill_data import HELD_OUT_PROMPTS, Sequence, user

DEPTH = 4
KS = (1, 2, 4, 8)


# ---- the measures ---------------------------------------------------------------------------------
def head_slots(head) -> torch.Tensor:
    """[vocab] a full token id -> its row in the head's reduced vocabulary, -1 outside it."""
    slot = torch.full((head.config.vocab_size,), -1, dtype=torch.int64)
    slot[head.head_token_ids] = torch.arange(len(head.head_token_ids))
    return slot


@torch.no_grad()
def draft_ranks(head, seq: Sequence, depth: int = DEPTH, slots: torch.Tensor | None = None) -> torch.Tensor:
    """[depth, A] for the true positions j = P-1 .. (P the prompt's length, A the answer's):
    at depth d (row d-1), the rank of the target's token x_{j+d+1} among the head's reduced
    logits after d draft steps from j (0: its best); R (the head's size) when the token is
    outside the head; -1 past the answer's end."""
    slots = head_slots(head) if slots is None else slots
    tokens, feats, _ = _batch([seq], depth)
    outs = unrolled(head, tokens, feats, depth)
    ids = torch.tensor(seq.ids)
    first, t = len(seq.prompt_ids) - 1, feats.shape[1]        # t = len(ids) - 1
    size = len(head.head_token_ids)
    ranks = torch.full((depth, t - first), -1, dtype=torch.int64)
    for d, g in enumerate(outs, start=1):
        j = torch.arange(first, t - d)                        # x_{j+d+1} exists
        if len(j) == 0:
            continue
        logits = g[0, j] @ head.head_weight.t()               # [J, R]
        label = slots[ids[j + d + 1]]
        own = logits.gather(1, label.clamp(min=0)[:, None])
        ranks[d - 1, :len(j)] = torch.where(label >= 0, (logits > own).sum(-1), size)
    return ranks


def recall(ranks: list[torch.Tensor], ks=KS) -> dict:
    """From draft_ranks of many sequences, per k: `any` and `path` recall by depth, `reach`
    (the share of positions whose tokens at every depth <= d are in the top-k: a full k-ary
    tree holds the true path that deep) and `tree_tau` (see the module's docstring). `any`
    and `reach` grow with k; `path` need not, as its positions change with k."""
    r = torch.cat(ranks, dim=1)                               # [depth, positions]
    valid = r >= 0
    table = {}
    for k in ks:
        hit = valid & (r < k)
        path_ok = torch.ones(r.shape[1], dtype=torch.bool)
        any_hit, path_hit, reach = [], [], []
        for d in range(r.shape[0]):
            base = valid[d] & path_ok
            any_hit.append(ratio(int(hit[d].sum()), int(valid[d].sum())))
            path_hit.append(ratio(int((hit[d] & base).sum()), int(base.sum())))
            path_ok = path_ok & hit[d]
            reach.append(ratio(int((path_ok & valid[d]).sum()), int(valid[d].sum())) or 0.0)
        table[k] = {"any": any_hit, "path": path_hit, "reach": reach, "tree_tau": 1.0 + sum(reach)}
    return table


def outside_vocab(head, seqs: list[Sequence]) -> float:
    """The share of the target's answer tokens the head can never draft."""
    slots = head_slots(head)
    toks = torch.tensor([t for s in seqs for t in s.answer_ids])
    return float((slots[toks] < 0).float().mean())


@torch.no_grad()
def depth1_best(head, seq: Sequence) -> torch.Tensor:
    """[T] the head's best token at depth 1 from every true position j (full ids)."""
    tokens, feats, _ = _batch([seq], 1)
    g = unrolled(head, tokens, feats, 1)[0][0]
    return head.head_token_ids[(g @ head.head_weight.t()).argmax(-1)]


def label_shift(head, seqs: list[Sequence]) -> dict:
    """How often the depth-1 best token from j equals x_{j+1}, x_{j+2} (its label), x_{j+3}."""
    hits, n = {1: 0, 2: 0, 3: 0}, 0
    for s in seqs:
        best, ids = depth1_best(head, s), torch.tensor(s.ids)
        j = torch.arange(len(s.prompt_ids) - 1, len(ids) - 3)
        for off in hits:
            hits[off] += int((best[j] == ids[j + off]).sum())
        n += len(j)
    return {f"x_j+{off}": ratio(h, n) for off, h in hits.items()}


@torch.no_grad()
def proposer_agreement(head, seqs: list[Sequence]) -> dict:
    """The inference proposer's greedy draft at every answer position (fed the true tokens
    and the target's features, as after a verify) against the training forward's depth-1
    best token: they must be the same token, or training and inference disagree."""
    from engine.config import SamplingParams
    from engine.speculative.eagle_proposer import EagleProposer
    greedy = SamplingParams(temperature=0.0)
    same = total = 0
    for s in seqs:
        best = depth1_best(head, s)
        proposer = EagleProposer(head, 16, torch.device("cpu"))
        proposer.target_pass(0, s.features.float())
        for j in range(len(s.prompt_ids) - 1, len(s.ids) - 2):
            draft = proposer.propose(s.ids[:j + 2], 1, greedy, None).tokens
            same += bool(draft) and draft[0] == int(best[j])
            total += 1
        proposer.end()
    return {"positions": total, "same_token": ratio(same, total)}


def engine_check(head_folder: Path | None, held: list[Sequence], k: int, prompts: int = 8,
                 max_tokens: int = 64) -> dict:
    """The real engine (default settings, fixed k, greedy) on the first held-out prompts
    against distill.evaluate's replay on the same prompts' first max_tokens answer tokens."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.metrics import combined
    eng = LLMEngine.load("default", EngineConfig(proposer="eagle", eagle_head=str(head_folder) if head_folder else None,
                                                 num_speculative_tokens=k, speculation_policy="fixed",
                                                 enable_prefix_caching=False))
    stats, truncated, same_prompt, same_answer = [], [], 0, 0
    for text, s in zip(HELD_OUT_PROMPTS[:prompts], held[:prompts]):
        prompt = eng.encode(user(text))
        _, out, st = eng.generate_text(prompt, SamplingParams(max_tokens=max_tokens))
        stats.append(st)
        same_prompt += list(prompt) == s.prompt_ids
        same_answer += out == s.answer_ids[:len(out)]
        n = min(max_tokens, len(s.answer_ids))
        truncated.append(Sequence(s.prompt_ids, s.answer_ids[:n], s.features[:len(s.prompt_ids) + n - 1]))
    spec = combined(stats)
    return {"prompts": prompts, "max_tokens": max_tokens, "k": k, "dtype": str(eng.runner.model_dtype),
            "prompt_ids_identical": same_prompt, "answers_identical_to_training_data": same_answer,
            "engine": {"per_position": spec.per_position, "alpha": spec.positions.alpha(),
                       "mean_accepted_len": spec.mean_accepted_len},
            "replay": evaluate(eng.speculator.eagle[1], truncated, k)}


# ---- the report -------------------------------------------------------------------------------------
def diagnose(target, head, train: list[Sequence], held: list[Sequence], k: int = 4, log=print) -> dict:
    log(f"measuring on {len(train)} training and {len(held)} held-out answers")
    slots = head_slots(head)
    ranks = {name: [draft_ranks(head, s, DEPTH, slots) for s in seqs] for name, seqs in (("train", train), ("heldout", held))}
    return {
        "acceptance": {"train": evaluate(head, train, k), "heldout": evaluate(head, held, k)},
        "recall": {name: recall(r) for name, r in ranks.items()},
        "outside_vocab": {"train": outside_vocab(head, train), "heldout": outside_vocab(head, held)},
        "answer_tokens": {"train": sum(len(s.answer_ids) for s in train), "heldout": sum(len(s.answer_ids) for s in held)},
        "label_shift": {"train": label_shift(head, train), "heldout": label_shift(head, held)},
        "proposer_agreement": proposer_agreement(head, held),
    }


def _row(values, width=7) -> str:
    return "".join(f"{'-' if v is None else f'{v:.3f}':>{width}}" for v in values)


def format_report(report: dict) -> str:
    acc = report["acceptance"]
    lines = [f"a. greedy acceptance per position, k={acc['train']['k']} (distill.evaluate's replay)",
             f"   {'':10}{'pos 1':>7}{'pos 2':>7}{'pos 3':>7}{'pos 4':>7}{'alpha':>8}{'tau':>7}  tokens"]
    for name in ("train", "heldout"):
        a = acc[name]
        lines.append(f"   {name:10}{_row(a['per_position'] + [None] * (4 - len(a['per_position'])))}"
                     f"{a['alpha'] or 0:8.3f}{a['mean_accepted_len'] or 0:7.3f}  {report['answer_tokens'][name]}")
    for name in ("heldout", "train"):
        lines.append(f"b. top-k recall by depth, {name} (path: the tokens before it in the top-k too; any: all positions)")
        lines.append(f"   {'k':>3} {'path d1..d4':>28}   {'any d1..d4':>28}   tree_tau")
        for k, r in report["recall"][name].items():
            lines.append(f"   {k:>3} {_row(r['path'])}   {_row(r['any'])}   {r['tree_tau']:.3f}")
    ov = report["outside_vocab"]
    lines.append(f"c. target tokens outside the head's vocabulary: train {ov['train']:.4f}, held-out {ov['heldout']:.4f}")
    lines.append("d. alignment: depth-1 best token equals x_{j+1} / x_{j+2} (its label) / x_{j+3}")
    for name in ("train", "heldout"):
        ls = report["label_shift"][name]
        lines.append(f"   {name:10}{_row([ls['x_j+1'], ls['x_j+2'], ls['x_j+3']])}")
    pa = report["proposer_agreement"]
    lines.append(f"   the proposer's greedy draft = the training forward's: {pa['same_token']:.4f} of {pa['positions']} positions")
    if "engine" in report:
        e = report["engine"]
        lines.append(f"   the engine ({e['dtype']}, fixed k={e['k']}, {e['prompts']} held-out prompts x {e['max_tokens']} tokens): "
                     f"prompts identical {e['prompt_ids_identical']}/{e['prompts']}, greedy answers identical to the data "
                     f"{e['answers_identical_to_training_data']}/{e['prompts']}")
        for name in ("engine", "replay"):
            r = e[name]
            lines.append(f"   {name:10}{_row(r['per_position'])}  alpha {r['alpha'] or 0:.3f}  tau {r['mean_accepted_len'] or 0:.3f}")
    return "\n".join(lines)


# ---- the command ------------------------------------------------------------------------------------
def load_data(eng, recipe: Recipe, n_train: int, cache: Path, log=print) -> tuple[list[Sequence], list[Sequence]]:
    """The engine's answers (served_data) to the first n_train of the recipe's conversations and
    to the held-out prompts; the recipe's own files where it made them already."""
    from engine.training.served_data import dataset
    train, held, _ = dataset(eng, n_train, recipe.seed, recipe.max_new_tokens, recipe.concurrency, cache, log)
    return train, held


def main(argv=None) -> int:
    from engine.loading.loader import SHIPPED_EAGLE_FOLDER, cache_dir, load_eagle_head
    from engine.training.served_data import served_engine
    d = Recipe()
    ap = argparse.ArgumentParser(prog="python -m engine.training.diagnose", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, default=None, help="an EAGLE head folder (default: the shipped head)")
    ap.add_argument("--train-conversations", type=int, default=256,
                    help="the first N of the recipe's training conversations (default 256: its first file)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--k", type=int, default=d.k)
    ap.add_argument("--engine", action="store_true", help="also run the real engine on the first 8 held-out prompts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-cache", type=Path, default=None, help="where the generated answers are kept")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the report as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)         # noqa: E731
    recipe = Recipe(seed=a.seed, k=a.k)
    eng = served_engine("default", recipe.serve_dtype)
    target = eng.target_model
    head, _ = load_eagle_head(str(a.head) if a.head else None, target)
    train, held = load_data(eng, recipe, a.train_conversations, a.data_cache or cache_dir() / "distill", log)
    report = diagnose(target, head, train, held, a.k, log)
    report["head"] = str(a.head or SHIPPED_EAGLE_FOLDER)
    if a.engine:
        log("running the engine on the held-out prompts")
        report["engine"] = engine_check(a.head, held, a.k)
    print(format_report(report))
    if a.json_out:
        a.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
