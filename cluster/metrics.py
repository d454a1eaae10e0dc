"""Replica metrics, named like vLLM's with a `pagoda:` prefix, recorded two ways from one place.

    LLMServer replica ── ReplicaMetrics ──┬─► ray.util.metrics (Counter/Gauge/Histogram) ─► Ray's metrics agent
                                          │     names: ':' → '_' (Ray 2.60 deprecates ':'); Ray adds its own prefix
                                          └─► prometheus_client registry (one per replica) ─► snapshot()
    Ingress GET /metrics ── handle.broadcast("collect_metrics") to every replica ─► merge_families() ─► text

Every series carries the labels model_name and replica; `pagoda:request_success` also finished_reason. With LoRA on,
`pagoda:lora_requests_info` is vLLM's: one series a replica whose labels list the adapters of its running and
waiting requests (comma-separated names) and max_lora, whose value is when they were last read; and
`pagoda:lora_request_success` counts finished requests by adapter (lora_name) and finish reason. Engine
counters (prompt tokens, prefix-cache queries, ...) are cumulative in `EngineStats`; `sync_engine_stats` adds the
difference since the last sync, so both paths see monotonic counters.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
_E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)
_PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

LABELS = ("model_name", "replica")
_LORA_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")  # vLLM's

# name -> (kind, help, extra label names, histogram buckets)
METRICS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...] | None]] = {
    "pagoda:num_requests_running": ("gauge", "Requests in the running batch.", (), None),
    "pagoda:num_requests_waiting": ("gauge", "Requests waiting to be scheduled.", (), None),
    "pagoda:kv_cache_usage_perc": ("gauge", "KV-cache usage (1 = full).", (), None),
    "pagoda:prefix_cache_queries": ("counter", "New requests' prompt tokens looked up in the prefix cache.", (),
                                    None),
    "pagoda:prefix_cache_hits": ("counter", "New requests' prompt tokens found in the device's prefix cache.", (),
                                 None),
    "pagoda:host_prefix_cache_queries": ("counter", "New requests' prompt tokens looked up while a host KV tier "
                                                    "exists (vLLM's external_prefix_cache_queries).", (), None),
    "pagoda:host_prefix_cache_hits": ("counter", "New requests' prompt tokens found in the host KV tier (copied "
                                                 "back, not computed).", (), None),
    "pagoda:kv_offloaded_bytes": ("counter", "KV bytes written to the host tier (all ranks).", (), None),
    "pagoda:kv_onloaded_bytes": ("counter", "KV bytes copied back from the host tier (all ranks).", (), None),
    "pagoda:host_kv_cache_usage_perc": ("gauge", "Host KV tier usage (1 = full).", (), None),
    "pagoda:num_preemptions": ("counter", "Preemptions (a request's blocks freed, recomputed later).", (), None),
    "pagoda:swapped_out_tokens": ("counter", "Preempted requests' computed tokens held by the host KV tier when "
                                             "they were preempted.", (), None),
    "pagoda:swapped_in_tokens": ("counter", "Preempted requests' tokens copied back from the host KV tier when "
                                            "they resumed.", (), None),
    "pagoda:preemption_recomputed_tokens": ("counter", "Preempted requests' computed tokens computed again when "
                                                       "they resumed (no tier held them).", (), None),
    "pagoda:spec_decode_num_drafts": ("counter", "Speculative steps of a request (steps that carried drafts).", (),
                                      None),
    "pagoda:spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed and scored.", (), None),
    "pagoda:spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted.", (), None),
    "pagoda:spec_decode_num_accepted_tokens_per_pos": ("counter", "Draft tokens accepted, by position in the draft.",
                                                       ("position",), None),
    "pagoda:prompt_tokens": ("counter", "Prompt tokens received.", (), None),
    "pagoda:generation_tokens": ("counter", "Tokens generated.", (), None),
    "pagoda:request_success": ("counter", "Finished requests by finish reason.", ("finished_reason",), None),
    "pagoda:time_to_first_token_seconds": ("histogram", "Time to first token.", (), _TTFT_BUCKETS_S),
    "pagoda:inter_token_latency_seconds": ("histogram", "Time between output tokens.", (), _ITL_BUCKETS_S),
    "pagoda:e2e_request_latency_seconds": ("histogram", "Request latency, arrival at the server to finish.", (),
                                           _E2E_BUCKETS_S),
    "pagoda:request_queue_time_seconds": ("histogram", "Time a request waited before its first step.", (),
                                          _PHASE_BUCKETS_S),
    "pagoda:request_prefill_time_seconds": ("histogram", "First step to first token.", (), _PHASE_BUCKETS_S),
    "pagoda:request_decode_time_seconds": ("histogram", "First token to finish.", (), _PHASE_BUCKETS_S),
    "pagoda:request_time_per_output_token_seconds": ("histogram", "Decode time per output token after the first.",
                                                     (), _TPOT_BUCKETS_S),
    "pagoda:request_prompt_tokens": ("histogram", "Prompt tokens per finished request.", (), _TOKEN_BUCKETS),
    "pagoda:request_generation_tokens": ("histogram", "Generated tokens per finished request.", (), _TOKEN_BUCKETS),
    "pagoda:iteration_tokens_total": ("histogram", "Tokens per engine step.", (), _STEP_TOKEN_BUCKETS),
    "pagoda:gpu_memory_used_bytes": ("gauge", "Device memory in use by the replica's engine (all its ranks).", (),
                                     None),
    "pagoda:gpu_utilization_perc": ("gauge", "Device utilization of the replica's GPUs (1 = busy).", (), None),
    "pagoda:lora_requests_info": ("gauge", "Running stats on LoRA requests (the adapters of the running and the "
                                           "waiting requests; value: when they were read).", _LORA_INFO_LABELS, None),
    "pagoda:lora_request_success": ("counter", "Finished requests of each LoRA adapter by finish reason.",
                                    ("lora_name", "finished_reason"), None),
}

# EngineStats field -> counter fed by its growth.
_ENGINE_COUNTERS = {name: f"pagoda:{name}" for name in
                    ("prefix_cache_queries", "prefix_cache_hits", "host_prefix_cache_queries",
                     "host_prefix_cache_hits", "kv_offloaded_bytes", "kv_onloaded_bytes", "num_preemptions",
                     "swapped_out_tokens", "swapped_in_tokens", "preemption_recomputed_tokens", "prompt_tokens",
                     "generation_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                     "spec_decode_num_accepted_tokens")}
_ENGINE_GAUGES = {"num_running": "pagoda:num_requests_running", "num_waiting": "pagoda:num_requests_waiting",
                  "kv_cache_usage": "pagoda:kv_cache_usage_perc",
                  "host_kv_cache_usage": "pagoda:host_kv_cache_usage_perc",
                  "device_memory_used_bytes": "pagoda:gpu_memory_used_bytes",
                  "device_utilization": "pagoda:gpu_utilization_perc"}


def ray_metric_name(name: str) -> str:
    """The name under which `ray.util.metrics` records a metric (Ray 2.60 warns on ':' and will reject it)."""
    return name.replace(":", "_")


@dataclass
class MetricFamily:
    """A picklable copy of one prometheus family: samples are (sample name, labels, value)."""

    name: str
    kind: str
    documentation: str
    samples: list[tuple[str, dict[str, str], float]]


class ReplicaMetrics:
    """One replica's metrics (thread-safe: the replica syncs engine stats from a timer thread and on collection)."""

    def __init__(self, model_name: str, replica: str, use_ray: bool = True):
        import prometheus_client

        prometheus_client.disable_created_metrics()
        self.registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self._labels = {"model_name": model_name, "replica": replica}
        self._prom = {}
        self._series = {}  # name -> the series of this replica's labels (labels() validates on every call: 20 us)
        self._ray = {}
        kinds = {"gauge": prometheus_client.Gauge, "counter": prometheus_client.Counter,
                 "histogram": prometheus_client.Histogram}
        for name, (kind, doc, extra, buckets) in METRICS.items():
            kwargs = {"buckets": buckets} if buckets else {}
            self._prom[name] = kinds[kind](name, doc, LABELS + extra, registry=self.registry, **kwargs)
            if not extra:  # every replica exports every series, at 0 until something happens
                self._series[name] = self._prom[name].labels(**self._labels)
            if use_ray:
                self._ray[name] = _make_ray_metric(name, kind, doc, extra, buckets, self._labels)
        self._last_counts: dict[str, float] = {}
        self._lora_info: dict[str, str] | None = None  # the labels of this replica's lora_requests_info series
        self._sync_lock = threading.Lock()

    def sync_engine_stats(self, stats) -> None:
        """Gauges take the latest value; counters grow by what the engine counted since the last sync."""
        with self._sync_lock:
            self._sync_locked(stats)

    def _sync_locked(self, stats) -> None:
        for field_name, metric in _ENGINE_GAUGES.items():
            self._set(metric, float(getattr(stats, field_name)))
        for field_name, metric in _ENGINE_COUNTERS.items():
            total = float(getattr(stats, field_name))
            delta = total - self._last_counts.get(field_name, 0.0)
            self._last_counts[field_name] = total
            if delta > 0:
                self._inc(metric, delta)
        for position, total in enumerate(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", None) or []):
            key = f"spec_decode_accepted_pos{position}"
            delta = total - self._last_counts.get(key, 0.0)
            self._last_counts[key] = float(total)
            if delta > 0:
                self._inc("pagoda:spec_decode_num_accepted_tokens_per_pos", delta, position=str(position))
        if stats.max_loras:
            self._set_lora_info(stats)

    def _set_lora_info(self, stats) -> None:
        """One series a replica, as vLLM's: a change of adapters replaces it (the old labels go)."""
        labels = {"running_lora_adapters": ",".join(stats.running_lora_adapters),
                  "waiting_lora_adapters": ",".join(stats.waiting_lora_adapters), "max_lora": str(stats.max_loras)}
        name = "pagoda:lora_requests_info"
        if self._lora_info is not None and self._lora_info != labels:
            self._prom[name].remove(*(self._labels | self._lora_info).values())
        self._lora_info = labels
        now = time.time()
        self._prom[name].labels(**self._labels, **labels).set(now)
        if name in self._ray:
            self._ray[name].set(now, tags=labels)
    def observe_first_token(self, ttft_s: float) -> None:
        self._observe("pagoda:time_to_first_token_seconds", ttft_s)

    def observe_inter_token(self, itl_s: float, num_tokens: int = 1) -> None:
        """num_tokens tokens, each itl_s after the one before (a streamed batch's tokens share its interval): as
        many observations in Prometheus' histogram, added at once; one in Ray's export, for the batch. A record
        through ray.util.metrics cost 12 us in an idle actor and 230 us in a busy replica (the GIL, given up and
        taken back), and there was one for every token of every stream: 65k in a 256-stream benchmark run."""
        name = "pagoda:inter_token_latency_seconds"
        _observe_many(self._series[name], itl_s, num_tokens)
        if name in self._ray:
            self._ray[name].observe(itl_s)

    def observe_finished(self, finished_reason: str, e2e_s: float | None, metrics=None,
                         lora_name: str | None = None) -> None:
        """A finished request: its reason, its latency from the server's arrival, and the engine's RequestMetrics
        (phases and token counts) when it got that far; lora_name: the adapter it ran with."""
        self._inc("pagoda:request_success", 1.0, finished_reason=finished_reason)
        if lora_name is not None:
            self._inc("pagoda:lora_request_success", 1.0, lora_name=lora_name, finished_reason=finished_reason)
        if e2e_s is not None:
            self._observe("pagoda:e2e_request_latency_seconds", e2e_s)
        if metrics is None:
            return
        for name, value in (("queue", metrics.queue_time_s), ("prefill", metrics.prefill_time_s),
                            ("decode", metrics.decode_time_s)):
            if value is not None:
                self._observe(f"pagoda:request_{name}_time_seconds", value)
        if metrics.decode_time_s is not None and metrics.num_output_tokens > 1:
            self._observe("pagoda:request_time_per_output_token_seconds",
                          metrics.decode_time_s / (metrics.num_output_tokens - 1))
        self._observe("pagoda:request_prompt_tokens", metrics.num_prompt_tokens)
        self._observe("pagoda:request_generation_tokens", metrics.num_output_tokens)

    def observe_steps(self, step_tokens: list[int]) -> None:
        for num_tokens in step_tokens:
            self._observe("pagoda:iteration_tokens_total", num_tokens)

    def snapshot(self) -> list[MetricFamily]:
        return [MetricFamily(f.name, f.type, f.documentation, [(s.name, dict(s.labels), s.value) for s in f.samples])
                for f in self.registry.collect()]

    # ---- both paths ----------------------------------------------------------------------------------------------
    def _set(self, name: str, value: float) -> None:
        self._series[name].set(value)
        if name in self._ray:
            self._ray[name].set(value)

    def _inc(self, name: str, value: float, **extra: str) -> None:
        (self._prom[name].labels(**self._labels, **extra) if extra else self._series[name]).inc(value)
        if name in self._ray:
            self._ray[name].inc(value, tags=extra or None)

    def _observe(self, name: str, value: float) -> None:
        self._series[name].observe(value)
        if name in self._ray:
            self._ray[name].observe(value)


def _observe_many(histogram, value: float, count: int) -> None:
    """`count` observations of `value` in one prometheus_client histogram series, as `count` observe() calls would
    leave it (it has no weighted observe: its sum, and the first bucket whose bound holds the value)."""
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:  # another prometheus_client's layout: one at a time
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect.bisect_left(bounds, value)].inc(count)


def _make_ray_metric(name, kind, doc, extra, buckets, default_tags):
    from ray.util import metrics

    tag_keys = LABELS + extra
    if kind == "gauge":
        metric = metrics.Gauge(ray_metric_name(name), doc, tag_keys=tag_keys)
    elif kind == "counter":
        metric = metrics.Counter(ray_metric_name(name), doc, tag_keys=tag_keys)
    else:
        metric = metrics.Histogram(ray_metric_name(name), doc, boundaries=list(buckets), tag_keys=tag_keys)
    return metric.set_default_tags(dict(default_tags))


def merge_families(snapshots: list[list[MetricFamily]]) -> bytes:
    """Every replica's families, merged by name, in Prometheus text format."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import Metric

    merged: dict[str, MetricFamily] = {}
    for families in snapshots:
        for family in families:
            into = merged.setdefault(family.name, MetricFamily(family.name, family.kind, family.documentation, []))
            into.samples.extend(family.samples)

    class _Collector:
        def collect(self):
            for family in merged.values():
                metric = Metric(family.name, family.documentation, family.kind)
                for sample_name, labels, value in family.samples:
                    metric.add_sample(sample_name, labels, value)
                yield metric

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)
