"""Two replicas of "tiny": prefix-cache affinity (seen in each replica's prefix-cache hit counter) and load
spreading (a burst lands on both)."""

from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

SHARED_PREFIX = ("Pagoda serves language models on Ray. This long system prompt is shared by every request of "
                 "the conversation, so its KV blocks should be computed once, on one replica, and then found in "
                 "that replica's prefix cache by every later request that starts the same way. ") * 2


def per_replica(http, metric: str, model: str = "tiny") -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == metric and sample.labels.get("model_name") == model:
                values[sample.labels["replica"]] = sample.value
    return values


def complete(http, prompt: str, max_tokens: int = 2):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.headers["x-pagoda-replica"]


def test_shared_prefix_lands_on_the_replica_that_caches_it(http, tiny_tokenizer):
    assert len(tiny_tokenizer.encode(SHARED_PREFIX)) >= 64  # several full KV blocks
    hits_before = per_replica(http, "pagoda:prefix_cache_hits_total")
    assert len(hits_before) == 2
    replicas = [complete(http, SHARED_PREFIX + f"Question {i}: what is {i} + {i}?") for i in range(5)]
    assert len(set(replicas)) == 1, replicas
    hits_after = per_replica(http, "pagoda:prefix_cache_hits_total")
    owner, other = replicas[0], next(r for r in hits_after if r != replicas[0])
    assert hits_after[owner] - hits_before[owner] >= 4 * 64  # four later requests, each found the prefix
    assert hits_after[other] == hits_before[other]


def test_a_burst_spreads_over_both_replicas(http):
    prompts = [f"{i} burst prompt number {i}" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replicas = list(pool.map(lambda p: complete(http, p, max_tokens=24), prompts))
    assert len(set(replicas)) == 2, replicas


def test_replicas_report_both_tiers_to_the_router(http):
    """What Serve hands the router as each replica's routing stats: its device pool's and host tier's tokens (the
    "tiny" model: 256 device and 512 host blocks of 16 tokens)."""
    import asyncio

    from ray import serve

    async def ask():  # (the handles of this Serve run their router in the caller's event loop)
        handle = serve.get_deployment_handle("LLMServer_tiny", app_name="pagoda")
        return await asyncio.wait_for(handle.record_routing_stats.remote(), 30)

    stats = asyncio.run(ask())
    assert stats == {"kv_cache_tokens": 256 * 16, "host_kv_cache_tokens": 512 * 16}
