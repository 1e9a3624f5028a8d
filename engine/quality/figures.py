"""The quality figures of one configuration against its reference, from per-token arrays
(llama-perplexity --kl-divergence's statistics), and the speed-against-quality Pareto front.
Plain data: numpy only (the app reads it)."""
from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054        # two-sided 95% normal quantile
KLD_RESOLUTION = 1e-4          # what a 16-bit reference tells apart (engine.quality.log_probs)


def compare(ref_nll: np.ndarray, nll: np.ndarray, kld: np.ndarray, same: np.ndarray) -> dict:
    """The figures of one configuration against the reference, from per-token arrays."""
    n = len(nll)
    se = lambda x: float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")    # noqa: E731
    diff = nll - ref_nll
    d_mean, d_se = float(diff.mean()), se(diff)
    k_mean, k_se = float(kld.mean()), se(kld)
    p_same = float(same.mean())
    s_se = math.sqrt(max(p_same * (1 - p_same), 0.0) / max(n - 1, 1))
    ln_ppl, ln_se = float(nll.mean()), se(nll)
    pct = lambda x: 100.0 * (math.exp(x) - 1.0)    # noqa: E731
    return {"tokens_scored": n,
            "kld_mean": k_mean, "kld_mean_ci95": [max(0.0, k_mean - Z95 * k_se), k_mean + Z95 * k_se],
            "kld_median": float(np.median(kld)), "kld_p99": float(np.percentile(kld, 99)), "kld_max": float(kld.max()),
            "same_top_pct": 100 * p_same,
            "same_top_pct_ci95": [100 * max(0.0, p_same - Z95 * s_se), 100 * min(1.0, p_same + Z95 * s_se)],
            "ppl": math.exp(ln_ppl), "ppl_ci95": [math.exp(ln_ppl - Z95 * ln_se), math.exp(ln_ppl + Z95 * ln_se)],
            "ppl_reference": math.exp(float(ref_nll.mean())),
            "ppl_change_pct": pct(d_mean), "ppl_change_pct_ci95": [pct(d_mean - Z95 * d_se), pct(d_mean + Z95 * d_se)]}


def pareto_front(rows: list[dict]) -> list[int]:
    """Indices of the rows no other row beats on both lower kld_mean and higher decode_tok_s
    (equal on one, better on the other), ordered by kld_mean."""
    points = [(i, r["kld_mean"], r["decode_tok_s"]) for i, r in enumerate(rows)
              if r.get("kld_mean") is not None and r.get("decode_tok_s") is not None]
    front = [i for i, k, s in points
             if not any((k2 <= k and s2 >= s) and (k2 < k or s2 > s) for _, k2, s2 in points)]
    return sorted(front, key=lambda i: (rows[i]["kld_mean"], -rows[i]["decode_tok_s"]))


def summary(row: dict) -> str:
    lo, hi = row["ppl_change_pct_ci95"]
    kld = f"{row['kld_mean']:.5f}" if row["kld_mean"] >= KLD_RESOLUTION else f"< {KLD_RESOLUTION:g}"
    quality = (f"KLD {kld} nats, same top {row['same_top_pct']:.1f}%, "
               f"perplexity {row['ppl_change_pct']:+.2f}% ({lo:+.2f} to {hi:+.2f})")
    tokens = row["lossless"]["said"]
    return f"{quality}; {tokens}; {row['decode_tok_s']:.1f} tok/s"
