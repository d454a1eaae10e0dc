"""Online serving benchmark: replays synthetic requests against an OpenAI-compatible `/v1/completions` endpoint at
a Poisson rate (or all at once) with streaming, and reports what `vllm bench serve` reports: TTFT, TPOT,
inter-token latency and end-to-end latency (mean, p50, p90, p99), request and token throughput.

    pagoda bench serve --url http://127.0.0.1:8000 --num-requests 256 --request-rate inf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from benchmarks.common import (
    add_workload_args,
    input_len_range,
    percentiles,
    print_table,
    synthetic_prompts,
    write_json,
)
from benchmarks.structured import BENCH_SCHEMA, STRUCTURED_CHOICES


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    add_workload_args(parser)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all")
    parser.add_argument("--vocab-size", type=int, default=None, help="for token-id prompts (default: from the server)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most (default: no limit, as vllm bench serve)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times; change it between runs "
                        "against one server, or the prefix cache serves the prompts of the run before")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--client", choices=["aiohttp", "openai"], default="aiohttp",
                        help="aiohttp: one process, raw SSE; openai: the official openai client (AsyncOpenAI)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="with --client openai: this many client processes share the requests")
    parser.add_argument("--warmup-requests", type=int, default=0,
                        help="untimed short requests sent at once before the clock starts (with --client openai, "
                        "by every client process): the server's and the clients' connections and paths warm, as a "
                        "service that has been up a while; 0: none")
    parser.add_argument("--structured", choices=STRUCTURED_CHOICES, default=None,
                        help="every request under this constraint (the schema of `bench throughput --structured`)")
    parser.add_argument("--output-json", default=None)


async def _one(session, url: str, headers: dict, body: dict, delay_s: float, limit: asyncio.Semaphore | None) -> dict:
    await asyncio.sleep(delay_s)
    if limit is None:
        return await _send(session, url, headers, body)
    async with limit:
        return await _send(session, url, headers, body)


async def _send(session, url: str, headers: dict, body: dict) -> dict:
    start = time.perf_counter()
    token_times: list[float] = []
    usage = None
    error = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return {"ok": False, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):  # one chunk per engine step that moved, text or not (random weights
                    token_times.append(time.perf_counter())  # often sample ids the tokenizer prints as nothing)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error or not token_times:
        return {"ok": False, "error": error or "no tokens"}
    output_tokens = usage["completion_tokens"] if usage else len(token_times)
    ttft = token_times[0] - start
    return {"ok": True, "ttft": ttft, "e2e": end - start, "output_tokens": output_tokens,
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "tpot": (end - start - ttft) / max(output_tokens - 1, 1), "itl": list(np.diff(token_times))}


async def _models(args: argparse.Namespace, headers: dict) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{args.url}/v1/models", headers=headers) as resp:
            return (await resp.json())["data"]


async def _run_aiohttp(args: argparse.Namespace, headers: dict, bodies: list[dict], delays,
                       warmup: list[dict]) -> tuple[list[dict], float, float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    # aiohttp's default pool holds 100 connections: more requests than that would wait in the client.
    url = f"{args.url}/v1/completions"
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await warm_up(lambda body: _send(session, url, headers, body), warmup)
        started_at, start = time.time(), time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, headers, body, float(d), limit)
                                         for body, d in zip(bodies, delays)))
        return results, time.perf_counter() - start, started_at


def request_body(model: str, prompt: list[int], max_tokens: int, structured: str | None = None) -> dict:
    """One streamed completion of exactly max_tokens tokens (ignore_eos), its usage in the last chunk; with
    `structured` ("json-schema"), under the offline benchmark's schema (vLLM's `structured_outputs` field), which no
    output completes within max_tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if structured is not None:
        body["structured_outputs"] = {"json": BENCH_SCHEMA}
    return body


def warmup_bodies(args: argparse.Namespace, model: str, count: int) -> list[dict]:
    """Short streamed requests of their own random prompts (no prefix shared with the timed ones)."""
    prompts = synthetic_prompts(count, (8, 8), args.vocab_size or 1000, args.seed + 1_000_003)
    return [request_body(model, p, 2) for p in prompts]


async def warm_up(send, bodies: list[dict]) -> None:
    """Sends every warm-up body at once; a failed one fails the run (the server is not ready)."""
    for result in await asyncio.gather(*(send(body) for body in bodies)):
        if not result["ok"]:
            raise RuntimeError(f"a warm-up request failed: {result['error']}")


def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or asyncio.run(_models(args, headers))[0]["id"]
    prompts = synthetic_prompts(args.num_requests, input_len_range(args), args.vocab_size or 1000, args.seed)
    rng = np.random.default_rng(args.seed)
    gaps = (np.zeros(len(prompts)) if args.request_rate == float("inf")
            else rng.exponential(1.0 / args.request_rate, size=len(prompts)))
    delays = np.cumsum(gaps) - gaps[0]
    bodies = [request_body(model, p, args.output_len, args.structured) for p in prompts]
    warmup = warmup_bodies(args, model, args.warmup_requests)
    if args.client == "openai":
        from benchmarks.serve_openai import run_clients

        results, elapsed, started_at = run_clients(args, bodies, delays, warmup)
    else:
        results, elapsed, started_at = asyncio.run(_run_aiohttp(args, headers, bodies, delays, warmup))
    ok = [r for r in results if r["ok"]]
    output_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    to_ms = lambda d: {k: 1000 * v for k, v in d.items()}  # noqa: E731
    return {
        "benchmark": "serve", "url": args.url, "model": model, "num_requests": len(prompts), "client": args.client,
        "client_processes": args.client_processes if args.client == "openai" else 1,
        "warmup_requests": args.warmup_requests, "structured": args.structured,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency, "completed": len(ok),
        "failed": len(results) - len(ok), "errors": [r["error"] for r in results if not r["ok"]][:5],
        "started_at_unix_s": started_at, "elapsed_s": elapsed, "requests_per_s": len(ok) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "ttft_ms": to_ms(percentiles([r["ttft"] for r in ok])), "tpot_ms": to_ms(percentiles([r["tpot"] for r in ok])),
        "itl_ms": to_ms(percentiles([x for r in ok for x in r["itl"]])),
        "e2e_ms": to_ms(percentiles([r["e2e"] for r in ok])),
    }


def main(args: argparse.Namespace) -> dict:
    result = run(args)
    rows = [{"metric": name, **result[name]} for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]
    print(f"completed {result['completed']}/{result['num_requests']} in {result['elapsed_s']:.1f} s: "
          f"{result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.0f} output tok/s, "
          f"{result['total_tokens_per_s']:.0f} total tok/s")
    print_table(rows, ["metric", "mean", "p50", "p90", "p99"])
    write_json(args.output_json, result)
    return result
