"""Distil a small draft model for the embedded default target: `python -m engine.distill`.

The recipe, offline and on the CPU, from the target alone:
  1. data: the target's own greedy answers to a fixed, varied prompt set (templated chat
     requests plus excerpts of pydoc_data.topics, which ships with Python), generated in
     padded batches with transformers; the target's top-K logits at every answer token
     come with the generation, so distillation needs no second teacher pass;
  2. shape: a few of the target's layers (default 0, 1, 2, 29) as the draft's layers, the
     target's embedding, and a reduced-vocabulary head: the target's tied head rows for the
     HEAD_VOCAB tokens that carry the most teacher mass in the data, plus a learned bias.
     On a CPU the 49,152 x 576 head costs as much as ~6 of the target's layers per token;
     the reduced head costs well under one;
  3. training: KL(target || draft) on the teacher's top-K distribution, teacher forcing on
     the target's answers, fixed seed and data order, a fixed number of steps; the first
     draft layers (default 2) stay frozen: held-out agreement is data-limited, and fewer
     trained weights generalise as well at half the cost per step;
  4. held-out evaluation: teacher-forced greedy agreement with the target on answers to
     held-out chat prompts (the bench's prompts among them), and from it, by simulating
     greedy speculative decoding, per-position acceptance and mean accepted length tau;
     the draft/target cost ratio is measured with the engine's runner;
  5. the draft folder: config.json (model_type "llama", fewer layers), model.safetensors
     (fp16 layer and norm weights, head token ids and bias), tokenizer files and
     distill_report.json. The embedding and head rows are NOT stored: they are the
     target's, attached at load time by `engine.loader.load_draft_folder` (engine.loader's "default-draft").

The draft's logits span the full vocabulary (-inf outside its head), so the engine's
proposer, sampler and rejection sampler use it unchanged; losslessness does not depend on it.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.loader import SHIPPED_DRAFT_FOLDER, load_draft_folder
from engine.metrics import PositionCounts, predicted_speedup, ratio
from engine.models.llama import LlamaFamilyModel
from engine.models.reduced_head_draft import DRAFT_CONFIG_KEY, ReducedHeadDraft, save_draft

DRAFT_FOLDER_NAME = "smollm2-135m-draft"


def train_hidden(model: LlamaFamilyModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Training forward without the paged cache: [B, T] right-padded ids -> [B, T, hidden].
    Same maths as the engine's forward (RMSNorm, rotate-half RoPE, GQA, SwiGLU)."""
    b, t = input_ids.shape
    h = model.embed_tokens(input_ids)
    cos = model.rotary.cos[:t].to(h.dtype)[None, :, None, :]        # [1, T, 1, D]
    sin = model.rotary.sin[:t].to(h.dtype)[None, :, None, :]
    for layer in model.layers:
        attn = layer.self_attn
        q, k, v = attn.qkv_proj(layer.input_layernorm(h)).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(b, t, attn.num_heads, attn.head_dim)              # [B, T, H_q, D]
        k = k.view(b, t, attn.num_kv_heads, attn.head_dim)           # [B, T, H_kv, D]
        v = v.view(b, t, attn.num_kv_heads, attn.head_dim)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=attn.scale, enable_gqa=True)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.q_size))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---- building, saving, loading ------------------------------------------------------------
def _draft_config(target_config, num_layers: int, info: dict):
    import copy
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    setattr(config, DRAFT_CONFIG_KEY, info)
    return config


def build_draft(target, layer_ids: list[int], head_token_ids: torch.Tensor) -> ReducedHeadDraft:
    """Initialise from the target: copies of the chosen layers and final norm; the head is
    the target's (tied) embedding rows for head_token_ids, frozen; a zero bias, trained."""
    info = {"target": target.display_name, "init_layers": layer_ids, "head_vocab": len(head_token_ids)}
    config = _draft_config(target.hf_config, len(layer_ids), info)
    src = target.model
    tensors = {"norm.weight": src.norm.weight.detach().float().clone()}
    for i, j in enumerate(layer_ids):
        for name, t in src.layers[j].state_dict().items():
            tensors[f"layers.{i}.{name}"] = t.detach().float().clone()
    with torch.device("meta"):
        draft = ReducedHeadDraft(config, len(head_token_ids), max_positions=src.max_positions)
    draft.materialize()
    draft.embed_tokens = src.embed_tokens                  # shared with the target, frozen
    draft.load_state_dict(tensors, strict=False)
    with torch.no_grad():
        draft.head_token_ids.copy_(head_token_ids)
        draft.head.weight.copy_(src.embed_tokens.weight[head_token_ids].float())
        draft.head.bias.zero_()
    return draft.float()


# ---- data ------------------------------------------------------------------------------------
SUBJECTS = [
    "volcanoes", "the Roman Empire", "binary search", "rainbows", "electric cars", "jazz music",
    "the immune system", "chess openings", "black holes", "the printing press", "recycling",
    "the water cycle", "machine learning", "the stock market", "honey bees", "the Great Wall of China",
    "climate change", "vaccines", "the internet", "earthquakes", "the human heart", "coffee",
    "renewable energy", "the Moon landing", "gravity", "sleep", "dinosaurs", "the Renaissance",
    "bicycles", "compound interest", "the Amazon rainforest", "democracy", "recursion",
    "sorting algorithms", "the periodic table", "DNA", "ancient Egypt", "the violin", "tides",
    "meditation", "a healthy breakfast", "public speaking", "time management", "the Olympic Games",
    "penguins", "glaciers", "solar panels", "the French language", "Shakespeare", "airplanes",
    "databases", "the Python programming language", "cloud computing", "friendship", "gardening",
    "the moon's phases", "bread baking", "the Silk Road", "coral reefs", "the theory of evolution",
    "inflation", "electricity", "magnets", "the human brain", "rain", "mountains", "the ocean",
    "trains", "robots", "video games", "smartphones", "libraries", "museums", "bridges",
    "photography", "the guitar", "football", "marathon running", "yoga", "chocolate", "tea ceremonies",
    "the Vikings", "the Industrial Revolution", "wind turbines", "encryption", "passwords",
    "operating systems", "spreadsheets", "email etiquette", "job interviews", "budgeting",
    "learning a new language", "writing an essay", "the scientific method", "statistics", "fractions",
    "prime numbers", "the Pythagorean theorem", "microscopes", "telescopes", "the speed of light",
]
TASKS = [
    "What is {s}?", "Explain {s} in simple terms.", "Give me three interesting facts about {s}.",
    "Write a short poem about {s}.", "Why is {s} important?", "Summarize the history of {s}.",
    "What are the pros and cons of {s}?", "Explain {s} to a ten-year-old.",
    "Write a short story that involves {s}.", "How would you teach someone about {s}?",
    "What are common misconceptions about {s}?", "Describe {s} in one paragraph.",
]
HELD_OUT_PROMPTS = [   # never trained on; the first ten are engine.bench's CHAT_PROMPTS
    "What is the capital of France?", "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea.", "Give me three tips for learning to cook.",
    "What causes the seasons on Earth?", "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?", "List the planets of the solar system.", "How do I make a cup of tea?",
    "What is photosynthesis?", "How does a refrigerator keep food cold?", "Write a limerick about a dog.",
    "What is the difference between weather and climate?", "Give me a recipe for pancakes.",
    "Explain how a car engine works.", "What is a linked list?", "Who was Albert Einstein?",
    "Suggest a name for a bakery.", "How can I improve my memory?", "What is the largest ocean?",
    "Write a thank-you note to a teacher.", "Why do leaves change colour in autumn?",
    "What is an API?", "Describe the taste of an orange.",
]


def training_prompts(n: int, seed: int) -> list[str]:
    """n prompts: subject x task pairs and pydoc excerpts, in a seeded fixed order."""
    import pydoc_data.topics as topics
    rng = random.Random(seed)
    pairs = [t.format(s=s) for s in SUBJECTS for t in TASKS]
    rng.shuffle(pairs)
    excerpts = []
    for key in sorted(topics.topics):
        text = " ".join(topics.topics[key].split())
        for start in range(0, min(len(text), 1200), 400):
            excerpts.append(text[start:start + 300])
    rng.shuffle(excerpts)
    doc_tasks = ["Explain this passage from the Python documentation in plain words:\n\n{x}",
                 "Summarize the following text:\n\n{x}", "What does this mean?\n\n{x}"]
    docs = [doc_tasks[i % len(doc_tasks)].format(x=x) for i, x in enumerate(excerpts)]
    n_docs = n // 4                                   # a quarter documentation, three quarters chat
    prompts = docs[:n_docs] + pairs[:n - n_docs]
    held = set(HELD_OUT_PROMPTS)
    prompts = [p for p in prompts if p not in held]
    rng.shuffle(prompts)
    return prompts


@dataclass
class Example:
    prompt_ids: list[int]
    answer_ids: list[int]
    top_ids: torch.Tensor        # [len(answer), K] int64: the target's top-K tokens at each answer token
    top_logprobs: torch.Tensor   # [len(answer), K] float32: their log-probabilities


def generate_examples(hf, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int, top_k: int,
                      log=print) -> list[Example]:
    """Greedy answers from the target in left-padded batches, with its top-K log-probs."""
    tokenizer.padding_side = "left"
    eos = tokenizer.eos_token_id
    examples = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = hf.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        width = enc.input_ids.shape[1]
        logits = torch.stack(out.logits, dim=1).float()                 # [B, steps, V]
        logprobs = logits.log_softmax(-1)
        top_lp, top_ids = logprobs.topk(top_k, dim=-1)                  # [B, steps, K]
        for b in range(len(batch)):
            prompt = enc.input_ids[b][enc.attention_mask[b].bool()].tolist()
            answer = out.sequences[b, width:].tolist()
            if eos in answer:
                answer = answer[:answer.index(eos) + 1]                   # keep the end-of-turn token
            n = len(answer)
            examples.append(Example(prompt, answer, top_ids[b, :n].clone(), top_lp[b, :n].clone()))
        del out, logits, logprobs
        log(f"  generated {min(start + batch_size, len(prompts))}/{len(prompts)} prompts, "
            f"{sum(len(e.answer_ids) for e in examples)} answer tokens")
    return examples


def save_examples(examples: list[Example], path: Path) -> None:
    from safetensors.torch import save_file
    tensors = {}
    for i, e in enumerate(examples):
        tensors[f"{i}.prompt"] = torch.tensor(e.prompt_ids, dtype=torch.int32)
        tensors[f"{i}.answer"] = torch.tensor(e.answer_ids, dtype=torch.int32)
        tensors[f"{i}.top_ids"] = e.top_ids.to(torch.int32)
        tensors[f"{i}.top_lp"] = e.top_logprobs.float()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def load_examples(path: Path) -> list[Example]:
    from safetensors.torch import load_file
    t = load_file(str(path))
    n = len([k for k in t if k.endswith(".prompt")])
    return [Example(t[f"{i}.prompt"].tolist(), t[f"{i}.answer"].tolist(), t[f"{i}.top_ids"].long(),
                    t[f"{i}.top_lp"]) for i in range(n)]


def choose_head_vocab(examples: list[Example], tokenizer, size: int) -> torch.Tensor:
    """The `size` tokens with the most teacher probability mass in the training answers
    (ties and the remainder by token id), always including the special tokens."""
    vocab = len(tokenizer)
    mass = torch.zeros(vocab, dtype=torch.float64)
    for e in examples:
        mass.index_add_(0, e.top_ids.flatten(), e.top_logprobs.exp().flatten().double())
    for tid in tokenizer.all_special_ids:
        mass[tid] = float("inf")
    order = sorted(range(vocab), key=lambda i: (-float(mass[i]), i))
    return torch.tensor(sorted(order[:min(size, vocab)]), dtype=torch.int64)


# ---- training -------------------------------------------------------------------------------
def _batch(examples: list[Example], head_index: torch.Tensor):
    """Right-padded [B, T] inputs (prompt + answer[:-1]) and, for each answer token, the
    flat position that predicts it and the teacher's top-K in head coordinates."""
    seqs = [e.prompt_ids + e.answer_ids[:-1] for e in examples]
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.int64)
    flat_pos, teacher_ids, teacher_lp = [], [], []
    for b, (e, s) in enumerate(zip(examples, seqs)):
        ids[b, :len(s)] = torch.tensor(s)
        p = len(e.prompt_ids)
        flat_pos.append(b * t + torch.arange(p - 1, p - 1 + len(e.answer_ids)))
        teacher_ids.append(head_index[e.top_ids])            # -1 where outside the head
        teacher_lp.append(e.top_logprobs)
    return ids, torch.cat(flat_pos), torch.cat(teacher_ids), torch.cat(teacher_lp)


def epoch_batches(examples: list[Example], batch_size: int, rng: random.Random) -> list[list[int]]:
    """One epoch in a seeded order; batches drawn from length-sorted windows of 8 batches
    so that little of each step is padding."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    length = [len(e.prompt_ids) + len(e.answer_ids) for e in examples]
    window = batch_size * 8
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: (length[i], i))
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def distill_loss(draft: ReducedHeadDraft, ids, flat_pos, teacher_ids, teacher_lp):
    """KL(p_target || q_draft) over the teacher's top-K tokens inside the draft's head,
    p renormalised over them; also returns the top-1 agreement on these positions."""
    h = train_hidden(draft, ids).flatten(0, 1)[flat_pos]                 # [N, hidden]
    logq = draft.head(h).log_softmax(-1)                                 # [N, head]
    inside = teacher_ids >= 0
    p = torch.where(inside, teacher_lp, torch.full_like(teacher_lp, float("-inf"))).softmax(-1)
    p = torch.nan_to_num(p)                                              # rows with nothing inside
    logq_k = logq.gather(1, teacher_ids.clamp(min=0))
    kl = (p * (torch.log(p.clamp(min=1e-30)) - logq_k)).sum(-1).mean()
    agree = (logq.argmax(-1) == teacher_ids[:, 0]).float().mean()
    return kl, float(agree)


def train(draft: ReducedHeadDraft, examples: list[Example], steps: int, batch_size: int, lr: float,
          seed: int, time_budget_s: float | None, log=print, frozen_layers: int = 0,
          heldout: list[Example] | None = None, eval_every: int = 0) -> dict:
    """frozen_layers: the first N draft layers keep the target's weights (fewer parameters
    to overfit the small data set, and no backward pass through them)."""
    head_index = torch.full((draft.config.vocab_size,), -1, dtype=torch.int64)
    head_index[draft.head_token_ids] = torch.arange(len(draft.head_token_ids))
    frozen = ("embed_tokens.", "head.weight") + tuple(f"layers.{i}." for i in range(frozen_layers))
    params = [p for n, p in draft.named_parameters() if not n.startswith(frozen)]
    trained = {id(p) for p in params}
    for p in draft.parameters():
        p.requires_grad_(id(p) in trained)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    order_rng = random.Random(seed)
    batches: list[list[int]] = []
    t0, history, done, curve = time.perf_counter(), [], 0, []
    draft.train()
    for step in range(steps):
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            log(f"  time budget reached after {step} steps")
            break
        if not batches:
            batches = epoch_batches(examples, batch_size, order_rng)
        kl, agree = distill_loss(draft, *_batch([examples[i] for i in batches.pop(0)], head_index))
        opt.zero_grad(set_to_none=True)
        kl.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        done = step + 1
        history.append((float(kl.detach()), agree))
        if heldout and eval_every and (done % eval_every == 0 or done == steps):
            draft.eval()
            curve.append((done, simulate_greedy_spec(agreement_vectors(draft, heldout), 4)["greedy_agreement"]))
            draft.train()
            log(f"  step {done}: held-out greedy agreement {curve[-1][1]:.3f}")
        if done % 25 == 0 or done == steps:
            recent = history[-25:]
            log(f"  step {done}/{steps}  kl {sum(h[0] for h in recent) / len(recent):.3f}  "
                f"train agreement {sum(h[1] for h in recent) / len(recent):.3f}  {time.perf_counter() - t0:.0f}s")
    draft.eval()
    for p in draft.parameters():
        p.requires_grad_(False)
    tail = history[-50:] or [(float("nan"), float("nan"))]
    return {"steps_done": done, "train_seconds": time.perf_counter() - t0,
            "final_train_kl": sum(h[0] for h in tail) / len(tail),
            "final_train_agreement": sum(h[1] for h in tail) / len(tail),
            "heldout_agreement_curve": curve}


# ---- evaluation -------------------------------------------------------------------------------
@torch.no_grad()
def agreement_vectors(draft: ReducedHeadDraft, examples: list[Example]) -> list[list[bool]]:
    """Per answer token: does the draft's argmax (teacher-forced on the target's greedy
    answer) equal the target's? This is the greedy acceptance of that token."""
    out = []
    for e in examples:
        ids = torch.tensor([e.prompt_ids + e.answer_ids[:-1]])
        p = len(e.prompt_ids)
        h = train_hidden(draft, ids)[0, p - 1:]
        logits = draft.logits(h)
        out.append((logits.argmax(-1) == torch.tensor(e.answer_ids)).tolist())
    return out


def simulate_greedy_spec(agreements: list[list[bool]], k: int) -> dict:
    """Replay greedy speculative decoding: at each step the draft proposes k tokens on the
    target's path, the run of agreements is accepted, and one target token is added."""
    positions = PositionCounts()
    tokens = passes = proposed = accepted = 0
    for agree in agreements:
        pos = 0
        while pos < len(agree):
            n = min(k, len(agree) - pos - 1)        # as the engine: no drafting past the last token
            m = 0
            while m < n and agree[pos + m]:
                m += 1
            positions.add([i < m for i in range(min(m + 1, n))])
            accepted += m
            pos += m + 1
            tokens += m + 1
            passes += 1
            proposed += n
    flat = [a for v in agreements for a in v]
    # acceptance_rate as in DESIGN.md and engine.bench: accepted draft tokens / proposed ones
    return {"greedy_agreement": ratio(sum(flat), len(flat)) or 0.0, "eval_tokens": len(flat),
            "per_position": positions.rates(), "acceptance_rate": ratio(accepted, proposed) or 0.0,
            "mean_accepted_len": ratio(tokens, passes) or 0.0}


def measure_cost_ratio(target, draft_loaded, steps: int = 40) -> dict:
    """Median single-token decode step of the draft vs the target, through the engine's runner."""
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    config = EngineConfig(kv_cache_bytes=32 * 2**20)

    def step_ms(loaded):
        runner = ModelRunner(loaded, config, torch.device("cpu"))
        prompt = list(range(1000, 1064))
        seq = runner.start(prompt)
        runner.forward(seq, prompt)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            runner.forward(seq, [2000 + i])
            times.append(time.perf_counter() - t0)
        runner.end(seq)
        return sorted(times)[len(times) // 2] * 1e3
    target_ms, draft_ms = step_ms(target), step_ms(draft_loaded)
    return {"target_step_ms": target_ms, "draft_step_ms": draft_ms, "cost_ratio": draft_ms / target_ms}


# ---- the command -------------------------------------------------------------------------------
@dataclass
class Recipe:
    seed: int = 0
    layers: list[int] = field(default_factory=lambda: [0, 1, 2, 29])
    head_vocab: int = 8192
    train_prompts: int = 448
    heldout_prompts: int = len(HELD_OUT_PROMPTS)
    max_new_tokens: int = 128
    gen_batch_size: int = 32
    top_k: int = 32
    steps: int = 400
    batch_size: int = 8
    lr: float = 5e-4
    frozen_layers: int = 2
    eval_every: int = 50
    k: int = 4


def run(recipe: Recipe, out: Path, threads: int = 1, time_budget_min: float | None = None,
        data_cache: Path | None = None, log=print, target=None) -> dict:
    """The whole recipe; returns the report also written to out/distill_report.json."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(recipe, out, threads, time_budget_min, data_cache, log, target)
    finally:
        torch.set_num_threads(threads_before)


def _run(recipe, out, threads, time_budget_min, data_cache, log, target) -> dict:
    from transformers import AutoModelForCausalLM
    from engine.loader import load_model
    torch.manual_seed(recipe.seed)
    random.seed(recipe.seed)
    t_start = time.perf_counter()
    target = target or load_model("default")
    tokenizer = target.tokenizer
    log(f"recipe: {json.dumps(asdict(recipe))}")

    t0 = time.perf_counter()
    train_ex, held_ex = _data(recipe, target, data_cache, log, AutoModelForCausalLM)
    data_seconds = time.perf_counter() - t0

    head_ids = choose_head_vocab(train_ex, tokenizer, recipe.head_vocab)
    draft = build_draft(target, recipe.layers, head_ids)
    log(f"training a {len(recipe.layers)}-layer draft (init from target layers {recipe.layers}), "
        f"head of {len(head_ids)} tokens, {recipe.steps} steps of {recipe.batch_size} answers")
    budget_s = time_budget_min * 60 if time_budget_min else None
    training = train(draft, train_ex, recipe.steps, recipe.batch_size, recipe.lr, recipe.seed, budget_s, log,
                     recipe.frozen_layers, held_ex, recipe.eval_every)

    report = {"recipe": asdict(recipe), "command": "python -m engine.distill " + " ".join(sys.argv[1:]),
              "threads": threads, "data_seconds": data_seconds, **training,
              "data": _data_summary(train_ex, held_ex, head_ids),
              "torch": torch.__version__, "python": platform.python_version()}
    save_draft(draft, tokenizer, out, report)
    report["heldout"] = evaluate(target, load_draft_folder(out, target), held_ex, recipe.k, log)   # what ships: fp16
    report["total_seconds"] = time.perf_counter() - t_start
    (out / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out} in {report['total_seconds'] / 60:.1f} min")
    return report


def evaluate(target, loaded, held_ex: list[Example], k: int, log=print) -> dict:
    """Held-out greedy agreement, simulated greedy speculation at k, measured cost ratio and
    the predicted speedup (alpha = per-token agreement)."""
    evaluation = simulate_greedy_spec(agreement_vectors(loaded.model, held_ex), k)
    evaluation["k"] = k
    costs = measure_cost_ratio(target, loaded)
    evaluation.update(costs)
    evaluation["predicted_speedup"] = predicted_speedup(evaluation["greedy_agreement"], k, costs["cost_ratio"])
    log(f"held-out: agreement {evaluation['greedy_agreement']:.3f}, per-position "
        f"{[round(x, 3) for x in evaluation['per_position']]}, tau {evaluation['mean_accepted_len']:.2f}, "
        f"cost ratio {costs['cost_ratio']:.3f}, predicted speedup {evaluation['predicted_speedup']:.2f}x")
    return evaluation


def reevaluate(folder: Path, threads: int = 1, log=print) -> dict:
    """Evaluate an existing draft folder again (held-out answers regenerated) and rewrite
    the "heldout" section of its distill_report.json."""
    from transformers import AutoModelForCausalLM
    from engine.loader import load_model
    torch.set_num_threads(threads)
    report = json.loads((folder / "distill_report.json").read_text())
    recipe = Recipe(**report["recipe"])
    target = load_model("default")
    hf = AutoModelForCausalLM.from_pretrained(target.folder, dtype=torch.float32).eval()
    held_ex = generate_examples(hf, target.tokenizer, HELD_OUT_PROMPTS[:recipe.heldout_prompts],
                                recipe.max_new_tokens, recipe.gen_batch_size, recipe.top_k, log)
    report["heldout"] = evaluate(target, load_draft_folder(folder, target), held_ex, recipe.k, log)
    report["heldout_evaluated_by"] = "python -m engine.distill --reevaluate " + str(folder)
    (folder / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _data(recipe: Recipe, target, data_cache: Path | None, log, auto_model):
    key = hashlib.sha256(json.dumps([recipe.seed, recipe.train_prompts, recipe.heldout_prompts,
                                     recipe.max_new_tokens, recipe.gen_batch_size, recipe.top_k,
                                     target.identity]).encode()).hexdigest()[:16]
    if data_cache is not None and (data_cache / f"{key}.train.safetensors").is_file():
        log(f"reusing generated data from {data_cache} ({key})")
        return (load_examples(data_cache / f"{key}.train.safetensors"),
                load_examples(data_cache / f"{key}.heldout.safetensors"))
    hf = auto_model.from_pretrained(target.folder, dtype=torch.float32).eval()
    prompts = training_prompts(recipe.train_prompts, recipe.seed)
    held = HELD_OUT_PROMPTS[:recipe.heldout_prompts]
    log(f"generating held-out answers for {len(held)} prompts")
    held_ex = generate_examples(hf, target.tokenizer, held, recipe.max_new_tokens, recipe.gen_batch_size, recipe.top_k, log)
    log(f"generating training answers for {len(prompts)} prompts")
    train_ex = generate_examples(hf, target.tokenizer, prompts, recipe.max_new_tokens, recipe.gen_batch_size, recipe.top_k, log)
    del hf
    if data_cache is not None:
        save_examples(train_ex, data_cache / f"{key}.train.safetensors")
        save_examples(held_ex, data_cache / f"{key}.heldout.safetensors")
    return train_ex, held_ex


def _data_summary(train_ex, held_ex, head_ids) -> dict:
    inside = torch.zeros(int(head_ids.max()) + 1 if len(head_ids) else 1, dtype=torch.bool)
    inside[head_ids] = True

    def coverage(examples):
        toks = [t for e in examples for t in e.answer_ids]
        return sum(1 for t in toks if t < len(inside) and inside[t]) / max(len(toks), 1)
    return {"train_examples": len(train_ex), "train_answer_tokens": sum(len(e.answer_ids) for e in train_ex),
            "heldout_examples": len(held_ex), "heldout_answer_tokens": sum(len(e.answer_ids) for e in held_ex),
            "sources": "target's greedy answers to subject x task chat prompts (3/4) and to pydoc_data.topics "
                       "excerpts (1/4); held-out: HELD_OUT_PROMPTS (includes engine.bench's CHAT_PROMPTS)",
            "head_coverage_train": coverage(train_ex), "head_coverage_heldout": coverage(held_ex)}


def main(argv=None) -> int:
    d = Recipe()
    ap = argparse.ArgumentParser(prog="python -m engine.distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=SHIPPED_DRAFT_FOLDER)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--layers", default=",".join(map(str, d.layers)), help="target layers that initialise the draft's")
    ap.add_argument("--head-vocab", type=int, default=d.head_vocab, help="tokens the draft's head scores")
    ap.add_argument("--train-prompts", type=int, default=d.train_prompts)
    ap.add_argument("--heldout-prompts", type=int, default=d.heldout_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="answer length cap")
    ap.add_argument("--gen-batch-size", type=int, default=d.gen_batch_size)
    ap.add_argument("--top-k", type=int, default=d.top_k, help="teacher tokens kept per position")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="answers per training step")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--frozen-layers", type=int, default=d.frozen_layers, help="keep the first N draft layers as initialised")
    ap.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out agreement every N steps (0: only at the end)")
    ap.add_argument("--k", type=int, default=d.k, help="draft tokens per step for the evaluation")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (results are checked with 1)")
    ap.add_argument("--time-budget-min", type=float, default=None,
                    help="stop training early after this many minutes (breaks exact reproducibility)")
    ap.add_argument("--data-cache", type=Path, default=None, help="keep/reuse the generated data here")
    ap.add_argument("--reevaluate", type=Path, default=None, metavar="FOLDER",
                    help="only evaluate an existing draft folder again and update its report")
    a = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)      # noqa: E731
    if a.reevaluate is not None:
        print(json.dumps(reevaluate(a.reevaluate, a.threads, log)["heldout"]))
        return 0
    recipe = Recipe(seed=a.seed, layers=[int(x) for x in a.layers.split(",")], head_vocab=a.head_vocab,
                    train_prompts=a.train_prompts, heldout_prompts=a.heldout_prompts,
                    max_new_tokens=a.max_new_tokens, gen_batch_size=a.gen_batch_size, top_k=a.top_k,
                    steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                    frozen_layers=a.frozen_layers, eval_every=a.eval_every, k=a.k)
    report = run(recipe, a.out, a.threads, a.time_budget_min, a.data_cache, log=log)
    print(json.dumps(report["heldout"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
