"""The reduced-head draft: a few Llama-family layers whose head scores only part of the
vocabulary, and its folder format. Made by `python -m engine.distill` (training is there,
never imported by inference); loaded by engine.loader for "default-draft" and for any folder
whose config.json carries DRAFT_CONFIG_KEY.

The folder: config.json (the target's config with fewer layers, plus DRAFT_CONFIG_KEY),
model.safetensors (fp16 layer and norm weights under transformers' Llama names, the head's
token ids and bias), tokenizer files. The embedding and head rows are NOT stored: they are
the target's, attached at load time.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.models.llama import LlamaFamilyModel

DRAFT_CONFIG_KEY = "workbench_draft"        # marks a folder that needs the target at load time


class ReducedHeadDraft(LlamaFamilyModel):
    """A Llama-family stack whose head scores only `head_token_ids`; the returned logits
    are full-vocabulary (-inf elsewhere), so it drops into the engine as any draft."""

    def __init__(self, config, head_size: int, max_positions: int | None = None):
        super().__init__(config, max_positions)
        del self.lm_head                       # replaced by the reduced head
        self.register_buffer("head_token_ids", torch.zeros(head_size, dtype=torch.int64))
        self.head = nn.Linear(config.hidden_size, head_size, bias=True)

    def tie_weights(self) -> None:             # the reduced head is never tied
        pass

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.full_logits(self.head(h).float())

    def full_logits(self, reduced: torch.Tensor) -> torch.Tensor:
        """[N, head_size] -> [N, vocab]: tokens outside the head get -inf (probability 0)."""
        full = reduced.new_full((reduced.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.head_token_ids] = reduced
        return full


def _hf_tensors(draft: ReducedHeadDraft, dtype=torch.float16) -> dict[str, torch.Tensor]:
    """The draft's own weights under transformers' Llama names (q/k/v and gate/up unfused)."""
    out = {"model.norm.weight": draft.norm.weight, "head_token_ids": draft.head_token_ids.to(torch.int32),
           "head.bias": draft.head.bias, **draft.hf_layer_tensors()}
    return {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous() for k, v in out.items()}


def save_draft(draft: ReducedHeadDraft, tokenizer, folder: Path, report: dict | None = None) -> None:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_hf_tensors(draft), str(folder / "model.safetensors"), metadata={"format": "pt"})
    draft.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if report is not None:
        (folder / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
