"""The most any draft taken from earlier text could save on a given set of replies.

Suffix decoding (and n-gram lookup) can only draft a token that followed the context's last
tokens somewhere before: in the request's own prompt and reply so far, or in an earlier reply.
Given the replies a model actually gave (greedy, so the same with or without speculation), this
counts the target passes an oracle would need that, at every step, drafts the best of all those
continuations: any earlier position whose previous token equals the context's last one (a match
of at least one token), the continuation that agrees with the real reply the longest, at most k
tokens, with a bonus token each pass. Nothing real does better, since a real proposer must pick
its branches without seeing the reply and pays for the ones that fail; so `tokens / passes` is
a ceiling on tokens per pass, and over the measured cost of a verify pass a ceiling on the
speedup, for these prompts and this model.

The sources follow the suffix proposer's: the request's own tokens, and the replies served
before it in the same arm (the global index starts empty in each timed arm).
"""
from __future__ import annotations

def _best_continuation(texts: list[list[int]], last: int, reply: list[int], t: int, k: int) -> int:
    """The longest agreement (at most k) between reply[t:] and what followed `last` anywhere in texts."""
    best = 0
    for text in texts:
        for p in range(1, len(text)):
            if text[p - 1] != last:
                continue
            a = 0
            while a < k and p + a < len(text) and t + a < len(reply) and text[p + a] == reply[t + a]:
                a += 1
            best = max(best, a)
            if best == k:
                return best
    return best


def ceiling_passes(prompt: list[int], reply: list[int], k: int, earlier: list[list[int]] = ()) -> int:
    """Target passes the oracle needs for `reply` after `prompt`, drafting at most k tokens a pass
    from the request's own text and the `earlier` replies."""
    own = list(prompt)
    t = passes = 0
    while t < len(reply):
        accepted = _best_continuation([own, *earlier], own[-1], reply, t, k) if own else 0
        n = min(accepted + 1, len(reply) - t)           # the accepted drafts and the pass's own token
        own += reply[t:t + n]
        t += n
        passes += 1
    return passes


def ceiling(prompts: list[list[int]], replies: list[list[int]], k: int) -> dict:
    """Tokens, oracle passes and tokens per pass over a run's prompts, served in order (each
    reply joins the earlier ones, as it joins the global suffix index)."""
    tokens = passes = 0
    earlier: list[list[int]] = []
    for prompt, reply in zip(prompts, replies):
        passes += ceiling_passes(prompt, reply, k, earlier)
        tokens += len(reply)
        earlier.append(list(reply))
    return {"tokens": tokens, "passes": passes, "tokens_per_pass": tokens / passes if passes else None}


__all__ = ["ceiling", "ceiling_passes"]
