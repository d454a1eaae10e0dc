"""workers/side_stream.py off a CUDA graph's capture (CPU here; the GPU branches: tests/gpu/test_side_stream_gpu.py):
both pieces run, side first, and their results come back in that order."""

import torch

from workers.side_stream import beside


def test_beside_runs_side_then_main_in_turn_outside_a_capture():
    calls = []
    side_out, main_out = beside(lambda: calls.append("side") or torch.ones(2), lambda: calls.append("main") or
                                torch.zeros(3), torch.device("cpu"))
    assert calls == ["side", "main"]
    assert torch.equal(side_out, torch.ones(2)) and torch.equal(main_out, torch.zeros(3))
