"""Multi-turn conversations over a shared system prompt, the workload a host KV tier is for (issue #30; shaped like
LMCache's and SGLang HiCache's multi-turn tests). Each turn sends the conversation's whole history again: the last
turn's prompt, its answer and a new user message. Turns arrive as a Poisson process, each taken by a conversation
that is not waiting for an answer. Every host-tier size (`--swap-space-runs`), with each offload policy
(`--kv-offload-policy-runs`), runs the same workload on an engine of its own, one after the other in this process:
TTFT (arrival to first token) of every turn and of the turns after the first, and throughput.

    pagoda bench multi-turn --preset llama-3-8b --num-kv-blocks 4096 --swap-space-runs 0 64 --num-conversations 200 \\
        --turns 8 --system-len 1024 --user-len 256 --output-len 128 --request-rate 8

Cap the device pool (`--num-kv-blocks`) below the conversations' working set to see the tier at work.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.common import device_name, percentiles, print_table, write_json
from checkpoints.presets import model_or_preset


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--swap-space-runs", dest="swap_spaces", type=float, nargs="+", default=None,
                        metavar="GIB", help="the host tier's GiB per rank of each run (0: no tier; default: 0 and "
                                            "--swap-space, or 0 and 16)")
    parser.add_argument("--kv-offload-policy-runs", dest="offload_policies", nargs="+", default=None,
                        choices=["write-through", "write-back"],
                        help="each host tier of --swap-space-runs once with each of these policies (default: "
                             "--kv-offload-policy's)")
    parser.add_argument("--num-conversations", type=int, default=200)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=1024, help="the shared system prompt's tokens")
    parser.add_argument("--user-len", type=int, default=256, help="tokens of each user message")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=8.0, help="turns per second (Poisson)")
    parser.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below it (default: "
                                                                     "the model's, at most 30000)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


@dataclass
class Conversation:
    history: list[int]
    turns_left: int
    busy: bool = False


@dataclass
class Turn:
    conversation: Conversation
    number: int
    arrival: float
    prompt_len: int
    first_token: float | None = None
    output: list[int] = field(default_factory=list)


def run_workload(engine, args: argparse.Namespace, vocab: int) -> dict:
    """Runs the conversations to their end on `engine`; TTFT, throughput and the KV tiers' counters."""
    from engine.sampling_params import SamplingParams

    rng = np.random.default_rng(args.workload_seed)
    low = min(1000, vocab // 2)  # past the special tokens of real vocabularies
    words = lambda n: rng.integers(low, vocab, n).tolist()  # noqa: E731
    system = words(args.system_len)
    conversations = [Conversation(list(system), args.turns) for _ in range(args.num_conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    gaps = iter(rng.exponential(1.0 / args.request_rate, args.num_conversations * args.turns).tolist())
    in_flight: dict[str, Turn] = {}
    done: list[Turn] = []
    start = time.perf_counter()
    next_arrival = start + next(gaps)
    while len(done) < args.num_conversations * args.turns:
        now = time.perf_counter()
        idle = [c for c in conversations if not c.busy and c.turns_left]
        while next_arrival <= now and idle:
            conversation = idle.pop(int(rng.integers(len(idle))))
            conversation.history += words(args.user_len)
            conversation.busy, conversation.turns_left = True, conversation.turns_left - 1
            turn = Turn(conversation, args.turns - conversation.turns_left, next_arrival, len(conversation.history))
            req_id = f"t{len(done) + len(in_flight)}"
            in_flight[req_id] = turn
            engine.add_request(req_id, {"prompt_token_ids": list(conversation.history)}, params, stream=True)
            next_arrival += next(gaps, 0.0)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(next_arrival - time.perf_counter(), 0.05)))
            continue
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            turn = in_flight[delta.request_id]
            tokens = [t for seq in delta.seqs for t in seq.token_ids]
            if tokens and turn.first_token is None:
                turn.first_token = now
            turn.output += tokens
            if delta.finished:
                del in_flight[delta.request_id]
                turn.conversation.history += turn.output
                turn.conversation.busy = False
                done.append(turn)
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    ttft = [t.first_token - t.arrival for t in done]
    later = [t.first_token - t.arrival for t in done if t.number > 1]
    tokens = sum(t.prompt_len + len(t.output) for t in done)
    return {"turns": len(done), "elapsed_s": elapsed, "total_tokens_per_s": tokens / elapsed,
            "prompt_tokens": sum(t.prompt_len for t in done), "ttft_s": percentiles(ttft),
            "ttft_s_later_turns": percentiles(later), "prefix_cache_queries": stats.prefix_cache_queries,
            "device_hits_tokens": stats.prefix_cache_hits, "host_hits_tokens": stats.host_prefix_cache_hits,
            "offloaded_bytes": stats.kv_offloaded_bytes, "onloaded_bytes": stats.kv_onloaded_bytes,
            "preemptions": stats.num_preemptions, "swapped_in_tokens": stats.swapped_in_tokens,
            "preemption_recomputed_tokens": stats.preemption_recomputed_tokens}


def main(args: argparse.Namespace) -> dict:
    from cluster.executors import pick_executor
    from engine.arg_utils import engine_args
    from engine.llm_engine import LLMEngine

    model_dir, load_format = model_or_preset(args.model, args.preset, args.load_format)
    rows = []
    policies = args.offload_policies or [args.kv_offload_policy]
    runs = [(gib, policy) for gib in args.swap_spaces or [0.0, args.swap_space or 16.0]
            for policy in (policies if gib > 0 else policies[:1])]
    for gib, policy in runs:
        config = engine_args(args, model=model_dir, load_format=load_format, swap_space=gib,
                             kv_offload_policy=policy).create_engine_config()
        engine = LLMEngine(config, pick_executor)
        vocab = min(args.vocab_size or engine.vocab_size, engine.vocab_size, 30000)
        longest = args.system_len + args.turns * (args.user_len + args.output_len)
        if longest > engine.max_model_len:
            raise ValueError(f"the last turn's {longest} tokens do not fit this model's {engine.max_model_len}")
        measured = run_workload(engine, args, vocab)
        rows.append({"swap_space_gib": gib, "kv_offload_policy": policy if gib > 0 else None,
                     "num_kv_blocks": engine.executor.num_kv_blocks,
                     "num_host_kv_blocks": engine.executor.num_host_kv_blocks, **measured,
                     "ttft_p50_ms": 1e3 * measured["ttft_s"]["p50"], "ttft_p90_ms": 1e3 * measured["ttft_s"]["p90"]})
        engine.check_integrity()
        engine.shutdown()
    print_table(rows, ["swap_space_gib", "kv_offload_policy", "num_host_kv_blocks", "ttft_p50_ms", "ttft_p90_ms",
                       "total_tokens_per_s", "device_hits_tokens", "host_hits_tokens", "preemptions"])
    result = {"benchmark": "multi-turn", "device": device_name(),
              "model": args.preset or args.model or "smollm2-135m-instruct",
              "workload": {name: getattr(args, name) for name in ("num_conversations", "turns", "system_len",
                                                                 "user_len", "output_len", "request_rate")},
              "results": rows}
    write_json(args.output_json, result)
    return result
