"""Would a replica rather fetch a prefix's KV blocks from another replica's host tier, over Ray's object store, than
compute the prefix itself? Measured with two replicas' engines in two Ray actors on this machine (docs/architecture.md,
"Across replicas", records the figures).

    python -m benchmarks.cross_replica_fetch --prefix-lens 1024 2048 4096      (the built-in SmolLM2-135M)

For each prefix length L, with fresh random prompts each repeat:
  computed   replica A's TTFT for a prompt of L tokens seen nowhere (the prefix computed; B is the same engine)
  fetched    its blocks, written through to A's host tier: B asks A for them: A gathers its host blocks into one
             array, returned through the object store; B writes it into free blocks of its own host tier and files
             their hashes (the chain is the same on every replica); then B's TTFT for the prompt, which copies them
             back instead of computing them. Fetch time and TTFT, apart and together.
The fetch's bytes per second through the object store are what carries over to another machine: a fetch beats
recomputing when bytes / that rate (plus its fixed cost) is below the prefix's prefill time on the serving device.

Starts a Ray cluster of its own (2 actors of 1 CPU); not a `pagoda bench` subcommand: the GPU machine has no Ray.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cross_replica_fetch",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=2, help="each replica's CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


class Replica:
    """One replica's engine (CPU, a host tier), with the two ends of a fetch."""

    def __init__(self, engine_kwargs: dict):
        from cluster.executors import pick_executor
        from engine.config import EngineArgs
        from engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineArgs(**engine_kwargs).create_engine_config(), pick_executor)
        self.pool = self.engine.executor.worker.runner.host_pool

    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        """(seconds to the first token of a one-token request, blocks it copied back from the host)."""
        from engine.sampling_params import SamplingParams

        bm, start = self.engine.block_manager, time.perf_counter()
        onloaded = bm.num_onloaded_blocks
        self.engine.add_request(None, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
        first = None
        while self.engine.has_unfinished_requests():
            if self.engine.step() and first is None:
                first = time.perf_counter() - start
        self.engine.step()  # the step that writes the prompt's blocks to the host
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return first or 0.0, bm.num_onloaded_blocks - onloaded

    def forget(self) -> None:
        """Both tiers forget every cached block (nothing runs between measurements)."""
        self.engine.block_manager.reset_prefix_cache()

    def export_blocks(self, prompt: list[int]) -> tuple[list[bytes], np.ndarray, float]:
        """The host blocks of the longest prefix of `prompt` this replica's host tier holds: (their hashes, their KV
        gathered in the host pool's layout, [blocks, layers, a layer's K and V of a block (flat)], seconds spent
        gathering)."""
        import torch

        start = time.perf_counter()
        hashes, host_blocks = self._host_run(prompt)
        kv = self.pool.buffer[torch.tensor(host_blocks, dtype=torch.long)].numpy()
        return hashes, kv, time.perf_counter() - start

    def import_blocks(self, hashes: list[bytes], kv: np.ndarray) -> float:
        """Writes fetched blocks into free host blocks and files their hashes: a later request hits them there."""
        import torch

        start = time.perf_counter()
        bm = self.engine.block_manager
        host_blocks = []
        for block_hash in hashes:
            host_block = bm._free_host_block()
            assert host_block is not None, "the host tier has no block to spare"
            bm._host_cached[block_hash] = host_block
            host_blocks.append(host_block)
        self.pool.buffer[torch.tensor(host_blocks, dtype=torch.long)] = torch.from_numpy(np.asarray(kv))
        bm.check_integrity()
        return time.perf_counter() - start

    def _host_run(self, prompt: list[int]) -> tuple[list[bytes], list[int]]:
        from engine.block_manager import hash_block

        bm, size = self.engine.block_manager, self.engine.block_manager.block_size
        hashes, host_blocks, parent = [], [], None
        for i in range((len(prompt) - 1) // size):
            parent = hash_block(parent, prompt[i * size:(i + 1) * size])
            host_block = bm._host_cached.get(parent)
            if host_block is None:
                break
            hashes.append(parent)
            host_blocks.append(host_block)
        return hashes, host_blocks


def main(argv: list[str] | None = None) -> dict:
    import ray

    from benchmarks.common import percentiles, print_table, write_json

    args = parse_args(argv)
    longest = max(args.prefix_lens)
    blocks = 4 * (longest // args.block_size + 2)  # the longest prompt twice over, in each tier
    engine_kwargs = dict(model=args.model, dtype=args.dtype, device="cpu", block_size=args.block_size,
                         num_kv_blocks=blocks, num_host_kv_blocks=blocks, max_model_len=longest + 16,
                         max_num_batched_tokens=longest + 16, min_onload_blocks=1)
    env = {"PAGODA_TORCH_THREADS": str(args.torch_threads), "OMP_NUM_THREADS": str(args.torch_threads)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        actor = ray.remote(num_cpus=1)(Replica)
        a, b = actor.remote(engine_kwargs), actor.remote(engine_kwargs)
        vocab = ray.get(a.vocab_size.remote())
        rng = np.random.default_rng(args.seed)
        words = lambda n: rng.integers(vocab // 4, vocab, n).tolist()  # noqa: E731
        ray.get([a.ttft.remote(words(64)), b.ttft.remote(words(64))])  # warm-up
        rows = [_measure(ray, a, b, length, args.repeats, words, percentiles) for length in args.prefix_lens]
    finally:
        ray.shutdown()
    print_table(rows, ["prefix_len", "kv_mb", "computed_ms", "fetch_ms", "fetched_ttft_ms", "fetched_total_ms",
                       "fetch_gb_per_s", "speedup"])
    result = {"benchmark": "cross-replica-fetch", "model": args.model or "smollm2-135m-instruct",
              "dtype": args.dtype, "block_size": args.block_size, "torch_threads": args.torch_threads,
              "results": rows}
    write_json(args.output_json, result)
    return result


def _measure(ray, a, b, length: int, repeats: int, words, percentiles) -> dict:
    computed, fetch, fetched_ttft, export, import_, sizes = [], [], [], [], [], []
    for _ in range(repeats):
        prompt = words(length)
        seconds, _ = ray.get(a.ttft.remote(prompt))  # A computes it, and writes its blocks to its host tier
        computed.append(seconds)
        start = time.perf_counter()
        hashes, kv, export_s = a.export_blocks.options(num_returns=3).remote(prompt)
        import_s = ray.get(b.import_blocks.remote(hashes, kv))
        fetch.append(time.perf_counter() - start)
        export.append(ray.get(export_s))
        import_.append(import_s)
        sizes.append(ray.get(kv).nbytes)
        seconds, onloaded = ray.get(b.ttft.remote(prompt))  # B copies them back from its host tier
        assert onloaded == len(ray.get(hashes)) > 0, (onloaded, length)
        fetched_ttft.append(seconds)
        ray.get([b.forget.remote(), a.forget.remote()])
    med = lambda values: 1e3 * percentiles(values)["p50"]  # noqa: E731
    total = [f + t for f, t in zip(fetch, fetched_ttft)]
    return {"prefix_len": length, "kv_mb": sizes[0] / 1e6, "computed_ms": med(computed), "fetch_ms": med(fetch),
            "export_ms": med(export), "import_ms": med(import_), "fetched_ttft_ms": med(fetched_ttft),
            "fetched_total_ms": med(total), "fetch_gb_per_s": sizes[0] / percentiles(fetch)["p50"] / 1e9,
            "speedup": med(computed) / med(total)}


if __name__ == "__main__":
    main()
