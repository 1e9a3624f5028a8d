"""The draft head's training conversations and its data on disk: what the engine is asked
(engine.training.served_data serves them), and a sequence's tokens with the target's final
hidden state at every position.

Used only by the recipe (`engine.training.distill`); inference never imports it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Sequence:
    prompt_ids: list[int]
    answer_ids: list[int]
    features: torch.Tensor        # [len(prompt) + len(answer) - 1, hidden]: the target's final
                                  # normed hidden state at every position but the last token's

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


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
    "Tell me something surprising about {s}.", "How has {s} changed over time?",
    "Compare {s} with something similar, and say how they differ.", "What questions do people often ask about {s}?",
    "Write a short dialogue between two friends talking about {s}.", "What would the world be like without {s}?",
    "Give me a fun quiz with three questions about {s}, and the answers.", "Describe {s} using an analogy.",
    "What should a beginner know about {s}?", "Write a tweet-length summary of {s}.",
    "What are the main parts of {s}?", "Write a short persuasive paragraph about {s}.",
    "Explain {s} in three bullet points.", "What is the future of {s}?",
    "Write a short news headline and lead paragraph about {s}.", "How does {s} affect everyday life?",
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
    "counts the lines in a file", "capitalizes every word in a sentence", "finds the second largest number",
    "converts a number to binary", "checks whether a year is a leap year", "computes the greatest common divisor",
    "transposes a matrix", "groups words by their first letter", "finds the longest word in a sentence",
    "computes the median of a list", "reverses the words of a sentence", "checks whether brackets are balanced",
    "converts a dictionary to JSON", "downloads a web page", "computes compound interest",
    "shuffles a deck of cards", "counts the vowels in a string", "finds common elements of two lists",
    "splits a list into chunks", "formats a number with thousands separators", "draws a triangle of stars",
    "implements a stack", "implements a queue", "computes the distance between two points",
]
CODE_TASKS_MORE = [
    "How do I write a function that {c}? Please explain the code.", "Write a short program that {c}, with comments.",
    "Write a Java method that {c}.", "What is the simplest way to write code that {c}?",
]
FOLLOW_UPS = ["Can you give me an example?", "Can you explain that more simply?", "Why is that?",
              "Can you summarize that in one sentence?", "What else should I know?",
              "Can you make it shorter?"]
HELD_OUT_PROMPTS = [   # never trained on; the first ten are engine.workload's CHAT_PROMPTS (the benches')
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
    "How do airplanes stay in the air?", "Write a short bedtime story about a brave mouse.",
    "What are the benefits of drinking water?", "Explain the difference between a virus and a bacterium.",
    "Give me five ideas for a rainy afternoon.", "How do I write a good cover letter?",
    "What is the Pythagorean theorem used for in real life?", "Translate 'good morning' into three languages.",
    "Write a Python function that checks whether a list is sorted.", "What is a black hole made of?",
    "How should I prepare for a job interview?", "Summarize the plot of Romeo and Juliet.",
    "What is the difference between RAM and storage?", "Why do cats purr?",
    "Write an email asking my manager for a day off.", "What are three good habits for studying?",
    "How does a compass work?", "Explain what inflation means for savings.",
    "Write a short poem about autumn leaves.", "What is the tallest mountain in the world?",
    "How can I reduce stress at work?", "Explain recursion with a simple example.",
    "What should I pack for a weekend camping trip?", "Describe how bread rises.",
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
    code = [t.format(c=c) for c in CODE_SUBJECTS for t in CODE_TASKS + CODE_TASKS_MORE]
    excerpts = []
    for key in sorted(topics.topics):
        text = " ".join(topics.topics[key].split())
        for start in range(0, len(text), 400):
            excerpts.append(text[start:start + 300])
    doc_tasks = ["Explain this passage from the Python documentation in plain words:\n\n{x}",
                 "Summarize the following text:\n\n{x}", "What does this mean?\n\n{x}"]
    docs = [doc_tasks[i % len(doc_tasks)].format(x=x) for i, x in enumerate(excerpts)]
    for pool in (chat, code, docs):
        rng.shuffle(pool)
    multi = []
    for i, s in enumerate(SUBJECTS):
        for j, follow in enumerate(FOLLOW_UPS):
            first = TASKS[(i + 5 * j) % len(TASKS)].format(s=s)
            multi.append([*user(first), {"role": "assistant", "content": f"Here is a short answer about {s}: "
                          f"it is a topic many people find interesting, and there is a lot to say about it."},
                          *user(follow)])
    rng.shuffle(multi)
    held = set(HELD_OUT_PROMPTS)
    n_code, n_multi = min(n // 6, len(code)), min(n // 8, len(multi))
    n_docs = min(n // 6, len(docs))
    convs = ([user(p) for p in code[:n_code]] + [user(p) for p in docs[:n_docs]] + multi[:n_multi]
             + [user(p) for p in chat if p not in held][:n - n_code - n_docs - n_multi])
    rng.shuffle(convs)
    return convs


def served_conversations(n: int, seed: int, system_prompt: str) -> list[list[dict]]:
    """n conversations for data served by the engine: every training conversation twice, once
    as the bench sends it (the chat template's own default system prompt) and once with the
    app's system prompt, in a seeded order; the first n."""
    pool = training_conversations(1 << 30, seed)
    variants = pool + [[{"role": "system", "content": system_prompt}, *c] for c in pool]
    random.Random(seed + 1).shuffle(variants)
    if n > len(variants):
        raise ValueError(f"{n} conversations asked for; the recipe's prompts make {len(variants)}")
    return variants[:n]


# ---- the data set on disk -----------------------------------------------------------------------
def save_sequences(seqs: list[Sequence], path, info: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    import json
    from safetensors.torch import save_file
    tensors = {}
    for i, s in enumerate(seqs):
        tensors[f"{i}.prompt"] = torch.tensor(s.prompt_ids, dtype=torch.int32)
        tensors[f"{i}.answer"] = torch.tensor(s.answer_ids, dtype=torch.int32)
        tensors[f"{i}.features"] = s.features.to(dtype).contiguous()
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
