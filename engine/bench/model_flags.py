"""Which model each `python -m engine.bench` scenario runs on: --model, --synthetic and
--layers (load's), checked before anything runs or is written.

Every scenario of the command line has a rule in RULES: for the flags as given it either
takes them (and runs on what they name) or refuses one, saying why and what to do instead.
No scenario ignores one. `model_source(scenario, args)` applies the rule; the command line
calls it for each scenario before running any (so `all` refuses before its first scenario),
and the tests walk every scenario through it (tests/test_bench_flags.py). A scenario added to
the command line without a rule cannot run.

`model_path(args)` is what the scenarios hand their loaders: --model as given, --synthetic's
checkpoint (written once to the user cache: engine.bench.load.synthetic_checkpoint), or None
for the embedded default model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.errors import ConfigError

DEFAULT = "default"            # engine.loading.loader.DEFAULT_MODEL: the embedded model


@dataclass(frozen=True)
class ModelSource:
    """The model a scenario runs on, as the command line named it."""
    model: str | None           # --model as given
    synthetic: str | None       # --synthetic's preset

    @property
    def name(self) -> str:
        """What a report calls it: the preset, the path as given, or `default`."""
        return self.synthetic or self.model or DEFAULT

    def path(self) -> str | None:
        """What a loader takes (a synthetic checkpoint is written on first use)."""
        if self.synthetic:
            from engine.bench.load import synthetic_checkpoint
            return str(synthetic_checkpoint(self.synthetic))
        return self.model


def source_of(args) -> ModelSource:
    return ModelSource(getattr(args, "model", None) or None, getattr(args, "synthetic", None) or None)


def model_path(args) -> str | None:
    return source_of(args).path()


# ---- the rules: None (takes the flags as given) or the refusal, after the scenario's name ----
Refusal = str | None


def _refuse(flag: str, why: str) -> str:
    return f"does not take {flag}: {why}"


def _gguf_presets() -> list[str]:
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS
    return sorted(SYNTHETIC_GGUF_PRESETS)


def is_gguf_preset(preset: str | None) -> bool:
    from engine.loading.synthetic_gguf import SYNTHETIC_GGUF_PRESETS
    return preset in SYNTHETIC_GGUF_PRESETS


def _takes_any(args) -> Refusal:
    return None


def _gguf_only(reader: str, instead: str = "") -> Callable:
    """A rule for a scenario whose other side reads only GGUF files (llama.cpp)."""
    def rule(args) -> Refusal:
        model, preset = args.model, args.synthetic
        if model and model != DEFAULT and not str(model).endswith(".gguf"):
            return _refuse(f"--model {model}", f"{reader} reads only GGUF files; pass --model FILE.gguf{instead}")
        if preset and not is_gguf_preset(preset):
            return _refuse(f"--synthetic {preset}", f"that preset is a float checkpoint and {reader} reads only GGUF "
                           f"files; use a GGUF preset ({', '.join(_gguf_presets())}){instead}")
        return None
    return rule


def _needs_gguf(reader: str) -> Callable:
    """_gguf_only, for a scenario with no default model (it compares on the file named)."""
    gguf_only = _gguf_only(reader)

    def rule(args) -> Refusal:
        if not args.model and not args.synthetic:
            return (f"needs --model FILE.gguf or --synthetic PRESET (one of {', '.join(_gguf_presets())}): "
                    "the file both engines load (python -m engine.bench.real_files lists the real ones)")
        return gguf_only(args)
    return rule


def _peer(args) -> Refusal:
    from engine.bench.peer_servers import LLAMA
    if (getattr(args, "engine", None) or LLAMA) == LLAMA:
        return _gguf_only("llama-server (peer's default --engine)", ", or --engine vllm, which takes either")(args)
    return None


def _quality(args) -> Refusal:
    if getattr(args, "against", None):
        return _needs_gguf("--against llama.cpp")(args)
    return None


def _serve(args) -> Refusal:
    if not getattr(args, "backend", None):
        return None
    if args.synthetic:
        return _refuse(f"--synthetic {args.synthetic}",
                       "with --backend the server serves its own model, so there is nothing to load here; drop "
                       "--synthetic (--served-model picks the server's model), or leave --backend out to serve the "
                       "preset with the local engine")
    random_ids = getattr(args, "prompts_set", None) == "random"
    if args.model and not random_ids and not getattr(args, "shared_prefix_len", 0):
        return _refuse(f"--model {args.model}",
                       "with --backend, --model names only the tokenizer that --prompt-set random and "
                       "--shared-prefix-len make their prompts with, and this workload uses neither; drop --model "
                       "(the server serves its own model: --served-model picks it)")
    return None


def _kernels(args) -> Refusal:
    import torch
    if args.synthetic and not is_gguf_preset(args.synthetic) and not torch.cuda.is_available():
        return _refuse(f"--synthetic {args.synthetic}",
                       "without CUDA, kernels times the model's quantized linears, and that preset's weights are "
                       f"float; use a GGUF preset ({', '.join(_gguf_presets())})")
    return None


RULES: dict[str, Callable] = {
    "parity": _takes_any, "prefix": _takes_any, "kv": _takes_any, "decode": _takes_any,
    "speculative": _takes_any, "gpu-check": _takes_any, "load": _takes_any,
    "memory": _takes_any, "kernels": _kernels, "peer": _peer, "serve": _serve, "quality": _quality,
    "agreement": _needs_gguf("agreement (llama.cpp's llama-perplexity)"),
}


def _layers(scenario: str, args) -> Refusal:
    """--layers cuts a float preset's checkpoint for `load`; nothing else reads it."""
    if getattr(args, "layers", None) is None:
        return None
    if scenario != "load":
        return _refuse(f"--layers {args.layers}", "only load reads it (with --synthetic PRESET); drop it")
    if not args.synthetic or is_gguf_preset(args.synthetic):
        what = f"--synthetic {args.synthetic} is a GGUF, written whole" if args.synthetic else "--model is loaded whole"
        return _refuse(f"--layers {args.layers}", f"it cuts a float --synthetic preset's checkpoint and {what}; drop it")
    return None


def _gpu_check_only(scenario: str, args) -> Refusal:
    """--dry-run (tiny sizes and model) and --out (a results folder) are gpu-check's."""
    for flag, given in (("--dry-run", getattr(args, "dry_run", False)), ("--out", getattr(args, "out", None))):
        if given and scenario != "gpu-check":
            return _refuse(flag, "only gpu-check reads it; drop it")
    return None


def model_source(scenario: str, args) -> ModelSource:
    """The model `scenario` runs on, from --model / --synthetic; a ConfigError naming the flag,
    why the scenario does not take it and what to do instead, where it does not."""
    if scenario not in RULES:
        raise LookupError(f"engine.bench.model_flags.RULES has no rule for the scenario {scenario!r}: say whether "
                          "it takes --model and --synthetic, and refuse what it does not take")
    source = source_of(args)
    if source.model and source.synthetic:
        raise ConfigError(f"{scenario}: --model {source.model} and --synthetic {source.synthetic} both name the model "
                          "to run on; give one")
    refusal = _layers(scenario, args) or _gpu_check_only(scenario, args) or RULES[scenario](args)
    if refusal is not None:
        raise ConfigError(f"{scenario} {refusal}")
    return source
