"""Scheduler: which requests compute which tokens in the next step (continuous batching).

vLLM v1's rules, in nano-vllm's size:
  - requests wait first come, first served, and run together (at most max_num_seqs);
  - each step has a token budget (max_num_batched_tokens): decodes and their draft tokens
    are scheduled first, then prefill chunks, so a long prompt never stalls the others'
    decoding (it is computed a chunk per step);
  - a request is admitted when its whole prompt fits in the free blocks; blocks are taken
    a chunk at a time, when a step needs them; when the pool runs out, the newest running
    request is preempted by recompute (its blocks go back, its full blocks stay in the
    prefix cache, it waits at the head of the queue keeping its generated tokens), and no
    new request is admitted in that step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.cache.block_manager import BlockManager
from engine.request import RUNNING, Request
from engine.runtime.model_runner import ModelRunner


@dataclass
class Scheduled:
    request: Request
    num_tokens: int          # of its uncomputed tokens, computed this step
    max_drafts: int = 0      # a decode step may verify up to this many draft tokens


@dataclass
class StepPlan:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self):
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # in the order they were admitted

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self, runner: ModelRunner, max_num_seqs: int, token_budget: int, k: int) -> StepPlan:
        """The next step's work. k: draft tokens each decode may verify (the policy's choice)."""
        plan = StepPlan()
        budget = self._schedule_decodes(runner.blocks, plan, token_budget, k)
        budget = self._schedule_chunks(runner.blocks, plan, budget)
        if not plan.preempted:
            self._admit(runner, plan, max_num_seqs, budget, k)
        if not plan.scheduled and self.running:   # every runner is stuck mid-prompt on a full pool
            self._preempt(self.running[-1], plan)
            return self.schedule(runner, max_num_seqs, token_budget, k) if self.running else plan
        return plan

    # ---- the three kinds of work, in order ----------------------------------------
    def _schedule_decodes(self, blocks: BlockManager, plan: StepPlan, budget: int, k: int) -> int:
        for request in list(self.running):
            if request.state != RUNNING or not request.decoding or budget < 1:
                continue
            budget = self._schedule_decode(blocks, plan, request, k, budget)
        return budget

    def _schedule_decode(self, blocks: BlockManager, plan: StepPlan, request: Request, k: int, budget: int) -> int:
        drafts = self._drafts(request, k, budget - 1)
        # Drafts are never dropped to make room (that would change a sampled reply's draws):
        # the newest request gives its blocks back instead, this one included.
        while request.state == RUNNING and not self._fits(blocks, request, 1 + drafts):
            self._preempt(self._newest_unscheduled(plan, request), plan)
        if request.state != RUNNING:
            return budget
        blocks.ensure_capacity(request.seq, request.num_computed + 1 + drafts)
        plan.scheduled.append(Scheduled(request, 1, drafts))
        return budget - 1 - drafts

    def _schedule_chunks(self, blocks: BlockManager, plan: StepPlan, budget: int) -> int:
        """Running requests still computing their prompt (or recomputing after a preemption)."""
        for request in self.running:
            if budget < 1 or request.decoding:       # decodes were scheduled (or left) above
                continue
            chunk = min(self._chunk_limit(request), budget, self._room_for(blocks, request))
            if chunk > 0:
                self._schedule_chunk(blocks, plan, request, chunk)
                budget -= chunk
        return budget

    def _admit(self, runner: ModelRunner, plan: StepPlan, max_num_seqs: int, budget: int, k: int) -> None:
        blocks = runner.blocks
        while self.waiting and len(self.running) < max_num_seqs and budget > 0:
            request = self.waiting[0]
            hit_ids, _ = blocks.lookup(request.token_ids)
            hits_in_free = sum(1 for b in hit_ids if blocks.blocks[b].ref_count == 0)
            left = self._chunk_limit(request) - len(hit_ids) * blocks.block_size
            room = (blocks.num_free_blocks - hits_in_free) * blocks.block_size
            chunk = min(left, budget, room)
            if room < left:          # admitted only when its whole prompt fits now (vLLM's rule)
                return
            if left == 0 and room < blocks.blocks_for(1 + self._drafts(request, k, budget - 1)) * blocks.block_size:
                return                                  # back from a preemption: its decode step must fit
            self.waiting.popleft()
            request.admit(runner.admit(request.token_ids))
            self.running.append(request)
            if request.decoding:            # back from a preemption with all but its last token cached
                budget = self._schedule_decode(blocks, plan, request, k, budget)
            else:
                self._schedule_chunk(blocks, plan, request, chunk)
                budget -= chunk

    @staticmethod
    def _schedule_chunk(blocks: BlockManager, plan: StepPlan, request: Request, chunk: int) -> None:
        blocks.ensure_capacity(request.seq, request.num_computed + chunk)
        plan.scheduled.append(Scheduled(request, chunk))

    @staticmethod
    def _drafts(request: Request, k: int, budget: int) -> int:
        return max(0, min(k, budget, request.room - 1))

    @staticmethod
    def _chunk_limit(request: Request) -> int:
        """Tokens a chunk may compute. A recompute after a preemption stops one short of the
        end: its last token is computed by a decode step, with the drafts the decode step it
        replays verified (so a seeded sampled reply makes the same draws as if never preempted)."""
        return request.num_uncomputed - (1 if request.stats.generated_tokens else 0)

    # ---- blocks -------------------------------------------------------------------
    @staticmethod
    def _fits(blocks: BlockManager, request: Request, tokens: int) -> bool:
        return blocks.blocks_for(request.num_computed + tokens) - len(request.seq.block_table) <= blocks.num_free_blocks

    @staticmethod
    def _room_for(blocks: BlockManager, request: Request) -> int:
        """Tokens it could compute now: its blocks' free slots plus every free block."""
        return (len(request.seq.block_table) + blocks.num_free_blocks) * blocks.block_size - request.num_computed

    def _newest_unscheduled(self, plan: StepPlan, fallback: Request) -> Request:
        taken = {id(s.request) for s in plan.scheduled}
        for request in reversed(self.running):
            if id(request) not in taken:
                return request
        return fallback

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        request.preempt()
        self.waiting.appendleft(request)
        plan.preempted.append(request)
