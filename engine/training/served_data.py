"""The draft head's training data from the engine as it serves: its greedy answers and the
final hidden states its proposers are handed, for every position.

Used only by the recipe (`engine.training.distill`) and its diagnosis; inference never imports it.

The engine runs as a user's default runs it (the target as loaded, its kernels, its dtype by
`auto`, compiled where that is on), many conversations at once, prefix caching off so every
prompt position is computed and seen. Its `hidden_sink` receives each pass's rows exactly as
`EagleProposer.target_pass` receives them, so the features a head is trained on are the ones
it is served, bit for bit (tests/test_served_data.py checks this). Greedy answers in batches
are a request's own answers: the engine is batch-invariant.

The data is kept in files of SHARD conversations under the cache folder, each named by
everything that changes it; a run that stops resumes at the first file missing.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from engine.config import SamplingParams
from engine.training.distill_data import Sequence, load_sequences, save_sequences

SHARD = 256                 # conversations per file on disk
FEATURE_DTYPE = torch.float16


class FeatureRecorder:
    """The engine's hidden_sink: each request's final hidden states by position, copied at once
    (a compiled step's outputs may be buffers the next pass reuses)."""

    def __init__(self, hidden: int):
        self.hidden = hidden
        self.rows: dict[int, torch.Tensor] = {}
        self.have: dict[int, int] = {}       # positions 0..have-1 are known

    def __call__(self, request_id: int, start: int, hidden: torch.Tensor) -> None:
        have = self.have.get(request_id, 0)
        if start > have:
            raise RuntimeError(f"request {request_id}: a pass started at position {start} but features end at "
                               f"{have} (a prefix-cache hit or a missed pass: turn prefix caching off)")
        buf = self.rows.get(request_id)
        end = start + hidden.shape[0]
        if buf is None or buf.shape[0] < end:
            grown = torch.empty(max(end, 2 * (0 if buf is None else buf.shape[0]), 256), self.hidden, dtype=FEATURE_DTYPE)
            if buf is not None:
                grown[:buf.shape[0]] = buf
            self.rows[request_id] = buf = grown
        buf[start:end] = hidden.detach().to("cpu", FEATURE_DTYPE)
        self.have[request_id] = max(have, end)

    def take(self, request_id: int, positions: int) -> torch.Tensor:
        """Features of positions 0..positions-1, and the request forgotten."""
        have, buf = self.have.pop(request_id, 0), self.rows.pop(request_id, None)
        if have < positions or buf is None:
            raise RuntimeError(f"request {request_id}: features for {have} positions, {positions} needed")
        return buf[:positions].clone()


def serve(eng, conversations: list[list[dict]], max_new_tokens: int, concurrency: int,
          log=print) -> tuple[list[Sequence], dict]:
    """Greedy answers to `conversations` from `eng`, `concurrency` requests in flight, each with
    the features of every position but its last token's. Returns them in the input order and
    the throughput."""
    if eng.config.enable_prefix_caching:
        raise ValueError("prefix caching must be off: a cached prompt position has no features")
    recorder = FeatureRecorder(eng.target_model.hf_config.hidden_size)
    eng.hidden_sink = recorder
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    out: list[Sequence | None] = [None] * len(conversations)
    prompts: dict[int, tuple[int, list[int]]] = {}        # request id -> (index, prompt ids)
    answers: dict[int, list[int]] = {}
    pending, tokens, t0 = iter(range(len(conversations))), 0, time.perf_counter()
    try:
        while True:
            while len(prompts) < concurrency and (i := next(pending, None)) is not None:
                ids = eng.encode(conversations[i])
                rid = eng.submit(ids, params)
                prompts[rid], answers[rid] = (i, ids), []
            if not prompts:
                break
            for event in eng.step():
                rid = event.request_id
                if rid not in prompts:
                    continue
                answers[rid].extend(event.token_ids)
                if event.finished:
                    i, ids = prompts.pop(rid)
                    answer = answers.pop(rid)
                    out[i] = Sequence(ids, answer, recorder.take(rid, len(ids) + len(answer) - 1))
                    tokens += len(answer)
    finally:
        eng.hidden_sink = None
    seconds = time.perf_counter() - t0
    return out, {"answer_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "concurrency": concurrency}


def parity(eng, seq: Sequence, head_folder: Path, k: int = 4) -> dict:
    """The parity check of a finished head: `seq`'s prompt served again, alone, with the head
    drafting k tokens a step (verify passes keep the accepted rows): the features handed to
    its proposer against those `seq` (the data) holds, and the greedy answers. Training and
    serving agree when the answer is the same and the features differ by 0."""
    before = {key: getattr(eng.config, key) for key in ("proposer", "eagle_head", "num_speculative_tokens",
                                                         "speculation_policy")}
    eng.reconfigure(proposer="eagle", eagle_head=str(head_folder), num_speculative_tokens=k, speculation_policy="fixed")
    recorder = FeatureRecorder(seq.features.shape[1])
    eng.hidden_sink = recorder
    try:
        rid = eng.submit(seq.prompt_ids, SamplingParams(max_tokens=len(seq.answer_ids), temperature=0.0))
        answer, proposed, accepted = [], 0, 0
        while eng.has_work:
            for event in eng.step():
                answer += event.token_ids
                proposed, accepted = proposed + event.proposed, accepted + event.accepted
        n = min(len(answer), len(seq.answer_ids))
        positions = len(seq.prompt_ids) + n - 1
        served = recorder.take(rid, positions)
    finally:
        eng.hidden_sink = None
        eng.reconfigure(**before)
    diff = (served.float() - seq.features[:positions].float()).abs()
    return {"positions": positions, "answer_identical": answer == seq.answer_ids, "proposed": proposed,
            "accepted": accepted, "max_abs_feature_diff": float(diff.max()),
            "positions_differing": int((diff.amax(dim=-1) > 0).sum())}


def served_engine(target_reference: str = "default", dtype: str = "auto"):
    """The engine as the app serves `target_reference` by default, prefix caching off and no
    speculation (the features of every position, from plain passes); its compiled step warm."""
    from engine import EngineConfig, LLMEngine
    eng = LLMEngine.load(target_reference, EngineConfig(enable_prefix_caching=False, proposer="off", dtype=dtype))
    eng.warm_compiled_step()
    return eng


def served_key(eng, conversations: list[list[dict]], max_new_tokens: int) -> str:
    """Names the data: the conversations, the answer cap, the target's weights and every setting
    that changes its features (dtype, weight format, kernels, compile)."""
    s = eng.settings()
    what = [conversations, max_new_tokens, eng.target_model.identity, torch.__version__,
            {k: s.get(k) for k in ("dtype", "weight_dtype", "kernels", "compile")}]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]


def served_dataset(eng, conversations: list[list[dict]], max_new_tokens: int, concurrency: int, cache: Path,
                   log=print) -> tuple[list[Sequence], dict]:
    """serve(), kept in files of SHARD conversations under `cache`/served, each named by its own
    conversations and the engine (served_key): a shard already there is read, not served
    again, whichever data set it was served for (the recipe's first shard is diagnose's data)."""
    seqs: list[Sequence] = []
    info = {"answer_tokens": 0, "seconds": 0.0, "conversations": len(conversations), "concurrency": concurrency,
            "settings": {k: eng.settings().get(k) for k in ("dtype", "weight_dtype", "compile")}}
    for lo in range(0, len(conversations), SHARD):
        part_convs = conversations[lo:lo + SHARD]
        path = cache / "served" / f"{served_key(eng, part_convs, max_new_tokens)}.safetensors"
        if path.is_file():
            part, part_info = load_sequences(path)
        else:
            part, part_info = serve(eng, part_convs, max_new_tokens, concurrency, log)
            save_sequences(part, path, part_info, FEATURE_DTYPE)
        seqs += part
        info["answer_tokens"] += part_info["answer_tokens"]
        info["seconds"] += part_info["seconds"]
        log(f"  served {lo + len(part_convs)}/{len(conversations)} conversations, "
            f"{info['answer_tokens']} answer tokens, {info['answer_tokens'] / max(info['seconds'], 1e-9):.0f} tok/s")
    info["tok_s"] = info["answer_tokens"] / max(info["seconds"], 1e-9)
    return seqs, info


def dataset(eng, n_train: int, seed: int, max_new_tokens: int, concurrency: int, cache: Path,
            log=print) -> tuple[list[Sequence], list[Sequence], dict]:
    """(train, held-out, info) served by `eng` (served_engine): the held-out prompts as the bench
    sends them, and n_train conversations (distill_data.served_conversations) with and
    without the app's default system prompt."""
    from engine.config import BY_KEY
    from engine.training.distill_data import HELD_OUT_PROMPTS, served_conversations, user
    log(f"serving held-out answers for {len(HELD_OUT_PROMPTS)} prompts")
    held, _ = served_dataset(eng, [user(p) for p in HELD_OUT_PROMPTS], max_new_tokens, concurrency, cache, log)
    convs = served_conversations(n_train, seed, BY_KEY["system_prompt"].default)
    log(f"serving training answers for {len(convs)} conversations, {concurrency} at a time")
    train, info = served_dataset(eng, convs, max_new_tokens, concurrency, cache, log)
    return train, held, {**info, "threads": torch.get_num_threads()}
