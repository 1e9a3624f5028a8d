"""The per-kind metric mapping (engine.remote.server_metrics, engine.remote.server_kinds) on /metrics
text in the format each server serves. SGLang cannot run here, so its text, and vLLM's for
these unit tests (tests/test_remote_vllm.py checks the real vLLM where it is installed), is
produced the way they produce it: vLLM declares prometheus_client Counters/Gauges/Histograms
(names, labels and help as in vllm/v1/metrics/loggers.py and vllm/v1/spec_decode/metrics.py)
and serves generate_latest(); SGLang's is the example of its "Production Metrics" page plus
the speculative gauges of its metrics_collector.py. llama.cpp's follows its to_metrics()."""
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.metrics import PositionCounts
from engine.remote.server_kinds import launch_settings
from engine.remote.server_metrics import kind_of_metrics, read_metrics, request_figures

VLLM_LABELS = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine": "0"}


class FakeVllm:
    """vLLM v1's metric declarations; `serve()` is what GET /metrics returns."""
    def __init__(self, k: int = 3, spec: bool = True):
        r, names = CollectorRegistry(), list(VLLM_LABELS)
        self.registry, self.k, self.spec = r, k, spec
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", names, registry=r)
        self.queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                               names, registry=r)
        self.hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            names, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              names, buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0],
                              registry=r)
        for metric in (self.kv, self.queries, self.hits, self.ttft):    # vLLM makes per-engine series up front
            metric.labels(*VLLM_LABELS.values())
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization"], registry=r)
        info.labels("16", "fp8", "True", "0.9").set(1)
        if spec:
            self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", names, registry=r)
            self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", names, registry=r)
            self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", names, registry=r)
            for metric in (self.drafts, self.draft_tokens, self.accepted):
                metric.labels(*VLLM_LABELS.values())
            self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                   names + ["position"], registry=r)
            for pos in range(k):     # vLLM creates every position's series up front
                self.per_pos.labels(*VLLM_LABELS.values(), str(pos))

    def observe_draft(self, accepted: int) -> None:
        """One verification step of a k-token draft, as SpecDecodingStats.observe_draft."""
        values = VLLM_LABELS.values()
        self.drafts.labels(*values).inc()
        self.draft_tokens.labels(*values).inc(self.k)
        self.accepted.labels(*values).inc(accepted)
        for pos in range(accepted):
            self.per_pos.labels(*values, str(pos)).inc()

    def observe_request(self, prompt_tokens: int, cached: int, ttft_s: float, kv: float) -> None:
        values = VLLM_LABELS.values()
        self.queries.labels(*values).inc(prompt_tokens)
        self.hits.labels(*values).inc(cached)
        self.ttft.labels(*values).observe(ttft_s)
        self.kv.labels(*values).set(kv)

    def serve(self) -> str:
        return generate_latest(self.registry).decode()


SGLANG_TEXT = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.8
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding (`accepted tokens / total draft tokens` in batch).
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.6
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} {ttft_sum}
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} {ttft_count}
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} {ttft_count}
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} {ttft_count}
"""


def sglang_text(ttft_sum: float, ttft_count: int) -> str:
    return SGLANG_TEXT.replace("{ttft_sum}", repr(ttft_sum)).replace("{ttft_count}", f"{ttft_count}.0")


def llamacpp_text(prompt: int, cached: int, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    """As llama.cpp's server_task_result_metrics::to_metrics() writes it."""
    def item(name, kind, value, help_text="x"):
        return f"# HELP llamacpp:{name} {help_text}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
    text = (item("prompt_tokens_total", "counter", prompt, "Number of prompt tokens processed, excluding cached tokens")
            + item("prompt_tokens_cached_total", "counter", cached, "Number of prompt tokens reused from the cache")
            + item("tokens_predicted_total", "counter", 99)
            + item("spec_decode_num_draft_tokens_total", "counter", draft_tokens)
            + item("spec_decode_num_accepted_tokens_total", "counter", accepted)
            + item("spec_decode_num_drafts_total", "counter", drafts)
            + item("predicted_tokens_seconds", "gauge", 101.5))
    text += ("# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position\n"
             "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter\n")
    return text + "".join(f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {n}\n'
                          for i, n in enumerate(per_pos))


def test_server_kind_is_detected_from_metric_names():
    assert kind_of_metrics(FakeVllm().serve()) == "vllm"
    assert kind_of_metrics(sglang_text(1.0, 2)) == "sglang"
    assert kind_of_metrics(llamacpp_text(1, 0, 0, 0, 0, [0])) == "llama.cpp"
    assert kind_of_metrics("# HELP process_cpu_seconds_total x\n# TYPE process_cpu_seconds_total counter\n"
                           "process_cpu_seconds_total 1.5\n") is None


def test_vllm_request_figures_are_counter_deltas_with_derived_ratios():
    server = FakeVllm(k=3)
    server.observe_draft(accepted=3)                 # traffic before our request
    before = read_metrics("vllm", server.serve())
    for accepted in (3, 2, 0, 1):                     # our request: 4 drafts of 3 tokens
        server.observe_draft(accepted)
    server.observe_request(prompt_tokens=100, cached=64, ttft_s=0.25, kv=0.125)
    figures = request_figures(before, read_metrics("vllm", server.serve()))

    assert (figures["drafts"], figures["draft_tokens"], figures["accepted_tokens"]) == (4, 12, 6)
    assert figures["acceptance_rate"] == pytest.approx(6 / 12)
    assert figures["mean_accepted_len"] == pytest.approx(1 + 6 / 4)           # vLLM's convention
    # accepted at position 0, 1, 2: 3, 2, 1 of 4 drafts -> conditional rates 3/4, 2/3, 1/2
    assert figures["accepted_per_position"] == [3, 2, 1]
    assert figures["per_position"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert figures["kv_usage"] == pytest.approx(0.125)
    assert figures["prefix_hit_rate"] == pytest.approx(64 / 100)
    assert figures["server_ttft_s"] == pytest.approx(0.25)


def test_vllm_without_speculation_reports_acceptance_as_missing_not_zero():
    server = FakeVllm(spec=False)
    before = read_metrics("vllm", server.serve())
    server.observe_request(prompt_tokens=10, cached=0, ttft_s=0.1, kv=0.5)
    figures = request_figures(before, read_metrics("vllm", server.serve()))
    assert figures["drafts"] is None
    assert figures["acceptance_rate"] is None
    assert figures["mean_accepted_len"] is None
    assert figures["per_position"] is None
    assert figures["prefix_hit_rate"] == 0.0       # queried and missed: a real 0


def test_vllm_launch_settings_come_from_cache_config_info_and_spec_positions():
    settings, version = launch_settings("vllm", {"version": "0.11.0"}, FakeVllm(k=3).serve())
    assert version == "0.11.0"
    assert settings == {"kv_cache_dtype": "fp8", "enable_prefix_caching": True,
                        "num_speculative_tokens": 3, "proposer": "on"}
    # without speculation vLLM exports no spec_decode series at all: the proposer is off
    settings, _ = launch_settings("vllm", {"version": "0.32.0"}, FakeVllm(spec=False).serve())
    assert settings["proposer"] == "off" and settings["num_speculative_tokens"] is None


def test_sglang_gauges_are_read_and_what_it_lacks_is_missing():
    before = read_metrics("sglang", sglang_text(10.0, 40))
    after = read_metrics("sglang", sglang_text(10.5, 41))
    figures = request_figures(before, after)
    assert figures["acceptance_rate"] == pytest.approx(0.6)
    assert figures["mean_accepted_len"] == pytest.approx(2.8)
    assert figures["kv_usage"] == pytest.approx(0.28)
    assert figures["prefix_hit_rate"] == pytest.approx(0.007507552643049313)
    assert figures["server_ttft_s"] == pytest.approx(0.5)
    # SGLang exports no draft counters: per-position acceptance is missing, not invented
    assert figures["drafts"] is None and figures["per_position"] is None


def test_sglang_launch_settings_come_from_server_info():
    info = {"version": "0.5.2", "kv_cache_dtype": "fp8_e4m3", "speculative_algorithm": "EAGLE",
            "speculative_num_draft_tokens": 4, "disable_radix_cache": False}
    settings, version = launch_settings("sglang", info, None)
    assert version == "0.5.2"
    assert settings == {"kv_cache_dtype": "fp8_e4m3", "proposer": "EAGLE", "num_speculative_tokens": 4,
                        "enable_prefix_caching": True}


def test_llamacpp_counters_map_to_acceptance_per_position_and_prefix_hits():
    before = read_metrics("llama.cpp", llamacpp_text(100, 0, 2, 8, 8, [2, 2, 2, 2]))
    after = read_metrics("llama.cpp", llamacpp_text(130, 36, 8, 32, 20, [7, 6, 4, 3]))
    figures = request_figures(before, after)
    assert figures["acceptance_rate"] == pytest.approx(12 / 24)
    assert figures["accepted_per_position"] == [5, 4, 2, 1]
    assert figures["per_position"] == pytest.approx([5 / 6, 4 / 5, 2 / 4, 1 / 2])
    assert figures["prefix_hit_rate"] == pytest.approx(36 / (30 + 36))
    assert figures["kv_usage"] is None           # llama.cpp gives it at /slots, not /metrics
    assert figures["server_ttft_s"] is None


def test_position_counts_from_cumulative_counters_use_the_shared_rate_formula():
    counts = PositionCounts.from_cumulative(drafts=10, accepted_per_position=[8, 6, 3])
    assert counts.attempts == [10, 8, 6] and counts.accepts == [8, 6, 3]
    assert counts.rates() == pytest.approx([0.8, 0.75, 0.5])
