"""The EAGLE head's training recipe: `python -m engine.training.distill`. Inference never
imports this package.

distill.py       the recipe: build the head, train, evaluate, save
distill_data.py  the target's own answers with its hidden states, the training data
"""
