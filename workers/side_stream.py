"""Two pieces of a step that read the same input and not each other's output, side by side in a CUDA graph.

While a decode CUDA graph is captured (workers/cuda_graphs.py), `beside(side, main)` launches side() on a second
stream of the device (forked from the main stream, joined back after main()), so the graph holds side()'s kernels
as a branch beside main()'s and the replayed step waits for the longer of the two, not their sum:

    main stream   ──norm──┬── main(): the layer's matmul / the routed experts ──┬── (join) expand / add ──
    side stream           └── side(): LoRA's shrink / the shared experts ───────┘

Users: an adapted linear's LoRA shrink beside its matmul (workers/lora.py), the shared experts beside the routed
ones (workers/models/moe.py, deepseek_v2.py). Eager steps, CPU tensors and compiled layers run side() then main()
on one stream: outside a graph the streams' host calls (an event record and wait each way, a stream switch) cost
more than they hide. OVERLAP = False turns the side stream off everywhere (A/B runs, tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OVERLAP = True
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def beside(side: Callable[[], torch.Tensor], main: Callable[[], torch.Tensor],
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(side(), main()): side() on the side stream while main() runs, during a CUDA graph's capture; else in turn.
    side() must return one tensor, and neither may read what the other writes, scratch included: two split-K
    kernels side by side must count in different owners' arrival counts (kernels/_triton.py `split_counts`: the
    LoRA shrink has its own; the routed experts' kernels count in none, so the shared experts' linears may)."""
    if not (OVERLAP and device.type == "cuda" and not torch.compiler.is_compiling()
            and torch.cuda.is_current_stream_capturing()):
        return side(), main()
    main_stream, side_stream = torch.cuda.current_stream(device), _side_stream(device)
    side_stream.wait_stream(main_stream)  # the input is ready
    with torch.cuda.stream(side_stream):
        side_out = side()
    main_out = main()
    main_stream.wait_stream(side_stream)
    side_out.record_stream(main_stream)  # allocated on the side stream, read and freed on the main one
    return side_out, main_out
