"""Speculative decoding: proposers, verification, and whether it pays.

spec_decode.py     the proposal and proposer interface, n-gram and draft-model proposers, and
                   the rejection sampler of a chain drafted from q (accept with min(1, p/q))
eagle_proposer.py  the EAGLE head (engine.models.eagle_head) as a proposer
suffix_index.py    where the context's last tokens occurred before, and what followed (counts)
suffix_proposer.py suffix decoding: trees of the likeliest continuations of the longest match, in
                   the request's own text or earlier replies (the engine's SuffixCache)
tree.py            draft trees (a chain is one): EAGLE-2 growth, selection, the verdict, greedy
                   and sibling-rejection verification
policy.py          how many drafts (or tree nodes) a step verifies, from measured costs
proposer_choice.py proposer `auto`: which proposer (or none) drafts each step, by measured payoff
step_costs.py      measured step costs: the baseline of "does speculation pay here?"
speculator.py      what the engine's step asks of all the above, as one object: k, a proposal, a verdict
"""
