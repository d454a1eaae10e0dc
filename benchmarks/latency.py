"""Decode latency: the time of one decode step (= ms per output token of each request) at a given batch size and
prompt length, measured on the engine's own step loop after every request has finished its prefill.

    pagoda bench latency --preset llama-3-8b --batch-sizes 1 8 64 256 --prompt-lens 128 2048
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import numpy as np

from benchmarks.common import device_name, free_device_memory, print_table, synthetic_prompts, write_json
from benchmarks.lora_workload import add_lora_bench_args, lora_label, lora_runs, run_adapters, spread
from benchmarks.structured import add_structured_args, constraint, grammar_figures, structured_variants, tokenizer_dir
from checkpoints.presets import model_or_preset


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--oracle-drafts", type=float, default=None, metavar="P",
                        help="with --speculative-config, also an `oracle` row: each request's drafts are its own "
                             "greedy continuation (recorded first), each draft right with probability P: the "
                             "speed-up at a known acceptance where no proposer predicts the output (random weights)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="on a GPU, also profile this many decode steps of each case (benchmarks/step_profile.py)")
    add_structured_args(parser)
    add_lora_bench_args(parser)
    parser.add_argument("--output-json", default=None)


def measure(engine, prompts: list[list[int]], decode_steps: int, profile_steps: int = 0,
            structured: str | None = None, loras: list | None = None, drafts: str | None = None,
            oracle_accuracy: float | None = None) -> dict:
    """One case: `prompts` (a request each, with its adapter from `loras`) prefilled, then `decode_steps` timed.
    drafts (a speculative engine): its method ("ngram", "draft_model") proposes as configured; "forced" proposes k
    drafts every step (the last token repeated), so each step verifies k + 1 tokens whatever the model accepts: the
    verify step's cost; "oracle" proposes each request's own greedy continuation, recorded first, each draft right
    with probability `oracle_accuracy` (`ReplayProposer`). Where the n-gram engine's workers propose on the device
    (an in-process executor), forced and oracle drafts are proposed there too, in the n-gram lookup's place
    (`RepeatLastLookup`, `ReplayLookup`), and every such step runs ahead (the row's `steps_ahead`); the n-gram row
    runs ahead or pipelined as the engine chooses (PAGODA_SPEC_RUN_AHEAD, RunAheadChoice)."""
    import torch

    from engine.sampling_params import SamplingParams
    from engine.spec_decode import RunAheadChoice

    # No length limit (they are aborted after the measurement): with chunked prefill, the first requests decode
    # while the last ones prefill, and a limit would let them finish before the decode steps are timed.
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True,
                            structured_outputs=constraint(structured))
    loras = loras or [None] * len(prompts)
    proposer = engine.spec.proposer if engine.spec is not None else None
    runner = _device_drafting_runner(engine) if drafts in ("forced", "oracle") else None
    lookup = runner.lookup if runner is not None else None
    if drafts == "oracle":
        k = engine.spec.config.num_speculative_tokens
        references = greedy_continuations(engine, prompts, loras, (decode_steps + 8) * (k + 1))
        if runner is not None:
            runner.lookup = ReplayLookup(references, oracle_accuracy, engine.vocab_size, runner.device)
        else:
            engine.spec.proposer = ReplayProposer(references, k, oracle_accuracy, engine.vocab_size)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"lat-{i}", {"prompt_token_ids": prompt}, params, stream=False, lora_request=loras[i])
    if drafts == "forced":
        if runner is not None:
            runner.lookup = RepeatLastLookup()
        else:
            engine.spec.proposer = RepeatLastProposer(engine.spec.config.num_speculative_tokens)
    choice = engine.spec.run_ahead if engine.spec is not None else None
    if runner is not None:  # (drafts the driver cannot propose: every step ahead, whatever the engine would choose)
        engine.spec.run_ahead = RunAheadChoice(pinned=True)
    start = time.perf_counter()
    while any(not g.seqs[0].output_token_ids for g in engine.groups.values()):
        engine.step()  # prefill (possibly chunked)
    prefill_s = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    preemptions = engine.get_stats().num_preemptions
    grammar = replace(engine.structured.stats)
    spec = replace(engine.scheduler.spec_stats, accepted_per_position=[])
    propose_s = engine.spec.propose_total_s if engine.spec is not None else 0.0
    ahead = engine.spec.num_steps_ahead if engine.spec is not None else 0
    running = []
    graph_steps = _verify_graph_replays(engine)
    generated = _output_tokens(engine)
    start = time.perf_counter()
    for _ in range(decode_steps):
        engine.step()
        running.append(engine.scheduler.num_running)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the last step's work, launched ahead (overlapped scheduling), counts too
    decode_s = time.perf_counter() - start
    # Tokens per request per step: 1 without speculation (a step in flight at either end counts the same).
    per_step = (_output_tokens(engine) - generated) / max(len(prompts), 1) / decode_steps
    # Requests preempted for lack of KV blocks make steps smaller than the batch: tokens_per_s would overstate.
    row = {"prefill_s": prefill_s, "ms_per_step": 1000 * decode_s / decode_steps,
           "decode_ms_per_token": 1000 * decode_s / decode_steps / max(per_step, 1e-9),
           "tokens_per_step": per_step, "tokens_per_s": sum(running) * per_step / decode_s,
           "min_running": min(running, default=0), "preemptions": engine.get_stats().num_preemptions - preemptions}
    if drafts:
        stats = engine.scheduler.spec_stats
        num_draft_tokens = stats.num_draft_tokens - spec.num_draft_tokens
        row |= {"drafts": drafts, "draft_tokens_per_step": num_draft_tokens / max(len(prompts), 1) / decode_steps,
                "acceptance": (stats.num_accepted_tokens - spec.num_accepted_tokens) / max(num_draft_tokens, 1),
                "graph_steps": (_verify_graph_replays(engine) - graph_steps) / decode_steps,  # verify CUDA graphs
                "propose_ms_per_step": 1000 * (engine.spec.propose_total_s - propose_s) / decode_steps,
                "steps_ahead": (engine.spec.num_steps_ahead - ahead) / decode_steps}  # launched before the last read
        engine.spec.proposer, engine.spec.run_ahead = proposer, choice
        if runner is not None:
            runner.lookup = lookup
    if structured:
        row |= {"structured": structured} | grammar_figures(engine.structured.stats, grammar)
    if profile_steps and torch.cuda.is_available():
        from benchmarks.step_profile import print_profile
        from benchmarks.step_profile import profile_steps as run_profile

        row["profile"] = run_profile(engine, profile_steps)
        print_profile(f"batch {len(prompts)}", row["profile"])
    engine.abort_request(list(engine.groups))
    engine.step()
    return row


def _device_drafting_runner(engine):
    """The rank-0 runner whose n-gram lookup proposes drafts on the device, where the engine's drafts come from there
    (an n-gram engine, an in-process executor); None otherwise."""
    worker = getattr(engine.executor, "worker", None)
    if engine.spec is None or not engine.spec.drafts_on_device or worker is None:
        return None
    return worker.runner if worker.runner.ngram is not None else None


class RepeatLastLookup:
    """The forced drafts on the device (the runner's lookup, kernels/ngram.py's signature): k copies of each
    history's last token."""

    def __call__(self, tokens, lengths, k: int, min_n: int, max_n: int):
        import torch

        last = tokens.long().gather(1, (lengths - 1).clamp(min=0)[:, None])
        return last.expand(-1, k).contiguous(), torch.full_like(lengths, k)


class ReplayLookup:
    """The oracle drafts on the device: each history's continuation in `references` (prompts of one length: the
    bench's), each draft kept with probability `accuracy` and otherwise made another token (a seeded device
    generator); none for a history whose prompt is not there. No host round trip, so steps still run ahead."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], accuracy: float, vocab_size: int, device,
                 seed: int = 0):
        import torch

        (self.prompt_len,) = {len(p) for p in references}
        width = max(len(o) for o in references.values())
        self.prompts = torch.tensor(list(references), dtype=torch.long, device=device)
        self.outputs = torch.tensor([o + [0] * (width - len(o)) for o in references.values()], device=device)
        self.lengths = torch.tensor([len(o) for o in references.values()], device=device)
        self.accuracy, self.vocab_size = accuracy, vocab_size
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, tokens, lengths, k: int, min_n: int, max_n: int):
        import torch

        p = self.prompt_len
        match = (tokens[:, None, :p].long() == self.prompts[None]).all(dim=-1)  # [R, refs]
        ref = match.long().argmax(dim=1)
        start = lengths - p  # the next output's index in its reference
        index = start[:, None] + torch.arange(k, device=tokens.device)[None, :]
        drafts = self.outputs[ref].gather(1, index.clamp(0, self.outputs.shape[1] - 1))
        wrong = torch.rand(drafts.shape, generator=self.generator, device=tokens.device) >= self.accuracy
        drafts = torch.where(wrong, (drafts + 1) % self.vocab_size, drafts)
        found = torch.where(match.any(dim=1), (self.lengths[ref] - start).clamp(0, k), 0)
        return drafts, found


def _verify_graph_replays(engine) -> int:
    """Speculative steps rank 0 has run by a verify CUDA graph so far (workers/cuda_graphs.py)."""
    ranks = engine.executor.describe()
    return ranks[0].get("verify_graph_replays", 0) if ranks else 0


def _output_tokens(engine) -> int:
    return sum(len(g.seqs[0].output_token_ids) for g in engine.groups.values())


@dataclass
class RepeatLastProposer:
    """The benchmark's forced drafts: k copies of the last token, every step (engine/spec_decode.py's Proposer)."""

    num_speculative_tokens: int

    def propose(self, token_ids) -> list[int]:
        return [int(token_ids[-1])] * self.num_speculative_tokens


class ReplayProposer:
    """The benchmark's oracle drafts: each request's own greedy continuation (`references`: prompt -> output),
    each draft kept with probability `accuracy` and otherwise made another token (independently, seeded); nothing for
    a sequence past its recorded output."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], num_speculative_tokens: int, accuracy: float,
                 vocab_size: int, seed: int = 0):
        self.references, self.k, self.accuracy = references, num_speculative_tokens, accuracy
        self.vocab_size = vocab_size
        self.prompt_lens = sorted({len(p) for p in references})
        self.rng = np.random.default_rng(seed)

    def propose(self, token_ids) -> list[int]:
        for n in self.prompt_lens:
            output = self.references.get(tuple(token_ids[:n].tolist()))
            if output is not None:
                drafts = output[len(token_ids) - n:len(token_ids) - n + self.k]
                wrong = self.rng.random(len(drafts)) >= self.accuracy
                return [(t + 1) % self.vocab_size if w else t for t, w in zip(drafts, wrong)]
        return []


def greedy_continuations(engine, prompts: list[list[int]], loras: list, num_tokens: int,
                         ) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's first `num_tokens` greedy tokens, run on `engine` without drafts: prompt -> output."""
    from engine.sampling_params import SamplingParams

    proposer, engine.spec.proposer = engine.spec.proposer, ReplayProposer({}, 0, 1.0, engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"ref-{i}", {"prompt_token_ids": prompt}, params, stream=False, lora_request=loras[i])
    outputs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.seqs[0].token_ids
    engine.spec.proposer = proposer
    return {tuple(prompt): list(outputs[f"ref-{i}"]) for i, prompt in enumerate(prompts)}


def periodic_prompts(num: int, length: int, vocab_size: int, seed: int, period: int = 16) -> list[list[int]]:
    """Prompts that repeat a random `period`-token pattern: prompt lookup finds a continuation in each."""
    patterns = synthetic_prompts(num, (period, period), vocab_size, seed)
    return [(pattern * (length // period + 1))[:length] for pattern in patterns]


def engine_runs(args) -> list[dict]:
    """The engines a run compares, as overrides of the flags: with --lora-adapters the base engine, then the LoRA
    engine; with --speculative-config a plain engine, then the speculative one (each of the LoRA runs)."""
    config = getattr(args, "speculative_config", None)
    # Every step of the speculative engine speculates (unless the flags set a batch limit): its steps are what is
    # measured; the engine's own choice to skip drafts where they do not pay is the throughput benchmarks' to see.
    spec_runs = [{"speculative_config": None},
                 {"speculative_config": {"disable_by_batch_size": 1 << 20} | config}] if config else [{}]
    return [lora | spec for lora in lora_runs(args) for spec in spec_runs]


def add_speculation_bounds(rows: list[dict]) -> None:
    """For each case that has a plain row, a `forced` row and a proposer's row (ngram, draft_model), adds to the
    proposer's row: `speedup` (plain ms a token over its ms a token), `verify_step_cost` (a forced step of k drafts,
    its trivial proposal taken out, in plain steps), `step_cost` (that plus the row's own proposer time a step: a
    draft model's passes, the n-gram lookup), `speedup_bound` (the speed-up that cost allows at the row's tokens a
    step: tokens_per_step / step_cost, issue #34's measure) and `of_bound` (speedup / speedup_bound: what the
    bookkeeping and the speculative steps' lost overlap leave of it)."""
    def case(row):
        return row["lora"], row["batch"], row["prompt_len"], row.get("structured")

    plain = {case(r): r for r in rows if not r["speculative"]}
    forced = {case(r): r for r in rows if r.get("drafts") == "forced"}
    for row in rows:
        key = case(row)
        if row.get("drafts") in (None, "forced") or key not in plain or key not in forced:
            continue
        base, verify = plain[key], forced[key]
        speedup = base["decode_ms_per_token"] / row["decode_ms_per_token"]
        verify_ms = verify["ms_per_step"] - verify["propose_ms_per_step"]
        cost = (verify_ms + row["propose_ms_per_step"]) / base["ms_per_step"]
        bound = row["tokens_per_step"] / cost
        row.update(speedup=round(speedup, 3), verify_step_cost=round(verify_ms / base["ms_per_step"], 3),
                   step_cost=round(cost, 3), speedup_bound=round(bound, 3), of_bound=round(speedup / bound, 3))


def fitting_prompt_len(prompt_len: int, batch: int, max_model_len: int, decode_steps: int,
                       max_num_batched_tokens: int) -> int:
    """`prompt_len`, or the longest prompt that leaves room in the context for what each request generates while
    it is measured: its first token, the decode steps, and the steps that it decodes while the batch's last
    prompts are still in (chunked) prefill. (The defaults, 128 and 2048, do not fit a 2048-token model otherwise.)"""
    prefill_steps = -(-batch * max_model_len // max_num_batched_tokens)  # at most, with prompts up to the context
    longest = max_model_len - 1 - decode_steps - prefill_steps
    if longest < 1:
        raise ValueError(f"--decode-steps {decode_steps} at batch {batch} leaves no room for a prompt in this "
                         f"model's {max_model_len}-token context")
    if prompt_len > longest:
        print(f"latency: batch {batch}: {prompt_len}-token prompts and {decode_steps} decode steps do not fit this "
              f"model's {max_model_len}-token context: measured with {longest}-token prompts")
    return min(prompt_len, longest)


def main(args: argparse.Namespace) -> dict:
    if args.lora_adapters > args.max_loras:  # requests that run until aborted: one without a slot would never start
        raise ValueError(f"--lora-adapters {args.lora_adapters} needs --max-loras >= {args.lora_adapters} here (every "
                         f"request of a case runs at once); `pagoda bench throughput` takes more adapters than slots")
    if args.oracle_drafts is not None and not (args.speculative_config and 0.0 <= args.oracle_drafts <= 1.0):
        raise ValueError("--oracle-drafts P takes a probability in [0, 1] and needs --speculative-config")
    model_dir, load_format = model_or_preset(args.model, args.preset, args.load_format)
    args.tokenizer = tokenizer_dir(args.tokenizer) if args.tokenizer else None
    rows, runs = [], []
    for overrides in engine_runs(args):
        run, run_rows = run_engine(args, model_dir, load_format, overrides)
        runs.append(run)
        rows.extend(run_rows)
    add_speculation_bounds(rows)
    print_table(rows, ["lora", "drafts", "batch", "prompt_len", "structured", "decode_ms_per_token", "ms_per_step",
                       "tokens_per_step", "draft_tokens_per_step", "acceptance", "graph_steps", "tokens_per_s",
                       "prefill_s", "min_running", "preemptions", "mask_ms_per_step", "propose_ms_per_step",
                       "speedup", "step_cost", "speedup_bound", "of_bound"])
    result = {"benchmark": "latency", "device": device_name(),
              "model": args.preset or args.model or "smollm2-135m-instruct",
              "kv_cache_dtype": args.kv_cache_dtype, "speculative_config": args.speculative_config,
              **runs[0], "runs": runs, "results": rows}
    write_json(args.output_json, result)
    return result


def run_engine(args, model_dir: str, load_format: str, overrides: dict) -> tuple[dict, list[dict]]:
    """Every case (prompt length x batch size x variant) on one engine: the flags with `overrides`."""
    from cluster.executors import pick_executor
    from engine.arg_utils import engine_args
    from engine.llm_engine import LLMEngine

    config = engine_args(args, model=model_dir, load_format=load_format, enable_prefix_caching=False,
                         **overrides).create_engine_config()
    engine = LLMEngine(config, pick_executor)
    workers = [{k: v for k, v in w.items() if k != "kv_scales"} for w in engine.executor.describe()]
    print("ranks:", "; ".join(f"{w['device']} all-reduce {w['all_reduce']}" for w in workers),
          f"| {engine.executor.num_kv_blocks} KV blocks of {args.block_size} tokens, {workers[0]['kv_cache_dtype']}")
    adapters, label = run_adapters(overrides, args, config.model.hf_config), lora_label(overrides, args)
    spec = config.speculative
    drafts_variants = [spec.method, "forced"] if spec is not None else [None]
    accuracy = getattr(args, "oracle_drafts", None)
    if spec is not None and accuracy is not None:
        drafts_variants.append("oracle")
    rows = []
    budget = engine.config.scheduler.max_num_batched_tokens
    for asked_len in args.prompt_lens:
        for batch in args.batch_sizes:
            steps = max(args.decode_steps, 4) * (1 + (spec.num_speculative_tokens if spec else 0))  # warm-up's too
            prompt_len = fitting_prompt_len(asked_len, batch, engine.max_model_len, steps, budget)
            make = periodic_prompts if args.speculative_config else synthetic_prompts
            prompts = (make(batch, prompt_len, engine.vocab_size, seed=batch + prompt_len) if args.speculative_config
                       else make(batch, (prompt_len, prompt_len), engine.vocab_size, seed=batch + prompt_len))
            loras = spread(adapters, batch)
            for structured in structured_variants(args):
                for drafts in drafts_variants:
                    measure(engine, prompts[:1], 4, structured=structured, loras=loras, drafts=drafts,
                            oracle_accuracy=accuracy)  # warm-up
                    measured = measure(engine, prompts, args.decode_steps, args.profile_steps, structured, loras,
                                       drafts, accuracy)
                    rows.append({"lora": label, "speculative": spec is not None, "batch": batch,
                                 "prompt_len": prompt_len, **measured})
    engine.check_integrity()
    run = {"quantization": config.model.quantization, "lora": label, "speculative": spec is not None,
           "compilation_level": config.compilation.level, "num_kv_blocks": engine.executor.num_kv_blocks,
           "decode_step_ms": None if engine.executor.decode_step_s is None else 1e3 * engine.executor.decode_step_s,
           "run_ahead": None if engine.spec is None else engine.spec.run_ahead.pinned,  # True / False pinned, None auto
           "workers": workers, "startup_s": {k: round(v, 2) for k, v in engine.startup.phases.items()}}
    engine.shutdown()
    del engine
    free_device_memory()
    return run, rows
