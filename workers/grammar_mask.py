"""The model runner's side of structured outputs: the driver's packed bitmask onto a step's logits, before sampling.

Only rows with a constraint are touched (kernels/token_bitmask.py); a batch without one costs nothing. The masked
logits are what the sampler and the returned logprobs see, as in vLLM.
"""

from __future__ import annotations

import torch

from engine.outputs import GrammarBitmask
from kernels.token_bitmask import apply_token_bitmask_
from workers.inputs import to_device


def constrained_req_ids(states) -> list[str]:
    """The requests among a step's sampling states that follow a constraint."""
    return [s.req_id for s in states if s.params.structured_outputs is not None]


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: GrammarBitmask, req_ids: list[str],
                          positions: list[int] | None = None) -> None:
    """logits: [N, V], row i sampling for req_ids[i] (at its draft position positions[i]: the mask after that many
    of its drafts; default 0). Every constrained request among req_ids must have a bitmask row; bitmask rows that
    sample nowhere in this step (a prompt chunk still to come) are skipped."""
    row_of = {(req_id, j): i for i, (req_id, j) in enumerate(zip(req_ids, positions or [0] * len(req_ids)))}
    keys = _bitmask_keys(bitmask.req_ids)
    keep = [i for i, key in enumerate(keys) if key in row_of]
    if not keep:
        return
    host = bitmask.bitmask if len(keep) == len(bitmask.req_ids) else bitmask.bitmask[keep]
    rows = [row_of[keys[i]] for i in keep]
    apply_token_bitmask_(logits, _copy_beside(host, logits.device), to_device(rows, torch.int32, logits.device))


def _bitmask_keys(req_ids: list[str]) -> list[tuple[str, int]]:
    """(request, position) of each bitmask row: a request's consecutive rows are its positions 0, 1, ..."""
    keys: list[tuple[str, int]] = []
    for i, req_id in enumerate(req_ids):
        keys.append((req_id, keys[-1][1] + 1 if i and req_ids[i - 1] == req_id else 0))
    return keys


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_beside(array, device: torch.device) -> torch.Tensor:
    """The bitmask on the device, copied on a stream of its own: on the step's stream the copy (up to 4 MB at 256
    rows) would wait for the forward and then delay the sampling; beside it, it runs during the forward."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host
    host = host.pin_memory()  # kept alive by the caching host allocator until the copy has read it
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        on_device = host.to(device, non_blocking=True)
    current = torch.cuda.current_stream(device)
    current.wait_stream(stream)
    on_device.record_stream(current)  # the allocator may not reuse it before the step's stream is done with it
    return on_device


def warm_up_grammar_mask(vocab_size: int, device: torch.device) -> None:
    """Compiles the mask kernel now, not in the first constrained step: for a bitmask width that Triton specializes
    as a multiple of 16 and for one it does not (the width is the tokenizer's, unknown here)."""
    logits = torch.zeros(1, vocab_size, device=device)
    rows = torch.zeros(1, dtype=torch.int32, device=device)
    for num_words in {max(16 * (-(-vocab_size // 512)), 16), -(-vocab_size // 32) | 1}:
        apply_token_bitmask_(logits, torch.full((1, num_words), -1, dtype=torch.int32, device=device), rows)
