"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the tokens before it, and
the top-k alternatives, from the hidden states the prefill computes anyway.

    prompt (P = 5)   t0  t1  t2  t3  t4
    hidden           h0  h1  h2  h3  h4        h_p scores t_{p+1}; h4 samples the first output token
    scored           -   t1  t2  t3  t4        t0 has no score (None in RequestOutput.prompt_logprobs)

A step that computes positions [start, start + count) of a request scores prompt tokens start + 1 ..
min(start + count, P - 1), so chunked prefill yields them chunk by chunk. The logits are computed a bounded number
of rows at a time: a long prompt over a large vocabulary never needs a [P, V] float32 tensor at once.

Prefix caching: a request that asks for prompt logprobs takes no prefix-cache hit (the scheduler skips the lookup,
as vLLM does), since a hit would skip the positions that score its prompt; the blocks it computes still enter the
cache for the requests after it. A preempted one recomputes its prompt and rewrites the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import PromptLogprobs
from workers.inputs import to_device

_MAX_LOGIT_ELEMENTS = 1 << 25  # rows of logits per chunk: 128 MiB of float32


@dataclass
class PromptLogprobsRequest:
    req_id: str
    flat_start: int  # first row of the step's hidden states that scores a prompt token
    first_token: int  # index in the prompt of the first token scored
    num_tokens: int
    top_k: int


def plan_prompt_logprobs(states, starts: list[int], counts: list[int]) -> list[PromptLogprobsRequest]:
    """The requests of a step that asked for prompt logprobs and compute prompt positions that score a token."""
    plan, offset = [], 0
    for state, start, count in zip(states, starts, counts):
        k = state.params.prompt_logprobs
        end = min(start + count, len(state.prompt_token_ids) - 1)  # the last position scores no prompt token
        if k is not None and end > start:
            plan.append(PromptLogprobsRequest(state.req_id, offset, start + 1, end - start, k))
        offset += count
    return plan


class PromptLogprobsBatch:
    """A step's prompt logprobs on the device; `start_copy` queues their copy to the host behind the step (as the
    sampled tokens' copy is), `outputs()` waits for it and cuts the per-request chunks."""

    def __init__(self, plan: list[PromptLogprobsRequest], token_logprobs: torch.Tensor, top_logprobs: torch.Tensor,
                 top_ids: torch.Tensor):
        self.plan = plan
        self.tensors = (token_logprobs, top_logprobs, top_ids)  # [N], [N, K], [N, K]
        self.event = None

    def start_copy(self) -> PromptLogprobsBatch:
        if self.tensors[0].device.type == "cuda":
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self.tensors)
            for dst, src in zip(host, self.tensors):
                dst.copy_(src, non_blocking=True)
            self.tensors, self.event = host, torch.cuda.Event()
            self.event.record()
        return self

    def outputs(self) -> dict[str, PromptLogprobs]:
        if self.event is not None:
            self.event.synchronize()
        token_logprobs, top_logprobs, top_ids = (t.tolist() for t in self.tensors)
        out, row = {}, 0
        for req in self.plan:
            rows = slice(row, row + req.num_tokens)
            out[req.req_id] = PromptLogprobs(req.first_token, token_logprobs[rows],
                                             [ids[:req.top_k] for ids in top_ids[rows]],
                                             [values[:req.top_k] for values in top_logprobs[rows]])
            row += req.num_tokens
        return out


def compute_prompt_logprobs(model, hidden: torch.Tensor, states, starts: list[int], counts: list[int],
                            is_driver: bool) -> PromptLogprobsBatch | None:
    """hidden: [T, hidden] of the step (flat). Every tensor-parallel rank calls this (the logits are gathered to rank
    0); it returns the batch on the driver, None elsewhere or when no request of the step asked."""
    plan = plan_prompt_logprobs(states, starts, counts)
    if not plan:
        return None
    by_id = {state.req_id: state for state in states}
    rows = [r for req in plan for r in range(req.flat_start, req.flat_start + req.num_tokens)]
    targets = [t for req in plan for t in by_id[req.req_id].prompt_token_ids[
        req.first_token:req.first_token + req.num_tokens]]
    rows_t, targets_t = to_device(rows, torch.long, hidden.device), to_device(targets, torch.long, hidden.device)
    max_k = max(req.top_k for req in plan)
    chunk = max(1, _MAX_LOGIT_ELEMENTS // model.vocab_size)
    parts = []
    for i in range(0, len(rows), chunk):
        logits = model.compute_logits(hidden.index_select(0, rows_t[i:i + chunk]))  # [n, V] float32, rank 0
        if logits is None:
            continue
        logprobs = torch.log_softmax(logits, dim=-1)
        top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (logprobs[:, :0], logprobs[:, :0].long())
        parts.append((logprobs.gather(-1, targets_t[i:i + chunk, None]).squeeze(-1), top_values, top_ids))
    if not is_driver:
        return None
    return PromptLogprobsBatch(plan, *(torch.cat(p) for p in zip(*parts))).start_copy()
