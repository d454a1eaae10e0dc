"""Pagoda's autoscaling policy for Ray Serve: replicas follow what the engines report, not only ongoing requests.

    each LLMServer replica ── record_autoscaling_stats() ──► Serve controller (every metrics_interval_s)
        {"num_running", "num_waiting", "kv_cache_usage"}          │ aggregated over look_back_period_s
                                                                   ▼
    PagodaAutoscalingPolicy(ctx) → desired replicas = the largest of
        ongoing requests / target_ongoing_requests              (Serve's own signal)
        Σ KV-cache usage / target_kv_cache_usage                (the caches fill before requests queue)
        current + 1, when more than target_waiting_requests wait per replica (requests queue already)

Serve applies the bounds (min/max_replicas), the delays (upscale_delay_s, downscale_delay_s) and the scaling
factors around the policy. It scales down only when every signal fits in fewer replicas; the replica it stops is
drained first (graceful_shutdown_timeout_s: its streams finish). `policy: ongoing_requests` in the app args keeps
Serve's own policy.

LoRA adapters are no signal of their own: a request counts as ongoing (and as running or waiting in its engine)
whatever its adapter, and one that waits for a GPU slot (more adapters at once than max_loras) is a waiting request,
so adapter churn scales the model up as any queue does. Where each adapter's requests go is the router's business
(cluster/router.py: an adapter's replicas first, spreading when they are busy).

The host KV tier (--swap-space) is not a signal of its own. Written through and evicted least recently used, it is
full once the replica has computed its size in tokens, whatever the load, so its usage says nothing. When it is too
small for the prefixes that come back, they are computed again: more prefill, longer queues and fuller device
pools, which the signals above already count; a preemption it turns into copies costs little, so preemptions are no
signal either. Adding replicas to hold more prefixes is a trade the operator makes with `swap_space` (host memory)
rather than with GPUs.
"""

from __future__ import annotations

POLICY_PATH = "cluster.autoscaling:PagodaAutoscalingPolicy"
STATS = ("num_running", "num_waiting", "kv_cache_usage")


def autoscaling_stats(stats) -> dict[str, float]:
    """What a replica reports to the controller (from its engine's EngineStats)."""
    return {name: float(getattr(stats, name)) for name in STATS}


class PagodaAutoscalingPolicy:
    """Serve instantiates it once with `policy_kwargs` and calls it every control-loop tick."""

    def __init__(self, target_kv_cache_usage: float = 0.75, target_waiting_requests: float = 0.0):
        assert 0 < target_kv_cache_usage <= 1, target_kv_cache_usage
        assert target_waiting_requests >= 0, target_waiting_requests
        self.target_kv_cache_usage = target_kv_cache_usage
        self.target_waiting_requests = target_waiting_requests

    def __call__(self, ctx) -> tuple[float, dict]:
        replicas = ctx.current_num_replicas
        if replicas == 0:
            return ctx.target_num_replicas, {}
        desired = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
        metrics = ctx.aggregated_metrics or {}
        kv = metrics.get("kv_cache_usage") or {}
        if kv:
            desired = max(desired, sum(kv.values()) / self.target_kv_cache_usage)
        waiting = sum((metrics.get("num_waiting") or {}).values())
        if waiting > self.target_waiting_requests * replicas:
            desired = max(desired, replicas + 1)
        return desired, {"signals": {"ongoing": ctx.total_num_requests, "kv_cache_usage": sum(kv.values()),
                                     "waiting": waiting, "desired": desired}}
