"""Speculator: what the engine's step asks of speculative decoding, as vLLM's drafters are
objects. Each step the engine asks it for k (`k_for_step`: draft tokens per decoding
sequence, choosing the step's proposer first under `proposer: auto`), for each decode's
proposal (`propose`: a chain, or a tree grown and trimmed as the policy says), and after the
pass records the verdicts (`record`: acceptance, tree calibration, pass costs, auto's
counters, the suffix proposer's sources).

It owns the state those answers come from: the policy (engine.speculative.policy), proposer
`auto`'s measured choice (proposer_choice), the suffix proposer's global index (SuffixCache),
the EAGLE head with its compiled draft step (or why `auto` could not load one), and the plain
decode step's time, the baseline of "does speculation pay". The draft model and the Gemma 4
assistant stay in the engine's draft model slot: they share its memory plan.
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.config import EngineConfig, TreeShape, parse_tree
from engine.errors import ConfigError, WorkbenchError
from engine.loading import loader
from engine.metrics import ProposerCounts, StepEvent
from engine.models.eagle_head import EagleHead
from engine.runtime.eagle_step import EagleStep
from engine.runtime.model_runner import ModelRunner, RunnerSeq, prepare_model
from engine.speculative.assistant_proposer import AssistantProposer
from engine.speculative.eagle_proposer import EagleProposer
from engine.speculative.policy import SpeculationPolicy
from engine.speculative.proposer_choice import OFF, SHADOW_EVERY, SHADOWED, ProposerChoice
from engine.speculative.spec_decode import DraftModelProposer, NgramProposer, Proposal, Proposer
from engine.speculative.step_costs import PlainStepClock
from engine.speculative.suffix_proposer import SuffixCache, SuffixProposer


class SpeculatorHost(Protocol):
    """What the speculator reads of its engine (LLMEngine), and nothing more."""
    config: EngineConfig
    device: torch.device
    progress: loader.Progress
    target_model: loader.LoadedModel
    runner: ModelRunner
    draft_runner: ModelRunner | None     # the draft model slot: a draft model,
    assistant: object | None             # or a Gemma 4 assistant

    def target_is_gemma4(self) -> bool: ...


class Speculator:
    def __init__(self, host: SpeculatorHost, on_settings_changed=lambda: None):
        """on_settings_changed: called when `auto` picks a new winner (the engine's settings()
        answers differently)."""
        self.host, self.on_settings_changed = host, on_settings_changed
        self.policy = SpeculationPolicy()
        self.suffix_cache = SuffixCache(host.config.suffix_cache_tokens)   # earlier replies, for proposer `suffix`
        self.proposer_choice = ProposerChoice(SHADOWED)                    # proposer `auto`'s counters and choice
        self._paused_said: str | None = None                               # the `paused` the settings last carried
        self.eagle: tuple[str | None, EagleHead] | None = None     # (reference, head) once loaded
        self.eagle_step: EagleStep | None = None      # the head's passes, compiled as the target's step is
        self.eagle_refused: tuple[str | None, str] | None = None   # (head, why) auto could not load
        self.plain_steps = PlainStepClock()

    # ---- in effect -----------------------------------------------------------------
    def proposer_in_effect(self) -> str:
        """The proposer that drafts this step: the setting's, "off" when it has nothing to draft
        with, and under `auto` the one ProposerChoice picked for the step."""
        p, host = self.host.config.proposer, self.host
        if p == "auto":
            return self.proposer_choice.chosen
        if p == "draft" and host.assistant is not None:      # the draft model slot holds the assistant
            return "assistant"
        if ((p == "draft" and host.draft_runner is None) or (p == "eagle" and self.eagle is None)
                or (p == "assistant" and host.assistant is None)):
            return "off"
        return p

    def tree_in_effect(self) -> TreeShape | None:
        """The draft tree each decode step grows, or None: a chain (the n-gram proposer has
        no tree). The suffix proposer always drafts a tree, shaped by its counts: at most
        draft_tree's nodes, or k nodes k deep when draft_tree is off."""
        proposer, config = self.proposer_in_effect(), self.host.config
        if proposer == "suffix":
            k = config.num_speculative_tokens
            return parse_tree(config.draft_tree) or TreeShape(k, k, k)
        if proposer not in ("eagle", "draft"):           # the assistant drafts a chain
            return None
        return parse_tree(config.draft_tree)

    def auto_candidates(self) -> list[str]:
        """What `proposer: auto` chooses among: suffix and n-gram, EAGLE where a head for this
        model is loaded, the draft model or the Gemma 4 assistant where one is, and "off"
        (engine.speculative.proposer_choice)."""
        host = self.host
        return (["suffix", "ngram"] + ["eagle"] * (self.eagle is not None)
                + ["draft"] * (host.draft_runner is not None) + ["assistant"] * (host.assistant is not None) + [OFF])

    def describe_choice(self) -> dict:
        """`auto`'s choice, why, and each candidate's measured figures; what it left out, and why."""
        host = self.host
        left_out = {} if host.draft_runner is not None else {"draft": "no draft model loaded"}
        if host.assistant is None and host.target_is_gemma4():
            left_out["assistant"] = "no Gemma 4 assistant loaded (draft_model: its folder)"
        if self.eagle is None:
            left_out["eagle"] = self.eagle_refused[1] if self.eagle_refused else "no EAGLE head loaded"
        return self.proposer_choice.describe() | {"left_out": left_out}

    def forecast(self) -> dict | None:
        """Speculation off: what each retrieval proposer would pay one sequence here, predicted
        from its shadow drafts on the replies so far (proposer_choice: its tokens a step and
        lookup seconds) and the measured pass times (the policy's), as proposer auto would weigh
        it: {name: {"speedup": its rate over a plain step's (None: fewer than MIN_STEPS drafts
        yet), "tokens_per_step", "steps"}}. None while a proposer is on."""
        if self.host.config.proposer != OFF:
            return None
        plain = self.policy.predicted_pass_s(1)
        out = {}
        for name in SHADOWED:
            counts = self.proposer_choice.counts(name)
            rate = self.proposer_choice.rate(name, self.policy.predicted_pass_s, 1)
            out[name] = {"speedup": rate * plain if rate is not None and plain else None,
                         "tokens_per_step": counts.tokens_per_step if counts.asked else None,
                         "steps": len(self.proposer_choice.recent.get(name, ()))}
        return out

    def plain_step_key(self) -> tuple:
        """What changes a plain decode step's time (the proposer does not)."""
        runner = self.host.runner
        return (runner.kv_dtype_name, runner.compile_state, torch.get_num_threads())

    def plain_step_s(self) -> tuple[float | None, str | None]:
        """A plain decode step's seconds here, and where the figure comes from (PlainStepClock)."""
        return self.plain_steps.estimate(self.plain_step_key())

    # ---- the EAGLE head ------------------------------------------------------------
    def load_eagle_head_if_it_fits(self, reference: str | None) -> None:
        """`auto`: the EAGLE head joins the candidates where one fits this model; a missing or
        foreign head leaves it out (describe_choice says why), once per reference."""
        if self.eagle_refused is not None and self.eagle_refused[0] == reference:
            return
        try:
            self.load_eagle_head(reference)
        except WorkbenchError as e:
            self.eagle_refused = (reference, str(e))

    def load_eagle_head(self, reference: str | None) -> None:
        """Load the EAGLE head (a few MB) unless this one is loaded; raises a clear error."""
        if self.eagle is not None and self.eagle[0] == reference:
            return
        host = self.host
        head, _ = loader.load_eagle_head(reference, host.target_model, host.device, host.runner.model_dtype)
        if host.device.type == "cpu" and _serves_quantized(host.target_model.model):
            head.serve_int8()                   # a draft step's cost is its weights' bytes: see there
        prepare_model(head, host.device)
        self.eagle = (reference, head)
        self.eagle_step = EagleStep(head, host.device, host.progress)
        self.eagle_step.follow(host.runner)
        if host.runner.compiled is not None and host.runner.compiled.is_built:
            self.eagle_step.warm(host.config.block_size)     # loaded after the target's step was warmed

    def warm(self) -> float:
        """Compile the EAGLE head's draft step now, if a head is loaded; the seconds it took."""
        if self.eagle_step is None:
            return 0.0
        self.eagle_step.follow(self.host.runner)
        return self.eagle_step.warm(self.host.config.block_size)

    def compiled_steps(self) -> list:
        """What of speculation runs a compiled step (each counts its compiles): the EAGLE head's."""
        return [self.eagle_step] if self.eagle_step is not None else []

    # ---- proposers -----------------------------------------------------------------
    def make_proposer(self, name: str, seq: RunnerSeq | None = None) -> Proposer:
        """A new proposer for one request; seq: its target sequence (engine.runtime.model_runner.RunnerSeq)."""
        host, c = self.host, self.host.config
        if name == "ngram":
            return NgramProposer(c.ngram_min, c.ngram_max)
        if name == "suffix":
            return SuffixProposer(self.suffix_cache, c.suffix_spec_factor, c.suffix_min_prob, c.suffix_cache_tokens)
        if name == "draft":
            return DraftModelProposer(host.draft_runner)
        if name == "eagle":
            self.eagle_step.follow(host.runner)      # each request drafts one way from its start
            return EagleProposer(self.eagle[1], c.block_size, host.device, self.eagle_step)
        if name == "assistant":
            proposer = AssistantProposer(host.assistant, host.runner)
            proposer.follow(seq)
            return proposer
        raise ConfigError(f"no proposer named {name!r}")

    # ---- each step: k, proposals, verdicts -----------------------------------------
    def k_for_step(self, running: list, step: int) -> int:
        """Draft tokens per decoding sequence this step (running: the scheduler's running
        requests): k, or the policy's choice by batch size. Under `proposer: auto` the step's
        proposer is chosen first (its payoff already weighs whether drafting pays, so its trees
        are grown and trimmed, and a measuring step drafts k)."""
        c, auto = self.host.config, self.host.config.proposer == "auto"
        decoding = max(sum(1 for r in running if r.decoding), 1)
        if auto:
            self._choose_proposer(running, decoding, step)
        proposer = self.proposer_in_effect()
        if proposer == "off":
            return 0
        tree = self.tree_in_effect()
        if tree is not None:
            k = self._tree_nodes(tree, running, auto)
        elif c.speculation_policy == "fixed" or (auto and self.proposer_choice.is_measuring):
            return c.num_speculative_tokens
        else:
            own_draft_s = self.proposer_choice.counts(proposer).draft_s_per_token if auto else None
            k = self.policy.choose_k(proposer, decoding, c.num_speculative_tokens, draft_token_s=own_draft_s)
        if not auto and self.paused != self._paused_said:          # switched off or on by itself: say so
            self._paused_said = self.paused
            self.on_settings_changed()
        return k

    @property
    def paused(self) -> str | None:
        """Why speculation drafts nothing by itself now (a proposer chosen by the user, policy
        auto: its measured payoff says plain steps are faster), None while it drafts."""
        if self.host.config.proposer in ("off", "auto") or self.host.config.speculation_policy == "fixed":
            return None
        return self.policy.paused

    def _tree_nodes(self, tree: TreeShape, running: list, auto: bool) -> int:
        """A tree step's nodes: the tree's, or 0 while the policy says trees lose."""
        others = sum(r.num_uncomputed for r in running) - 1
        if self.host.config.speculation_policy == "fixed" or auto or self.policy.grow_tree(1 + max(others, 0)):
            return tree.nodes
        return 0

    def _choose_proposer(self, running: list, decoding: int, step: int) -> None:
        """`auto`: the proposer of this step (engine.speculative.proposer_choice). A new winner
        (not a measuring step) changes the settings the next event carries."""
        others = sum(r.num_uncomputed for r in running if not r.decoding)
        before = self.proposer_choice.chosen, self.proposer_choice.is_measuring
        chosen = self.proposer_choice.choose(self.auto_candidates(), step, self.policy.predicted_pass_s,
                                             decoding, others)
        if not self.proposer_choice.is_measuring and (chosen, False) != before:
            self.on_settings_changed()

    def propose(self, request, max_drafts: int, other_rows: int = 0) -> Proposal | None:
        """A request's drafts this step (engine.request.Request; max_drafts 0: none, a prompt
        chunk or a plain decode): a chain of up to max_drafts, or, while a tree is in effect, a
        tree (under `auto`: grown as deep as the policy says and trimmed to the nodes that pay).
        other_rows: the other requests' rows in the pass, before their drafts."""
        if self.host.config.proposer == "auto" and not request.proposers:
            # every candidate follows the request from its first pass: the EAGLE head sees the prompt's
            # features, and a reply joins the suffix index whichever proposer drafted it
            request.start_proposers([name for name in self.auto_candidates() if name != OFF])
        if self.host.config.proposer == OFF and not request.proposers:
            request.start_proposers(list(SHADOWED))          # the forecast's: each follows the reply
        if self.host.config.proposer in ("auto", OFF) and request.decoding:
            shadows = [c for c in self.auto_candidates()
                       if c in self.proposer_choice.shadowed and c != self.proposer_in_effect()]
            request.shadow_propose(shadows, self.host.config.num_speculative_tokens, SHADOW_EVERY)
        if not max_drafts:
            return None
        tree, auto = self.tree_in_effect(), self.host.config.speculation_policy == "auto"
        if tree is not None and auto and self.proposer_in_effect() != "suffix":    # a suffix tree's depth is free
            tree = TreeShape(tree.top_k, self.policy.tree_depth(tree.depth), tree.nodes)
        proposal = request.propose(max_drafts, tree)
        if proposal is None:
            return None
        if not proposal.grown:
            self.policy.record_draft(len(proposal.tokens), proposal.time_s)
        elif auto:
            proposal = proposal.trimmed(self.policy.choose_tree_nodes(proposal.tree.scores, max_drafts, other_rows))
        return proposal

    def record(self, settled: list[tuple[object, StepEvent]], pass_rows: int, pass_s: float, step: int) -> None:
        """What a step's pass taught: settled holds, per request that advanced, its part of the
        pass (its `proposal`, None for none, and whether it was a `decode`) and its event;
        pass_rows: the pass's rows (0: no pass ran), pass_s its seconds; step: the step's index."""
        drafted = ProposerCounts()
        for share, event in settled:
            for name, counts in share.request.settle_shadows():
                self.proposer_choice.record_shadow(name, step, counts)
            self._record_verdict(share.proposal, event, pass_s)
            if share.proposal is not None or (share.decode and self.proposer_in_effect() == OFF):
                drafted.add(_drafted(share.proposal, event))
        if self.host.config.proposer == "auto":
            self.proposer_choice.record(self.proposer_in_effect(), step, drafted)
        if pass_rows:
            self.policy.record_pass(pass_rows, pass_s)

    def _record_verdict(self, proposal: Proposal | None, event: StepEvent, pass_s: float) -> None:
        if proposal is not None and proposal.grown:              # a tree trimmed to 0 nodes too:
            self.policy.record_tree(event.tree_predicted_accepted or 0.0, event.accepted,   # its drafting
                                    len(event.token_ids), pass_s + proposal.time_s,        # was spent
                                    max(proposal.tree.depths, default=0), proposal.time_s,
                                    proposal.grown_nodes or len(proposal.tree))
        elif proposal is not None and proposal.tokens:
            self.policy.record_verdict(self.proposer_in_effect(), event.accepted_per_position)
        if proposal is not None and proposal.source:             # the suffix proposer's, by source
            self.suffix_cache.record(proposal.source, len(proposal.tree), event.accepted)

    # ---- the plain step: the baseline ----------------------------------------------
    def calibrate_plain_step(self) -> None:
        """Before a request, with the engine idle: time a plain decode step here, if speculation
        is on (the baseline of "does speculation pay")."""
        if self.proposer_in_effect() != "off" or self.host.config.proposer == "auto":
            self.plain_steps.calibrate(self.plain_step_key(), self.host.runner)

    def record_plain_step(self, seconds: float) -> None:
        """A step that was one plain decode and nothing else took `seconds`."""
        self.plain_steps.record(self.plain_step_key(), seconds)


def _drafted(proposal: Proposal | None, event: StepEvent) -> ProposerCounts:
    """One sequence's part of a step, as proposer `auto` counts it."""
    return ProposerCounts(asked=1, drafted=int(event.proposed > 0), proposed=event.proposed, accepted=event.accepted,
                          draft_s=proposal.time_s if proposal is not None else 0.0)


def _serves_quantized(model) -> bool:
    """Whether any of the model's linears is served quantized (weight_dtype, or as stored)."""
    return any(getattr(m, "quant", None) is not None for m in model.modules())
