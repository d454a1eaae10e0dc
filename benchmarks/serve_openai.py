"""`pagoda bench serve --client openai`: the official `openai` client (AsyncOpenAI, streaming completions), in
several client processes so that the client's own Python does not set the pace. Each process takes every k-th
request and keeps its arrival time; the results come back as `benchmarks.serve._send` reports them."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import numpy as np

EXTRA_FIELDS = ("ignore_eos", "structured_outputs")


def run_clients(args: argparse.Namespace, bodies: list[dict], delays,
                warmup: list[dict] = ()) -> tuple[list[dict], float, float]:
    """(results in the order of bodies, seconds from the common start to the last request's end, that start as
    time.time()). The clock starts at the moment every process was told to send (not at the spawn), so process
    start-up is not counted; each process sends the `warmup` requests before it (untimed)."""
    k = max(args.client_processes, 1)
    start_at = time.time() + 5.0  # every process starts its clock at the same moment, after its imports (and warm-up)
    jobs = [(args.url, args.api_key, args.timeout_s, args.max_concurrency, bodies[i::k],
             [float(d) for d in delays[i::k]], start_at, list(warmup)) for i in range(k)]
    with multiprocessing.get_context("spawn").Pool(k) as pool:
        parts = pool.starmap(_client_process, jobs)
    results = [None] * len(bodies)
    for i, (part, _) in enumerate(parts):
        results[i::k] = part
    late = max(max(started - start_at, 0.0) for _, (started, _) in parts)
    if late > 0.5:
        print(f"warning: a client process started sending {late:.1f} s late (its imports); counted in the time")
    return results, max(ended for _, (_, ended) in parts) - start_at, start_at


def _client_process(url, api_key, timeout_s, max_concurrency, bodies, delays, start_at, warmup=()):
    """(results, (when it started sending, when its last request ended)), as time.time()."""
    import openai

    from benchmarks.serve import warm_up

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0,
                                    timeout=timeout_s)
        limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        await warm_up(lambda body: _send(client, body), warmup)
        await asyncio.sleep(max(start_at - time.time(), 0))
        started = time.time()
        try:
            results = await asyncio.gather(*(_one(client, body, delay, limit) for body, delay in zip(bodies, delays)))
            return results, (started, time.time())
        finally:
            await client.close()

    return asyncio.run(main())


async def _one(client, body: dict, delay_s: float, limit) -> dict:
    await asyncio.sleep(delay_s)
    if limit is None:
        return await _send(client, body)
    async with limit:
        return await _send(client, body)


async def _send(client, body: dict) -> dict:
    body = dict(body)
    extra = {name: body.pop(name) for name in EXTRA_FIELDS if name in body}  # vLLM's fields: not the client's
    start = time.perf_counter()
    token_times, usage = [], None
    try:
        stream = await client.completions.create(**body, extra_body=extra)
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            if chunk.choices:
                token_times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if not token_times:
        return {"ok": False, "error": "no tokens"}
    output_tokens = usage.completion_tokens if usage else len(token_times)
    ttft = token_times[0] - start
    return {"ok": True, "ttft": ttft, "e2e": end - start, "output_tokens": output_tokens,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "tpot": (end - start - ttft) / max(output_tokens - 1, 1), "itl": list(np.diff(token_times))}
