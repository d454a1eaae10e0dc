"""The engine's host work per step, without a model: how many running requests the driver can keep up with.

An instant executor stands in for the workers (it samples a token for every request whose step reached its end and
takes no time), so every millisecond measured is the driver's own: scheduling, the block manager, the detokenizer
and the outputs. On a GPU the device runs step N while the host prepares step N+1; when the host's time per step
exceeds the GPU's, the host sets the pace (`PAGODA_LOG_STEPS_S` shows it as a device wait near zero).

Modes: `final` (offline `LLM.generate`: outputs only at the end), `cumulative` (an in-process server: every request's
whole output at every step), `delta` (the engine actor: what is new), `delta+interval` (the engine actor with a
0.1 s stream interval: outputs at most every 25 ms).

    .venv/bin/python -m benchmarks.host_step [--num-seqs 256] [--steps 200] [--output-json host.json]
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import print_table, synthetic_prompts, write_json
from engine.executor import Executor
from engine.outputs import ModelRunnerOutput, SchedulerOutput

MODES = {"final": (False, False, 0.0), "cumulative": (True, False, 0.0), "delta": (True, True, 0.0),
         "delta+interval": (True, True, 0.025)}  # (stream_outputs, delta_outputs, output_interval_s)


class InstantExecutor(Executor):
    """Samples token 1000 + (step % 100) for each request whose scheduled tokens reach its end; no model."""

    supports_overlap = False

    def __init__(self, num_kv_blocks: int):
        self.num_kv_blocks = num_kv_blocks
        self.lengths: dict[str, int] = {}  # request -> tokens it holds (prompt and outputs)
        self.num_steps = 0

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in sched.finished_req_ids + sched.preempted_req_ids:
            self.lengths.pop(req_id, None)
        computed = {}
        for new in sched.new_reqs:
            self.lengths[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        for cached in sched.cached_reqs:
            computed[cached.req_id] = cached.num_computed_tokens
        out = ModelRunnerOutput()
        self.num_steps += 1
        for req_id, num in sched.num_scheduled_tokens.items():
            if computed[req_id] + num >= self.lengths[req_id]:
                out.req_ids.append(req_id)
                out.sampled_token_ids.append(1000 + self.num_steps % 100)
                out.logprobs.append(None)
                self.lengths[req_id] += 1
        return out


def measure(mode: str, num_seqs: int, steps: int, prompt_len: int) -> dict:
    from engine.llm_engine import LLMEngine, build_engine_config
    from engine.sampling_params import SamplingParams

    blocks_per_seq = -(-(prompt_len + steps + 16) // 16)
    config = build_engine_config(model="tiny", device="cpu", num_kv_blocks=num_seqs * blocks_per_seq + 16,
                                 max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs))
    engine = LLMEngine(config, executor=InstantExecutor(num_seqs * blocks_per_seq + 16))
    engine.stream_outputs, engine.delta_outputs, engine.output_interval_s = MODES[mode]
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(synthetic_prompts(num_seqs, (prompt_len, prompt_len), config.model.vocab_size, 0)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while engine.scheduler.num_waiting or any(not g.seqs[0].output_token_ids for g in engine.groups.values()):
        engine.step()  # prefill
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return {"mode": mode, "num_seqs": num_seqs, "host_ms_per_step": 1e3 * elapsed / steps,
            "us_per_request_step": 1e6 * elapsed / steps / num_seqs}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--output-json", default=None)


def main(args: argparse.Namespace) -> dict:
    rows = [measure(mode, n, args.steps, args.prompt_len) for n in args.num_seqs for mode in args.modes]
    print_table(rows, ["mode", "num_seqs", "host_ms_per_step", "us_per_request_step"])
    result = {"benchmark": "host_step", "steps": args.steps, "prompt_len": args.prompt_len, "results": rows}
    write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    main(parser.parse_args())
