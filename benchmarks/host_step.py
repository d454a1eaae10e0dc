"""The engine's host work per step, without a model: how many running requests the driver can keep up with.

An instant executor stands in for the workers (it samples a token for every request whose step reached its end and
takes no time), so every millisecond measured is the driver's own: scheduling, the block manager, the detokenizer
and the outputs. On a GPU the device runs step N while the host prepares step N+1; when the host's time per step
exceeds the GPU's, the host sets the pace (`PAGODA_LOG_STEPS_S` shows it as a device wait near zero).

Modes: `final` (offline `LLM.generate`, or requests that do not stream: one delta at the end), `delta` (a delta
for every request at every step: stream interval 0), `delta+interval` (the serving default: at most one delta per
request every 0.1 s, the stream interval), `delta+25ms` (0.025 s).

`--speculative K` adds n-gram speculation with K drafts (`prompt_lookup_max` 3) over prompts that repeat a 16-token
pattern, which the instant executor continues, accepting each draft that does (all of them): the driver's work for
verify steps, pipelined (each read back before the next is proposed), whose requests take K + 1 tokens a step.

`--executor runner` puts the real `ModelRunner` and sampler (on CPU) behind the engine, around a stand-in model whose
forward costs nothing and whose logits are a fixed random table over the tiny model's vocabulary: the time then adds
the runner's host work (step inputs, sampling rows, penalty state) and the sampler's to the driver's. `--sampling`
picks named settings (benchmarks/common.py: `seed` is temperature 0.7, top_p 0.9, top_k 50, repetition_penalty 1.1).

    .venv/bin/python -m benchmarks.host_step [--num-seqs 256] [--steps 200] [--output-json host.json]
    .venv/bin/python -m benchmarks.host_step --executor runner --num-seqs 256 --sampling greedy seed --modes delta
    .venv/bin/python -m benchmarks.host_step --num-seqs 32 --modes final --speculative 0 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import SAMPLING_SETTINGS, print_table, synthetic_prompts, write_json
from engine.executor import Executor, StepHandle
from engine.outputs import ModelRunnerOutput, SchedulerOutput

MODES = {"final": (False, 0.0), "delta": (True, 0.0), "delta+interval": (True, 0.1),
         "delta+25ms": (True, 0.025)}  # (stream, stream_interval_s)


PATTERN = 16  # the speculative prompts' period (benchmarks/latency.py periodic_prompts)


class InstantExecutor(Executor):
    """Samples token 1000 + (step % 100) for each request whose scheduled tokens reach its end; no model. With
    `speculative`, each request's tokens continue its prompt's first PATTERN tokens, over and over: the drafts that
    do are accepted (scheduled_spec_token_ids), and the token after them sampled."""

    supports_overlap = False

    def __init__(self, num_kv_blocks: int, speculative: bool = False):
        self.num_kv_blocks = num_kv_blocks
        self.speculative = speculative
        self.lengths: dict[str, int] = {}  # request -> tokens it holds (prompt and outputs)
        self.patterns: dict[str, list[int]] = {}
        self.num_steps = 0

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        return StepHandle(self._run(sched))

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        return handle.payload

    def _run(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids + sched.preempted_req_ids:
            self.lengths.pop(req_id, None)
            self.patterns.pop(req_id, None)
        computed = {}
        for new in sched.new_reqs:
            self.lengths[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.patterns[new.req_id] = list(new.prompt_token_ids[:PATTERN])
            computed[new.req_id] = new.num_computed_tokens
        for cached in sched.cached_reqs:
            computed[cached.req_id] = cached.num_computed_tokens
        out = ModelRunnerOutput()
        self.num_steps += 1
        for req_id, num in sched.num_scheduled_tokens.items():
            drafts = sched.scheduled_spec_token_ids.get(req_id, [])
            length = self.lengths[req_id]
            if computed[req_id] + num - len(drafts) < length:
                continue
            if self.speculative:
                pattern = self.patterns[req_id]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == pattern[(length + accepted) % PATTERN]:
                    accepted += 1
                if drafts:
                    out.accepted_draft_ids[req_id] = list(drafts[:accepted])
                token = pattern[(length + accepted) % PATTERN]
                self.lengths[req_id] += accepted
            else:
                token = 1000 + self.num_steps % 100
            out.req_ids.append(req_id)
            out.sampled_token_ids.append(token)
            out.logprobs.append(None)
            self.lengths[req_id] += 1
        return out


class InstantModel:
    """Stands in for a model: no forward, and fixed random logits (a different row for each sequence)."""

    def __init__(self, vocab_size: int, max_num_seqs: int):
        self.table = torch.randn(max_num_seqs, vocab_size, generator=torch.Generator().manual_seed(0))

    def __call__(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table[:hidden.shape[0]].clone()


class RunnerExecutor(Executor):
    """The real ModelRunner (persistent batch, step inputs, sampler) around an InstantModel, on CPU."""

    supports_overlap = True

    def __init__(self, num_kv_blocks: int, config):
        from workers.model_runner import ModelRunner

        torch.set_num_threads(1)  # a GPU host runs no torch math; on 2 shared cores more threads only contend
        self.num_kv_blocks = num_kv_blocks
        model = InstantModel(config.model.vocab_size, config.scheduler.max_num_seqs)
        self.runner = ModelRunner(model, [], config.cache.block_size, torch.device("cpu"), config.scheduler)

    def launch(self, sched: SchedulerOutput) -> StepHandle:
        return StepHandle(self.runner.execute_model_async(sched))

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        return handle.payload.result()


def measure(mode: str, num_seqs: int, steps: int, prompt_len: int, executor: str = "instant",
            sampling: str = "greedy", speculative: int = 0) -> dict:
    from benchmarks.latency import periodic_prompts
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    tokens = (steps + 8) * (speculative + 1)
    blocks_per_seq = -(-(prompt_len + tokens + 16) // 16)
    num_blocks = num_seqs * blocks_per_seq + 16
    stream, interval_s = MODES[mode]
    spec = ({"method": "ngram", "num_speculative_tokens": speculative, "prompt_lookup_max": 3,
             "disable_by_batch_size": num_seqs} if speculative else None)  # (speculation on for the whole batch)
    config = EngineArgs(model="tiny", device="cpu", num_kv_blocks=num_blocks, max_num_seqs=num_seqs,
                        max_num_batched_tokens=max(8192, num_seqs * (speculative + 1)), stream_interval_s=interval_s,
                        speculative_config=spec).create_engine_config()
    if speculative and executor != "instant":
        raise ValueError("--speculative runs on the instant executor only")
    started = (InstantExecutor(num_blocks, speculative > 0) if executor == "instant"
               else RunnerExecutor(num_blocks, config))
    engine = LLMEngine(config, lambda _config: lambda _config: started)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, **SAMPLING_SETTINGS[sampling])
    vocab = config.model.vocab_size
    prompts = (periodic_prompts(num_seqs, prompt_len, vocab, 0, PATTERN) if speculative
               else synthetic_prompts(num_seqs, (prompt_len, prompt_len), vocab, 0))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, stream=stream)
    while engine.scheduler.num_waiting or any(not g.seqs[0].output_token_ids for g in engine.groups.values()):
        engine.step()  # prefill
    times = []
    generated = _output_tokens(engine)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    elapsed = sum(times)
    per_step = (_output_tokens(engine) - generated) / steps / num_seqs
    engine.shutdown()
    return {"mode": mode, "num_seqs": num_seqs, "executor": executor, "sampling": sampling,
            "speculative": speculative, "tokens_per_step": per_step,
            "host_ms_per_step": 1e3 * elapsed / steps, "host_ms_per_step_p50": 1e3 * statistics.median(times),
            "us_per_request_step": 1e6 * elapsed / steps / num_seqs,
            "us_per_token": 1e6 * elapsed / steps / num_seqs / max(per_step, 1e-9)}


def _output_tokens(engine) -> int:
    return sum(len(g.seqs[0].output_token_ids) for g in engine.groups.values())


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--executor", choices=["instant", "runner"], default="instant",
                        help="runner: the real ModelRunner and sampler on CPU around a stand-in model")
    parser.add_argument("--sampling", nargs="+", choices=list(SAMPLING_SETTINGS), default=["greedy"])
    parser.add_argument("--speculative", type=int, nargs="+", default=[0],
                        help="n-gram drafts a step (0: none), each accepted: the driver's work for verify steps")
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> dict:
    rows = [measure(mode, n, args.steps, args.prompt_len, args.executor, sampling, k)
            for n in args.num_seqs for sampling in args.sampling for mode in args.modes for k in args.speculative]
    print_table(rows, ["mode", "num_seqs", "executor", "sampling", "speculative", "tokens_per_step",
                       "host_ms_per_step", "host_ms_per_step_p50", "us_per_request_step", "us_per_token"])
    result = {"benchmark": "host_step", "steps": args.steps, "prompt_len": args.prompt_len, "results": rows}
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    main(parser.parse_args())
