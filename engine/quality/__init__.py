"""What each setting costs in output quality, measured on the loaded model against its most
exact configuration (docs/optimizations.md, "What each setting costs in quality"): the app's
Quality tab and `python -m engine.bench quality --compare` run this one implementation.

    run.py        QualityRun: the reference, each configuration scored against it, one piece a step
    text.py       the shipped reference text and the chat so far, as the tokens scored
    forced.py     teacher forcing through a runner's cache, window by window
    log_probs.py  llama.cpp's 16-bit form of a distribution (the reference is kept in it)
    figures.py    KL divergence, same top token, perplexity change with 95% intervals; the Pareto front
    lossless.py   lossless settings checked token for token, and the decode speed
"""
from engine.quality.figures import pareto_front
from engine.quality.run import Configuration, Progress, QualityRun
from engine.quality.text import QualityTextError

__all__ = ["Configuration", "Progress", "QualityRun", "QualityTextError", "pareto_front"]
