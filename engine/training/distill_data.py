"""Training data for the draft head: the target's own greedy answers, with its final hidden
state at every position, generated many sequences per forward pass.

Used only by the recipe (`engine.training.distill`); inference never imports it.

The generator runs the target's own modules (engine.models.llama) over a contiguous,
left-padded KV cache [B, H_kv, T, D]: one forward pass advances every unfinished sequence
by one token. The final normed hidden state of each position comes out of the same pass
that picks the token, so the features cost no second pass. In bf16 on a CPU with AMX the
batched matmuls run several times faster per token than one sequence at a time.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.llama import LlamaFamilyModel, apply_rope


@dataclass
class Sequence:
    prompt_ids: list[int]
    answer_ids: list[int]
    features: torch.Tensor        # [len(prompt) + len(answer) - 1, hidden]: the target's final
                                  # normed hidden state at every position but the last token's

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


@torch.inference_mode()
def generate_batch(model: LlamaFamilyModel, prompts: list[list[int]], max_new_tokens: int,
                   eos_ids: set[int]) -> list[Sequence]:
    """Greedy answers for a batch of token-id prompts, left-padded. The model's dtype is used."""
    b = len(prompts)
    width = max(len(p) for p in prompts)
    total = width + max_new_tokens
    dtype = next(model.parameters()).dtype
    pad = [width - len(p) for p in prompts]
    ids = torch.zeros(b, width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, pad[i]:] = torch.tensor(p)
    pad_t = torch.tensor(pad)
    cols = torch.arange(total)
    valid_key = cols[None, :] >= pad_t[:, None]                               # [B, T]
    positions = (cols[None, :] - pad_t[:, None]).clamp(min=0)                 # [B, T]
    attn = model.layers[0].self_attn
    caches = [(torch.zeros(b, attn.num_kv_heads, total, attn.head_dim, dtype=dtype),
               torch.zeros(b, attn.num_kv_heads, total, attn.head_dim, dtype=dtype)) for _ in model.layers]
    feats = torch.zeros(b, total, model.config.hidden_size, dtype=dtype)
    answers: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    start, new = 0, ids
    for _ in range(max_new_tokens):
        n = new.shape[1]
        h = _forward(model, new, caches, start, positions[:, start:start + n], valid_key[:, :start + n])
        feats[:, start:start + n] = h
        token = model.logits(h[:, -1]).argmax(-1)                              # [B]
        for i, t in enumerate(token.tolist()):                                # one copy, not B reads
            if not done[i]:
                answers[i].append(t)
                done[i] = t in eos_ids
        start += n
        if bool(done.all()):
            break
        new = token[:, None]
    out = []
    for i, p in enumerate(prompts):
        n = len(p) + len(answers[i]) - 1
        out.append(Sequence(list(p), answers[i], feats[i, pad[i]:pad[i] + n].clone()))
    return out


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


def _forward(model, ids, caches, start, positions, valid_key):
    """ids [B, N] at columns start.. -> final normed hidden states [B, N, hidden]."""
    b, n = ids.shape
    h = model.embed_tokens(ids)
    cos = model.rotary.cos[positions].to(h.dtype).unsqueeze(2)                # [B, N, 1, D]
    sin = model.rotary.sin[positions].to(h.dtype).unsqueeze(2)
    q_cols = torch.arange(start, start + n)
    mask = valid_key[:, None, None, :] & (torch.arange(start + n)[None, :] <= q_cols[:, None])[None, None]
    for layer, (kc, vc) in zip(model.layers, caches):
        a = layer.self_attn
        q, k, v = batched_qkv(layer, h, (cos, sin))
        kc[:, :, start:start + n] = k.transpose(1, 2)
        vc[:, :, start:start + n] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:, :, :start + n], vc[:, :, :start + n],
                                             attn_mask=mask, scale=a.scale, enable_gqa=True)
        h = h + a.o_proj(out.transpose(1, 2).reshape(b, n, a.q_size))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, batch_size: int,
             log=print) -> tuple[list[Sequence], dict]:
    """Answers to chat conversations, in batches of similar prompt length. Returns the
    sequences (in the input order) and the throughput."""
    eos_ids = {tokenizer.eos_token_id}
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in conversations]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    result: list[Sequence | None] = [None] * len(prompts)
    t0, answer_tokens = time.perf_counter(), 0
    for s in range(0, len(order), batch_size):
        chunk = order[s:s + batch_size]
        for i, seq in zip(chunk, generate_batch(model, [prompts[i] for i in chunk], max_new_tokens, eos_ids)):
            result[i] = seq
            answer_tokens += len(seq.answer_ids)
        elapsed = time.perf_counter() - t0
        log(f"  generated {min(s + batch_size, len(order))}/{len(order)} answers, {answer_tokens} tokens, "
            f"{answer_tokens / elapsed:.0f} tok/s")
    elapsed = time.perf_counter() - t0
    return result, {"answer_tokens": answer_tokens, "seconds": elapsed, "tok_s": answer_tokens / elapsed,
                    "batch_size": batch_size, "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


# ---- prompts ------------------------------------------------------------------------------------
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
    "List five key terms related to {s}, with a one-line definition each.",
    "Write a numbered list of steps to get started with {s}.",
]
CODE_TASKS = [
    "Write a Python function that {c}.", "Show me how to {c} in Python, with a short example.",
    "Write a JavaScript function that {c}.", "Explain, step by step, how you would write code that {c}.",
]
CODE_SUBJECTS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "finds the largest number in a list", "computes the factorial of n", "sorts a list of names",
    "reads a CSV file and prints each row", "merges two sorted lists", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "computes the Fibonacci numbers", "checks if a word is a palindrome",
    "computes the average of a list", "finds the vowels in a string", "flattens a nested list",
    "counts how often each letter appears", "validates an email address", "returns the n-th triangle number",
    "implements binary search", "parses a date string", "sums the digits of a number",
    "generates a random password", "checks whether two words are anagrams", "rotates a list by k places",
]
FOLLOW_UPS = ["Can you give me an example?", "Can you explain that more simply?", "Why is that?",
              "Can you summarize that in one sentence?", "What else should I know?",
              "Can you make it shorter?"]
HELD_OUT_PROMPTS = [   # never trained on; the first ten are engine.bench.scenarios' CHAT_PROMPTS
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


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def training_conversations(n: int, seed: int) -> list[list[dict]]:
    """n conversations in a seeded order: subject x task chat (about half), code requests,
    explanations of Python documentation excerpts (pydoc_data.topics ships with Python),
    and two-turn chats whose second turn is a follow-up."""
    import pydoc_data.topics as topics
    rng = random.Random(seed)
    chat = [t.format(s=s) for s in SUBJECTS for t in TASKS]
    code = [t.format(c=c) for c in CODE_SUBJECTS for t in CODE_TASKS]
    excerpts = []
    for key in sorted(topics.topics):
        text = " ".join(topics.topics[key].split())
        for start in range(0, min(len(text), 1200), 400):
            excerpts.append(text[start:start + 300])
    doc_tasks = ["Explain this passage from the Python documentation in plain words:\n\n{x}",
                 "Summarize the following text:\n\n{x}", "What does this mean?\n\n{x}"]
    docs = [doc_tasks[i % len(doc_tasks)].format(x=x) for i, x in enumerate(excerpts)]
    for pool in (chat, code, docs):
        rng.shuffle(pool)
    multi = []
    for i, s in enumerate(SUBJECTS):
        first = TASKS[i % len(TASKS)].format(s=s)
        multi.append([*user(first), {"role": "assistant", "content": f"Here is a short answer about {s}: "
                      f"it is a topic many people find interesting, and there is a lot to say about it."},
                      *user(FOLLOW_UPS[i % len(FOLLOW_UPS)])])
    held = set(HELD_OUT_PROMPTS)
    n_code, n_multi = min(n // 6, len(code)), min(n // 8, len(multi))
    n_docs = min(n // 6, len(docs))
    convs = ([user(p) for p in code[:n_code]] + [user(p) for p in docs[:n_docs]] + multi[:n_multi]
             + [user(p) for p in chat if p not in held][:n - n_code - n_docs - n_multi])
    rng.shuffle(convs)
    return convs


# ---- the data set on disk -----------------------------------------------------------------------
def save_sequences(seqs: list[Sequence], path, info: dict) -> None:
    import json
    from safetensors.torch import save_file
    tensors = {}
    for i, s in enumerate(seqs):
        tensors[f"{i}.prompt"] = torch.tensor(s.prompt_ids, dtype=torch.int32)
        tensors[f"{i}.answer"] = torch.tensor(s.answer_ids, dtype=torch.int32)
        tensors[f"{i}.features"] = s.features.to(torch.bfloat16).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp), metadata={"info": json.dumps(info)})
    tmp.replace(path)


def load_sequences(path) -> tuple[list[Sequence], dict]:
    import json
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        info = json.loads(f.metadata()["info"])
        n = len([k for k in f.keys() if k.endswith(".prompt")])
        seqs = [Sequence(f.get_tensor(f"{i}.prompt").tolist(), f.get_tensor(f"{i}.answer").tolist(),
                         f.get_tensor(f"{i}.features")) for i in range(n)]
    return seqs, info


def answers(target, conversations: list[list[dict]], max_new_tokens: int, batch_size: int, cache, log=print,
            model=None) -> tuple[list[Sequence], dict]:
    """The target's greedy answers to `conversations` (bf16, as `dataset` makes them), kept in
    `cache` keyed by the conversations and everything else that changes them. For a part of
    the data (engine.training.diagnose) without generating all of it."""
    import hashlib
    import json
    key = hashlib.sha256(json.dumps([conversations, max_new_tokens, batch_size, target.identity,
                                     torch.__version__]).encode()).hexdigest()[:16]
    path = cache / f"answers-{key}.safetensors"
    if path.is_file():
        log(f"reusing {len(conversations)} generated answers in {path}")
        return load_sequences(path)
    if model is None:
        from engine.loading.loader import load_model
        model = load_model(target.folder, dtype=torch.bfloat16, max_positions=target.model.max_positions).model
    log(f"generating answers for {len(conversations)} conversations, {batch_size} per pass")
    seqs, info = generate(model, target.tokenizer, conversations, max_new_tokens, batch_size, log)
    info.update(conversations=len(conversations), key=key)
    save_sequences(seqs, path, info)
    return seqs, info


def dataset(target, n_train: int, seed: int, max_new_tokens: int, batch_size: int, cache, log=print,
            threads: int | None = None) -> tuple[list[Sequence], list[Sequence], dict]:
    """(train, held-out, info): generated once in bf16 and kept in `cache` (a folder), keyed by
    everything that changes it."""
    import hashlib
    import json
    key = hashlib.sha256(json.dumps([n_train, seed, max_new_tokens, batch_size, target.identity,
                                     torch.__version__]).encode()).hexdigest()[:16]
    train_path, held_path = cache / f"{key}.train.safetensors", cache / f"{key}.heldout.safetensors"
    if train_path.is_file() and held_path.is_file():
        log(f"reusing the generated data in {cache} ({key})")
        train, info = load_sequences(train_path)
        held, _ = load_sequences(held_path)
        return train, held, info
    from engine.loading.loader import load_model
    model = load_model(target.folder, dtype=torch.bfloat16, max_positions=target.model.max_positions).model
    log(f"generating held-out answers for {len(HELD_OUT_PROMPTS)} prompts")
    held, _ = generate(model, target.tokenizer, [user(p) for p in HELD_OUT_PROMPTS], max_new_tokens, batch_size, log)
    convs = training_conversations(n_train, seed)
    log(f"generating training answers for {len(convs)} conversations, {batch_size} per pass")
    train, info = generate(model, target.tokenizer, convs, max_new_tokens, batch_size, log)
    info.update(threads=threads or torch.get_num_threads(), conversations=len(convs), key=key)
    save_sequences(held, held_path, info)
    save_sequences(train, train_path, info)
    return train, held, info
