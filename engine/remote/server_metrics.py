"""Where each number comes from on a remote server's /metrics, per server kind.

A scrape of /metrics (Prometheus text, parsed by prometheus_client's parser) becomes a
`MetricsReading`: the same fields for every kind, None where that kind does not export
the number. Two readings taken around a request give its `figures` (counter deltas plus
the gauges read at the end); every ratio comes from engine.metrics.

  field               vLLM                                        SGLang                       llama.cpp (--metrics)
  drafts              vllm:spec_decode_num_drafts                 -                            llamacpp:spec_decode_num_drafts_total
  draft_tokens        vllm:spec_decode_num_draft_tokens           -                            llamacpp:spec_decode_num_draft_tokens_total
  accepted_tokens     vllm:spec_decode_num_accepted_tokens        -                            llamacpp:spec_decode_num_accepted_tokens_total
  accepted_per_pos    vllm:spec_decode_num_accepted_tokens_per_pos  -                          llamacpp:spec_decode_num_accepted_tokens_per_pos_total
  accept_rate         -                                           sglang:spec_accept_rate      -
  accept_length       -                                           sglang:spec_accept_length    -
  kv_usage            vllm:kv_cache_usage_perc                    sglang:token_usage           - (GET /slots, engine.remote.backend)
  prefix_queries/hits vllm:prefix_cache_queries / _hits           -                            -
  cache_hit_rate      -                                           sglang:cache_hit_rate        -
  prompt_tokens(_cached) -                                        -                            llamacpp:prompt_tokens(_cached)_total
  ttft_sum/_count     vllm:time_to_first_token_seconds            sglang:time_to_first_token_seconds  -
  running             vllm:num_requests_running                   sglang:num_running_reqs      llamacpp:requests_processing
  waiting             vllm:num_requests_waiting                   sglang:num_queue_reqs        llamacpp:requests_deferred
  preemptions         vllm:num_preemptions                        -                            -

Counters are server-wide: on a server others use too, a request's deltas include their
traffic (the figures say `shared_counters`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import PositionCounts, accepted_len_from_counters, ratio

POSITION_LABEL = "position"
SUM, MEAN = "sum", "mean"    # how label sets (engines, ranks) combine: counters add, gauges average

# field -> (sample names to try in order, how label sets combine). Counter samples carry
# the _total suffix the exposition format gives them.
VLLM = {
    "drafts": (("vllm:spec_decode_num_drafts_total",), SUM),
    "draft_tokens": (("vllm:spec_decode_num_draft_tokens_total",), SUM),
    "accepted_tokens": (("vllm:spec_decode_num_accepted_tokens_total",), SUM),
    "accepted_per_pos": (("vllm:spec_decode_num_accepted_tokens_per_pos_total",), SUM),
    # vLLM < 0.10 called it gpu_cache_usage_perc
    "kv_usage": (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), MEAN),
    "prefix_queries": (("vllm:prefix_cache_queries_total",), SUM),
    "prefix_hits": (("vllm:prefix_cache_hits_total",), SUM),
    "ttft_sum": (("vllm:time_to_first_token_seconds_sum",), SUM),
    "ttft_count": (("vllm:time_to_first_token_seconds_count",), SUM),
    "running": (("vllm:num_requests_running",), SUM),
    "waiting": (("vllm:num_requests_waiting",), SUM),
    "preemptions": (("vllm:num_preemptions_total",), SUM),
}
SGLANG = {
    "accept_rate": (("sglang:spec_accept_rate",), MEAN),
    "accept_length": (("sglang:spec_accept_length",), MEAN),
    "kv_usage": (("sglang:token_usage",), MEAN),
    "cache_hit_rate": (("sglang:cache_hit_rate",), MEAN),
    "ttft_sum": (("sglang:time_to_first_token_seconds_sum",), SUM),
    "ttft_count": (("sglang:time_to_first_token_seconds_count",), SUM),
    "running": (("sglang:num_running_reqs",), SUM),
    "waiting": (("sglang:num_queue_reqs",), SUM),
}
LLAMACPP = {
    "drafts": (("llamacpp:spec_decode_num_drafts_total",), SUM),
    "draft_tokens": (("llamacpp:spec_decode_num_draft_tokens_total",), SUM),
    "accepted_tokens": (("llamacpp:spec_decode_num_accepted_tokens_total",), SUM),
    "accepted_per_pos": (("llamacpp:spec_decode_num_accepted_tokens_per_pos_total",), SUM),
    "prompt_tokens": (("llamacpp:prompt_tokens_total",), SUM),
    "prompt_tokens_cached": (("llamacpp:prompt_tokens_cached_total",), SUM),
    "running": (("llamacpp:requests_processing",), SUM),
    "waiting": (("llamacpp:requests_deferred",), SUM),
}
METRIC_MAPS = {"vllm": VLLM, "sglang": SGLANG, "llama.cpp": LLAMACPP}
METRIC_PREFIXES = {"vllm:": "vllm", "sglang:": "sglang", "llamacpp:": "llama.cpp"}


@dataclass
class MetricsReading:
    """One /metrics scrape mapped to common fields; None: the server does not export it."""
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    accepted_per_pos: list[float] | None = None
    accept_rate: float | None = None
    accept_length: float | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    cache_hit_rate: float | None = None
    prompt_tokens: float | None = None
    prompt_tokens_cached: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    running: float | None = None          # gauges: requests being served / queued now
    waiting: float | None = None
    preemptions: float | None = None      # counter


def parse_samples(text: str) -> list[tuple[str, dict, float]]:
    """(sample name, labels, value) for every sample in Prometheus exposition text."""
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def kind_of_metrics(text: str) -> str | None:
    """The server kind whose metric names appear in the text, or None."""
    for name, _, _ in parse_samples(text):
        for prefix, kind in METRIC_PREFIXES.items():
            if name.startswith(prefix):
                return kind
    return None


def read_metrics(kind: str, text: str) -> MetricsReading:
    """Map one scrape of a `kind` server ("vllm", "sglang", "llama.cpp") to a reading."""
    samples = parse_samples(text)
    reading = MetricsReading()
    for field_name, (names, combine) in METRIC_MAPS.get(kind, {}).items():
        if field_name == "accepted_per_pos":
            value = _per_position(samples, names)
        else:
            value = _combined(samples, names, combine)
        setattr(reading, field_name, value)
    return reading


def _combined(samples, names, combine) -> float | None:
    for name in names:
        values = [value for sample_name, _, value in samples if sample_name == name]
        if values:
            return sum(values) if combine == SUM else sum(values) / len(values)
    return None


def _per_position(samples, names) -> list[float] | None:
    by_position: dict[int, float] = {}
    for sample_name, labels, value in samples:
        if sample_name in names and POSITION_LABEL in labels:
            position = int(labels[POSITION_LABEL])
            by_position[position] = by_position.get(position, 0.0) + value
    return [by_position.get(i, 0.0) for i in range(max(by_position) + 1)] if by_position else None


def _delta(before, after):
    """after - before for a counter; a series that appeared during the request started at 0."""
    if after is None:
        return None
    if before is None:
        return after
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before + [0.0] * (len(after) - len(before)))]
    return after - before


def request_figures(before: MetricsReading, after: MetricsReading) -> dict:
    """A request's figures from scrapes taken before and after it: counter deltas, gauges
    as read at the end, every ratio via engine.metrics. None: not exported."""
    d = {f.name: _delta(getattr(before, f.name), getattr(after, f.name))
         for f in fields(MetricsReading)}
    positions = (PositionCounts.from_cumulative(int(d["drafts"]), [int(x) for x in d["accepted_per_pos"]])
                 if d["drafts"] is not None and d["accepted_per_pos"] else None)
    return {
        "drafts": d["drafts"], "draft_tokens": d["draft_tokens"], "accepted_tokens": d["accepted_tokens"],
        "acceptance_rate": _first(_ratio(d["accepted_tokens"], d["draft_tokens"]), after.accept_rate),
        "mean_accepted_len": _first(_accepted_len(d["accepted_tokens"], d["drafts"]), after.accept_length),
        "accepted_per_position": [int(x) for x in d["accepted_per_pos"]] if d["accepted_per_pos"] else None,
        "per_position": positions.rates() if positions is not None else None,
        "kv_usage": after.kv_usage,
        "prefix_hit_rate": _first(_ratio(d["prefix_hits"], d["prefix_queries"]), after.cache_hit_rate,
                                  _llamacpp_hit_rate(d)),
        "server_ttft_s": _ratio(d["ttft_sum"], d["ttft_count"]),
        "shared_counters": True,
    }


def _ratio(numerator, denominator):
    return None if numerator is None or denominator is None else ratio(numerator, denominator)


def _accepted_len(accepted, drafts):
    return None if accepted is None or drafts is None else accepted_len_from_counters(accepted, drafts)


def _llamacpp_hit_rate(d: dict):
    """llama.cpp counts computed prompt tokens excluding the cached ones."""
    if d["prompt_tokens"] is None or d["prompt_tokens_cached"] is None:
        return None
    return ratio(d["prompt_tokens_cached"], d["prompt_tokens"] + d["prompt_tokens_cached"])


def _first(*values):
    return next((v for v in values if v is not None), None)
