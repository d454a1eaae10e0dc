"""Where a step's time goes: kernels by kind, GPU idle gaps, and the host's own time, from torch.profiler.

    pagoda bench latency --preset llama-3-8b --batch-sizes 1 --prompt-lens 128 --profile-steps 16

The profile covers `engine.step()` calls in a steady decode (CUDA-graph replays included: CUPTI reports the
kernels inside graphs). Per step it reports the wall time, the GPU busy time (the union of kernel intervals),
the idle gaps between kernels, and each kind of kernel's time and count.
"""

from __future__ import annotations

import re
import time

KINDS = [  # (kind, regex on the kernel name), first match wins
    ("lora", r"_lora_"),
    ("int_linear", r"_int_(decode|linear|dequantize)|moe_int"),  # before attention: "_int_decode_kernel"
    ("fp8_linear", r"_fp8_linear"),
    ("fp8_quantize", r"quantize_per_token"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitKreduce"),
    ("attention", r"_decode_kernel|_decode_merge|_prefill_kernel|flash|attention"),
    ("rms_norm", r"rms_norm"),
    ("rotary+kv", r"rotary|kv_cache|write_kv"),
    ("silu_and_mul", r"silu"),
    ("all_reduce", r"nccl|all_reduce|allreduce|one_shot|two_shot"),
    ("sampling", r"argmax|topk|sort|softmax|exponential|multinomial|cumsum|scatter|gather|max_|reduce"),
    ("copy", r"memcpy|memset|copy|cat"),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def profile_steps(engine, num_steps: int) -> dict:
    """Runs `num_steps` engine steps under torch.profiler; returns per-step figures (milliseconds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    return summarize(prof, wall_ms, num_steps)


class StepWindow:
    """Profiles steps `after` .. `after + num_steps` of whatever calls `engine.step()` meanwhile (LLM.generate in the
    throughput benchmark). CUDA kernels only: CPU op events would slow the host, whose pace is part of what a step
    shows (on a CPU there are no kernels, and the figures are the wall time and the tokens). `result` then holds
    `summarize`'s figures and the tokens a step."""

    def __init__(self, engine, after: int, num_steps: int):
        self.engine, self.after, self.num_steps = engine, after, num_steps
        self.count, self.prof, self.start, self.result = 0, None, 0.0, None
        self._step = engine.step
        engine.step = self._wrapped

    def close(self) -> None:
        if self.prof is not None:  # the run ended inside the window
            self.prof.__exit__(None, None, None)
        del self.engine.step  # the class's method again

    def _wrapped(self):
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        self.count += 1
        if self.count == self.after + 1:
            if cuda:
                torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
            self.prof.__enter__()
            self.start, self.tokens_at = time.perf_counter(), len(self.engine.step_tokens)
        out = self._step()
        if self.count == self.after + self.num_steps and self.prof is not None:
            if cuda:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - self.start) * 1e3
            self.prof.__exit__(None, None, None)
            self.result = summarize(self.prof, wall_ms, self.num_steps) | {
                "after_steps": self.after, "tokens_per_step": sum(self.engine.step_tokens[self.tokens_at:])
                / self.num_steps}
            self.prof = None
        return out


def summarize(prof, wall_ms: float, num_steps: int) -> dict:
    """Per-step figures (milliseconds) of a finished torch.profiler run over `num_steps` steps that took wall_ms."""
    from torch.autograd import DeviceType

    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == DeviceType.CUDA), key=lambda k: k[0])
    by_kind: dict[str, list[float]] = {}
    busy_us, cursor = 0.0, float("-inf")
    for start_us, end_us, name in kernels:
        entry = by_kind.setdefault(kind_of(name), [0.0, 0])
        entry[0] += end_us - start_us
        entry[1] += 1
        busy_us += max(0.0, end_us - max(start_us, cursor))  # union of intervals (streams may overlap)
        cursor = max(cursor, end_us)
    span_us = kernels[-1][1] - kernels[0][0] if kernels else 0.0
    ends = [end for _, end, _ in kernels]
    for i in range(1, len(ends)):
        ends[i] = max(ends[i], ends[i - 1])
    gaps = [start - end for (start, _, _), end in zip(kernels[1:], ends)]
    per_step = {
        "wall_ms": wall_ms / num_steps,
        "gpu_span_ms": span_us / 1e3 / num_steps,
        "gpu_busy_ms": busy_us / 1e3 / num_steps,
        "gpu_idle_ms": (span_us - busy_us) / 1e3 / num_steps,
        "gpu_idle_long_ms": sum(g for g in gaps if g > 100) / 1e3 / num_steps,  # gaps over 100 us
        "kernels": len(kernels) / num_steps,
        "by_kind": {kind: {"ms": us / 1e3 / num_steps, "count": count / num_steps}
                    for kind, (us, count) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])},
    }
    return per_step


def print_profile(label: str, p: dict) -> None:
    print(f"profile {label}: wall {p['wall_ms']:.3f} ms/step, GPU busy {p['gpu_busy_ms']:.3f}, "
          f"idle gaps {p['gpu_idle_ms']:.3f} ({p['gpu_idle_long_ms']:.3f} in gaps over 100 us), "
          f"{p['kernels']:.0f} kernels/step" + (f", {p['tokens_per_step']:.0f} tokens/step" if "tokens_per_step" in p
                                                else ""))
    for kind, v in p["by_kind"].items():
        each_us = 1e3 * v["ms"] / max(v["count"], 1)
        print(f"    {kind:<14} {v['ms']:8.3f} ms  {v['count']:6.0f} kernels  {each_us:7.1f} us each")
