"""The torch operations the host issues a step for speculative decoding, by the runner's function, on CPU: what a GPU
pays as kernel launches, each some microseconds of the host's step (a host-bound step, a small model on a large
GPU, pays all of them). Counted with a TorchDispatchMode over an offline run of the tiny model with the n-gram
proposer (prompts that repeat, so rows find drafts at first), views and allocations left out, the model's own
forward apart. Each way's steps are its own: a step launched ahead is a verify step for every row with room for
drafts (the device lookup fills what it finds), a pipelined one only for the rows whose lookup found some.

    ahead      steps launched before the verify step in flight is read back (PAGODA_SPEC_RUN_AHEAD=1): the lookup,
               the inputs' fix-up and the histories' append on the device
    pipelined  the driver's lookup, each verify step read back before the next (PAGODA_SPEC_RUN_AHEAD=0)

`--kernels` runs the ahead path's Triton kernels (kernels/ngram.py, kernels/run_ahead.py) as a GPU would, under
Triton's interpreter, counting each launch as one operation; without it the torch references run, as on any CPU.

    .venv/bin/python -m benchmarks.host_ops [--kernels] [--batch-size 8] [--output-json ops.json]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

KERNELS = "--kernels" in sys.argv
if KERNELS:  # (read when triton is imported)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import print_table, write_json  # noqa: E402

RUNNER_FUNCTIONS = ["_forward", "_propose_on_device", "_shifted_keys", "_verified_drafts", "_append_history",
                    "_sample_verify", "_verify", "update_states", "lookup"]
LAUNCHERS = [("kernels.ngram", "ngram_lookup_triton"), ("kernels.run_ahead", "fix_up_inputs_triton"),
             ("kernels.run_ahead", "append_tokens_triton")]


class OpCounter(TorchDispatchMode):
    """Counts the non-view operations by the innermost function of `stack` that issued them."""

    def __init__(self):
        super().__init__()
        self.stack = ["engine"]
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stack[-1] is not None and not func.is_view and func.overloadpacket.__name__ not in (
                "detach", "lift_fresh", "empty", "empty_strided"):  # (allocations launch nothing)
            self.counts[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, owner, name: str, label: str | None = None, one_launch: bool = False) -> None:
        """Attributes `owner.name`'s operations to `label`; one_launch: counts a call as one (a Triton launcher,
        whose interpreter's own operations are not the GPU's)."""
        fn = getattr(owner, name)

        def counted(*args, **kwargs):
            if one_launch:
                self.counts[self.stack[-1]] += 1
            self.stack.append(None if one_launch else label or name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()

        setattr(owner, name, counted)


def count(ahead: bool, batch_size: int, max_tokens: int) -> dict:
    os.environ["PAGODA_SPEC_RUN_AHEAD"] = "1" if ahead else "0"
    from pagoda import LLM, SamplingParams

    llm = LLM(model="tiny", device="cpu", num_kv_blocks=512, block_size=4, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                  "disable_by_batch_size": 4096})
    counter = OpCounter()
    runner = llm.engine.executor.worker.runner
    for name in RUNNER_FUNCTIONS:
        counter.wrap(runner, name)
    counter.wrap(runner.history, "append", "history.append")
    counter.wrap(runner.buffers, "copy_to_device", "buffers.copy_to_device")
    model_forward = runner.model.forward
    runner.model.forward = lambda *a, **k: _labelled(counter, "model", model_forward, *a, **k)
    fix_up = runner._fix_up
    runner._fix_up = lambda *a, **k: (lambda f: lambda: _labelled(counter, "fix_up", f))(fix_up(*a, **k))
    if KERNELS:
        import importlib

        for module, name in LAUNCHERS:
            mod = importlib.import_module(module)
            mod.use_triton = lambda t: True  # (CPU tensors: the interpreter)
            counter.wrap(mod, name, one_launch=True)
    prompts = [[5, 6, 7, 8, 9, 10] * 4 + [5, 6, 100 + i] for i in range(batch_size)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # (first-call work apart)
    engine, stats = llm.engine, llm.engine.scheduler.spec_stats
    before = (engine.timing.num_steps, engine.spec.num_steps_ahead, stats.num_draft_tokens, stats.num_accepted_tokens)
    counter.counts.clear()  # (the launchers' wrappers count outside the mode too)
    with counter:
        llm.generate(prompts, params, use_tqdm=False)
    steps, ahead_steps, drafts, accepted = (now - then for now, then in zip(
        (engine.timing.num_steps, engine.spec.num_steps_ahead, stats.num_draft_tokens, stats.num_accepted_tokens),
        before))
    llm.shutdown()
    by_function = {k: round(v / steps, 1) for k, v in counter.counts.most_common()}
    return {"way": "ahead" if ahead else "pipelined", "steps": steps, "steps_ahead": ahead_steps,
            "draft_tokens": drafts, "accepted": accepted,
            "host_ops_per_step": round(sum(v for k, v in counter.counts.items() if k != "model") / steps, 1),
            "by_function": by_function}


def _labelled(counter: OpCounter, label: str, fn, *args, **kwargs):
    counter.stack.append(label)
    try:
        return fn(*args, **kwargs)
    finally:
        counter.stack.pop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", action="store_true", help="the ahead path's Triton kernels (interpreted)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [count(ahead, args.batch_size, args.max_tokens) for ahead in (True, False)]
    print_table(rows, ["way", "steps", "steps_ahead", "draft_tokens", "accepted", "host_ops_per_step"])
    for row in rows:
        print(row["way"], {k: v for k, v in row["by_function"].items() if k != "model"})
    write_json(args.output_json, {"kernels": KERNELS, "batch_size": args.batch_size, "rows": rows})


if __name__ == "__main__":
    main()
