"""A serving workload: what it is (Workload), its requests (make_jobs), and a driver that feeds
them to an engine (WorkloadRun). `python -m engine.bench serve` and the app's load panel
both use it, so both serve the same requests the same way.

The workload follows vLLM's `bench serve`: `num_prompts` requests, arriving all at once
(`request_rate` None, the CLI's inf) or as a gamma process of that rate (`burstiness` 1:
Poisson), at most `max_concurrency` outstanding; prompts from `prompt_set` (chat, repeat, edit:
multi-turn chats that revise an earlier answer, or random token ids of `input_len`), each after
a shared system prompt of `shared_prefix_len` tokens (SGLang's generated-shared-prefix idea),
`output_len` tokens each (EOS ignored, as vLLM's random dataset does), `seed` for everything
random.

Its fields are rows of WORKLOAD_SETTINGS (engine.config.Setting: type, default, range), the
one place they are defined: the dataclass, its validation, the session profile's "workload"
and the load panel's controls all come from them. Qt-free.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field, make_dataclass

from engine.config import NEXT_REQUEST, Setting, SamplingParams
from engine.errors import ConfigError
from engine.metrics import RequestStats, StepEvent, ratio, serving_summary

WORKLOAD = "workload"
WORKLOAD_SETTINGS: tuple[Setting, ...] = (
    Setting("max_concurrency", int, 16, WORKLOAD, NEXT_REQUEST, "Concurrent users", low=1, high=4096,
            help="the most requests outstanding at once"),
    Setting("request_rate", float, None, WORKLOAD, NEXT_REQUEST, "Arrival rate (/s)", low=0.01, high=1_000_000,
            optional=True, off_text="all at once", step=0.5,
            help="requests per second, a gamma process of shape 'burstiness'; not set: all arrive at once"),
    Setting("burstiness", float, 1.0, WORKLOAD, NEXT_REQUEST, "Burstiness", low=0.05, high=100.0, step=0.5,
            help="the gamma shape of the arrival gaps: 1 is a Poisson process, below 1 burstier, above steadier"),
    Setting("num_prompts", int, 64, WORKLOAD, NEXT_REQUEST, "Requests", low=1, high=100_000),
    Setting("shared_prefix_len", int, 0, WORKLOAD, NEXT_REQUEST, "Shared prefix (tok)", low=0,
            high=100_000, help="a system prompt of this many tokens before every request (0: none)"),
    Setting("prompt_set", str, "chat", WORKLOAD, NEXT_REQUEST, "Prompt set",
            choices={"chat": "chat questions", "repeat": "repeat a passage",
                     "edit": "edit an earlier answer (multi-turn)", "random": "random token ids"}),
    Setting("input_len", int, 256, WORKLOAD, NEXT_REQUEST, "Random prompt (tok)", low=1, high=1_000_000,
            help="prompt tokens for the random prompt set"),
    Setting("output_len", int, 64, WORKLOAD, NEXT_REQUEST, "Output (tok)", low=1, high=131_072,
            help="tokens generated per request (end of sequence ignored)"),
    Setting("seed", int, 0, WORKLOAD, NEXT_REQUEST, "Seed", low=0, high=2**31 - 1,
            help="the arrivals' and the random prompts' seed"),
)
WORKLOAD_BY_KEY = {s.key: s for s in WORKLOAD_SETTINGS}


class _WorkloadChecks:
    def __post_init__(self):
        for key in self.__dataclass_fields__:
            object.__setattr__(self, key, WORKLOAD_BY_KEY[key].validate(getattr(self, key)))

    @property
    def arrival_rate(self) -> float:
        """Requests per second; inf: all at once."""
        return float("inf") if self.request_rate is None else self.request_rate

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data, source: str = "workload") -> "Workload":
        """From plain data (a profile's "workload"); missing fields take their defaults, an
        unknown or out-of-range one raises ConfigError naming it."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must be an object of workload fields, got {type(data).__name__}")
        unknown = sorted(set(data) - set(WORKLOAD_BY_KEY))
        if unknown:
            raise ConfigError(f"{source}: unknown workload fields {unknown} (known: {', '.join(WORKLOAD_BY_KEY)})")
        return cls(**data)


Workload = make_dataclass(
    "Workload", [(s.key, s.type if not s.optional else s.type | None, field(default=s.default))
                 for s in WORKLOAD_SETTINGS],
    bases=(_WorkloadChecks,), frozen=True,
    namespace={"__doc__": "A serving workload (the rows of WORKLOAD_SETTINGS).", "__module__": __name__})


# ---- prompt sets ------------------------------------------------------------------------
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
    "What causes the seasons on Earth?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "How do I make a cup of tea?",
    "What is photosynthesis?",
]

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
           "single step. All that glitters is not gold. Actions speak louder than words. Every cloud "
           "has a silver lining. Fortune favours the bold. Knowledge is power. Time is money.")
REPEAT_PROMPTS = [f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
                  f"Copy this text exactly:\n\n{PASSAGE}",
                  f"Please write out this passage again without changes:\n\n{PASSAGE}",
                  f"Echo back the text below verbatim.\n\n{PASSAGE}"]

# Multi-turn chats in which the assistant rewrites or extends its own earlier answer: what
# coding tools and agents send (fix a function, rename a variable, add a paragraph). Each is
# (user, assistant, user); the reply mostly repeats the earlier answer with the change made.
_MEAN = """def average(values):
    total = 0
    for i in range(len(values) - 1):
        total += values[i]
    return total / len(values)"""
_COUNT = """def count_words(text):
    lst = text.split()
    counts = {}
    for w in lst:
        counts[w] = counts.get(w, 0) + 1
    return counts"""
_CART = """function calc(items) {
  let sum = 0;
  for (const item of items) {
    sum += item.price * item.quantity;
  }
  return sum;
}"""
_SQL = """SELECT customers.name, COUNT(orders.id) AS order_count
FROM customers
JOIN orders ON orders.customer_id = customers.id
GROUP BY customers.name;"""
_ESSAY = ("Walking every day is one of the simplest ways to stay healthy. It strengthens the heart, "
          "helps control weight and lifts the mood, and it needs no equipment or membership.\n\n"
          "A good habit starts small: ten minutes after lunch, then twenty, then a longer walk at the "
          "weekend. Walking with a friend makes it easier to keep going.")
_EMAIL = ("Hi team,\n\nOur planning meeting will be on Tuesday at 10 am in room 4B. Please bring your "
          "project updates and a list of open questions. The meeting should take about an hour.\n\n"
          "Thanks,\nMaria")
_STEPS = ("1. Mix the flour, sugar and salt in a large bowl.\n2. Add the eggs and milk and whisk until "
          "smooth.\n3. Pour the batter into a greased tin.\n4. Bake for 25 minutes until golden.")
EDIT_CHATS = [
    ("Write a Python function that returns the average of a list of numbers.", f"```python\n{_MEAN}\n```",
     "The loop skips the last value. Fix the bug and show the whole corrected function."),
    ("Write a Python function that counts how often each word appears in a text.", f"```python\n{_COUNT}\n```",
     "Rename the variable lst to words everywhere and show the full function again."),
    ("Write a JavaScript function that adds up the price of the items in a shopping cart.",
     f"```javascript\n{_CART}\n```", "Rename the function calc to cartTotal and show the whole code again."),
    ("Write an SQL query that counts the orders of each customer.", f"```sql\n{_SQL}\n```",
     "Add ORDER BY order_count DESC to the query and show the full query."),
    ("Write two short paragraphs about why walking is good for you.", _ESSAY,
     "Add a third paragraph about walking in nature. Repeat the first two paragraphs unchanged."),
    ("Write a short email inviting my team to a planning meeting.", _EMAIL,
     "Move the meeting to Thursday at 2 pm and write the whole email again."),
    ("Give me the steps to bake a simple cake.", _STEPS,
     "Add a first step: preheat the oven to 180 degrees. Write out the full list again."),
    ("Write a Python function that counts how often each word appears in a text.", f"```python\n{_COUNT}\n```",
     "Add a docstring to the function and show the complete code."),
]


def chat(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def edit_chat(i: int, system: str | None = None, tag: str = "") -> list[dict]:
    """The i-th edit conversation (EDIT_CHATS, cycled): its last message is the user's edit
    request, with `tag` appended."""
    ask, answer, edit = EDIT_CHATS[i % len(EDIT_CHATS)]
    return chat(ask, system) + [{"role": "assistant", "content": answer}, {"role": "user", "content": edit + tag}]


def prompt_messages(prompt_set: str, i: int, system: str | None = None, tag: str = "") -> list[dict]:
    """The i-th prompt of a text prompt set (chat, repeat, edit; cycled), `tag` appended to its
    last message."""
    if prompt_set == "edit":
        return edit_chat(i, system, tag)
    texts = CHAT_PROMPTS if prompt_set == "chat" else REPEAT_PROMPTS
    return chat(texts[i % len(texts)] + tag, system)


def held_out_text() -> str:
    """English documentation that ships with Python (pydoc's topic texts)."""
    import pydoc_data.topics as topics
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def system_prompt_of(tokenizer, n_tokens: int) -> str:
    """A system prompt of at most n_tokens tokens (the longest tail of held_out_text that fits)."""
    words = held_out_text().split(" ")
    text = "You are a careful assistant. Follow these reference notes.\n\n"
    lo, hi = 0, len(words)
    while lo < hi:                                   # the longest prefix with <= n_tokens tokens
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode(text + " ".join(words[-mid:]), add_special_tokens=False)) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text + " ".join(words[-lo:])


# ---- requests ----------------------------------------------------------------------------
@dataclass
class Job:
    arrival_s: float
    prompt: list[int]
    max_tokens: int


def make_jobs(eng, workload: Workload) -> list[Job]:
    """The workload's requests as token ids, each with its arrival time: the same list for the
    same workload and tokenizer (every arm of a comparison serves the same requests)."""
    rng = random.Random(workload.seed)
    n, prefix_len = workload.num_prompts, workload.shared_prefix_len
    system = system_prompt_of(eng.tokenizer, prefix_len) if prefix_len else None
    prompts = []
    for i in range(n):
        if workload.prompt_set == "random":
            prefix = eng.encode(system)[:prefix_len] if system else []
            prompts.append(prefix + [rng.randrange(100, eng.tokenizer.vocab_size) for _ in range(workload.input_len)])
        else:
            prompts.append(eng.encode(prompt_messages(workload.prompt_set, i, system, f" (request {i})")))
    arrivals = arrival_times(n, workload.arrival_rate, workload.burstiness, rng)
    return [Job(t, p, workload.output_len) for t, p in zip(arrivals, prompts)]


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """vLLM's arrivals: all at 0 for an infinite rate, else gamma-distributed gaps with mean
    1/rate and shape `burstiness` (1: a Poisson process; < 1 burstier, > 1 steadier)."""
    if rate == float("inf"):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


# ---- the driver ---------------------------------------------------------------------------
MAX_IDLE_WAIT_S = 0.05      # nothing to run: wait at most this long for the next arrival


class WorkloadRun:
    """Feeds jobs to an engine and steps it: each `step()` submits the jobs that have arrived
    (at most max_concurrency outstanding) and runs ONE engine step. The engine may serve other
    requests meanwhile (the app's chat): they advance in the same steps, and `step()` returns
    every event so the caller can route theirs; the run's figures count its own requests only.
    Drive it from the engine's thread; `cancel` ends it at the next step."""

    def __init__(self, eng, jobs: list[Job], max_concurrency: int, clock=time.perf_counter):
        self.eng, self.max_concurrency, self.clock = eng, max_concurrency, clock
        self.pending = sorted(jobs, key=lambda j: j.arrival_s)
        self.total = len(jobs)
        self.outstanding: set[int] = set()
        self.finished: list[RequestStats] = []
        self.cancelled = 0
        self.max_running = self.preemptions = self.steps = self.running_sum = 0
        self.t0 = clock()
        self.end_s: float | None = None
        self.last_events: list[StepEvent] = []      # the run's own events of the last step
        self.last_pass_ran = False

    @property
    def done(self) -> bool:
        return not self.pending and not self.outstanding

    def elapsed_s(self) -> float:
        return (self.end_s if self.end_s is not None else self.clock()) - self.t0

    def idle_wait_s(self) -> float:
        """How long to wait before the next step when the engine has nothing to run."""
        if self.eng.has_work or not self.pending:
            return 0.0
        return max(0.0, min(self.pending[0].arrival_s - self.elapsed_s(), MAX_IDLE_WAIT_S))

    def submit_due(self) -> None:
        now = self.elapsed_s()
        while self.pending and self.pending[0].arrival_s <= now and len(self.outstanding) < self.max_concurrency:
            job = self.pending.pop(0)
            self.outstanding.add(self.eng.submit(job.prompt, SamplingParams(max_tokens=job.max_tokens,
                                                                            stop_on_eos=False)))

    def step(self) -> list[StepEvent]:
        """Submit what has arrived, run one engine step (if anything runs); every event of it."""
        self.submit_due()
        self.last_events, self.last_pass_ran = [], False
        if not self.eng.has_work:
            return []
        before, owned = self.eng.step_count, set(self.outstanding)
        events = self.eng.step()
        self.last_events = [e for e in events if e.request_id in owned]
        for event in self.last_events:
            if event.finished:
                self.outstanding.discard(event.request_id)
                if event.finish_reason == "cancelled":
                    self.cancelled += 1
                else:
                    self.finished.append(event.summary)
        step = self.eng.last_step
        self.last_pass_ran = self.eng.step_count > before and step is not None    # not only cancellations
        if self.last_pass_ran:
            self.max_running, self.preemptions = max(self.max_running, step.running), self.preemptions + step.preemptions
            self.steps, self.running_sum = self.steps + 1, self.running_sum + step.running
        if self.done and self.end_s is None:
            self.end_s = self.clock()
        return events

    def step_figures(self) -> dict | None:
        """The last step as plain data for live plots (None when no pass ran): the engine's
        running / waiting requests, KV usage (share of blocks, and bytes held and allocated),
        preemptions, and for the run's own requests the tokens they got, the TTFTs of those
        that got their first one and the inter-token gaps of the others (ITL)."""
        if not self.last_pass_ran:
            return None
        step, (used, capacity) = self.eng.last_step, self.eng.kv_bytes()
        mine = self.last_events
        return {"t": self.elapsed_s(), "running": step.running, "waiting": step.waiting,
                "kv_usage": step.kv_usage, "kv_bytes_used": used, "kv_bytes_capacity": capacity,
                "preemptions": step.preemptions, "output_tokens": sum(e.num_tokens for e in mine),
                "ttft_s": [e.ttft_s for e in mine if e.ttft_s is not None],
                "itl_s": [e.step_time_s for e in mine if e.is_decode and e.num_tokens],
                "completed": len(self.finished), "cancelled": self.cancelled, "total": self.total,
                # for speculation's speedup by batch size (engine.metrics.speculation_speedup_by_batch)
                "engine_step": {key: getattr(step, key) for key in ("batch_size", "prefill_tokens", "drafted",
                                                                      "accepted", "step_s")}}

    def cancel(self) -> None:
        """Drop the jobs not yet submitted and cancel the outstanding ones (they end at the next step)."""
        self.pending.clear()
        for request_id in list(self.outstanding):
            self.eng.cancel(request_id)

    def summary(self) -> dict:
        """The serving figures of the requests that finished (engine.metrics.serving_summary),
        plus max_concurrent, preemptions (every preemption in the engine's steps), mean_running
        and steps."""
        return serving_summary(self.finished, self.elapsed_s()) | {
            "max_concurrent": self.max_running, "preemptions": self.preemptions,
            "mean_running": ratio(self.running_sum, self.steps), "steps": self.steps}


def run_to_completion(eng, jobs: list[Job], max_concurrency: int) -> dict:
    """Serve every job (headless), sleeping while nothing has arrived; the run's summary."""
    run = WorkloadRun(eng, jobs, max_concurrency)
    while not run.done:
        run.step()
        wait = run.idle_wait_s()
        if wait:
            time.sleep(wait)
    return run.summary()
