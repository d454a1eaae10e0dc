"""A bounded soak over real HTTP: 2,000 requests — completions and chats, streamed and not, with 20% of the
clients disconnecting mid-stream — then every replica is idle, holds no KV block (its host tier written through),
passes check_integrity() on both tiers, and no request got a 5xx."""

import asyncio
import json
import random

import httpx
import pytest

from tests.cluster.conftest import API_KEY
from tests.cluster.test_serve_faults import wait_until_idle

NUM_REQUESTS = 2000
CONCURRENCY = 64


def _body(rng: random.Random, i: int) -> tuple[str, dict]:
    common = {"model": "tiny", "max_tokens": rng.randint(1, 8), "temperature": rng.choice([0.0, 1.0]),
              "stream": rng.random() < 0.6}
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": f"request {i}: " + " ".join(rng.choices("abcdefgh", k=8))}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"question {i}"}]}


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int) -> tuple[int, bool]:
    """(status, whether the client left mid-stream)."""
    path, body = _body(rng, i)
    leave = body["stream"] and rng.random() < 1 / 3  # a third of the streams: 20% of all requests
    if not body["stream"]:
        r = await client.post(path, json=body)
        return r.status_code, False
    async with client.stream("POST", path, json=body | ({"max_tokens": 200, "ignore_eos": True} if leave else {})) \
            as r:
        async for line in r.aiter_lines():
            if leave and line.startswith("data: "):
                return r.status_code, True  # closing the stream here disconnects the client
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
    return r.status_code, False


@pytest.mark.slow  # ~40 s of mixed load
def test_soak_leaves_every_replica_clean(serve_url, http):
    rng = random.Random(2026)

    async def main():
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=serve_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120, limits=limits) as client:
            async def gated(i):
                async with gate:
                    return await _one(client, rng, i)

            return await asyncio.gather(*(gated(i) for i in range(NUM_REQUESTS)))

    results = asyncio.run(main())
    statuses = [status for status, _ in results]
    assert statuses.count(200) == NUM_REQUESTS, {s: statuses.count(s) for s in set(statuses)}
    left = sum(gone for _, gone in results)
    assert 0.15 * NUM_REQUESTS < left < 0.25 * NUM_REQUESTS
    stats = wait_until_idle(http, "tiny", timeout_s=60)
    assert all(s["kv_cache_usage"] == 0 for s in stats)
    assert all(s["kv_offloaded_bytes"] > 0 for s in stats)  # "tiny" writes through to its host tier
    assert sum(s["num_finished"].get("abort", 0) for s in stats) >= left * 0.9  # they were aborted, not run out
