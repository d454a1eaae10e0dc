"""OpenAI response bodies and SSE chunks, built from the engine's deltas (cluster/ingress.py runs the requests).

    non-streaming: each prompt's final delta (its whole output) ──► one JSON body
    streaming:     every delta as it comes ──► one chunk per sequence delta (choices: [one])

A choice's index is prompt index * n + sequence index. An echoed prompt with logprobs carries the prompt's own
logprobs (the first token's None), as OpenAI's legacy completions and vLLM answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cluster.protocol import (Accepted, ChatCompletionRequest, CompletionRequest, chat_logprobs, completion_logprobs,
                              prompt_logprobs_json, usage)
from engine.request_output import RequestDelta, SequenceDelta, TokenLogprob


@dataclass
class Outputs:
    """A non-streaming run's results: each choice's whole output, and each prompt's prompt logprobs."""

    choices: dict[int, SequenceDelta] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)

    def add(self, prompt: int, n: int, delta: RequestDelta) -> None:
        for seq in delta.seqs:
            self.choices[prompt * n + seq.index] = seq
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = delta.prompt_logprobs

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())


def completion_body(meta: dict, req: CompletionRequest, accepted: list[Accepted], n: int, out: Outputs) -> dict:
    choices = []
    for i, c in sorted(out.choices.items()):
        prompt = accepted[i // n]
        echoed = prompt.prompt_text or ""
        logprobs = None
        if c.logprobs is not None:
            entries = (out.prompt_logprobs.get(i // n, []) if req.echo else []) + c.logprobs
            logprobs = completion_logprobs(entries, 0 if req.echo else len(echoed))
        choice = {"index": i, "text": echoed + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs.get(i // n, []))
        choices.append(choice)
    prompt_tokens = sum(a.num_prompt_tokens for a in accepted)
    return {**meta, "choices": choices, "usage": usage(prompt_tokens, out.completion_tokens)}


async def completion_chunks(meta: dict, req: CompletionRequest, accepted: list[Accepted], n: int,
                            deltas: AsyncIterator[tuple[int, RequestDelta]]) -> AsyncIterator[dict]:
    """The echoed prompt goes first: at once, or, when its logprobs are asked for, with the first delta (which
    brings them)."""
    no_usage = {"usage": None} if req.include_usage else {}
    offsets: dict[int, int] = {}
    waiting_echo = set()
    for p, a in enumerate(accepted):
        for j in range(n):
            offsets[p * n + j] = len(a.prompt_text or "")
            if a.prompt_text and req.logprobs is not None:
                waiting_echo.add(p)
            elif a.prompt_text:
                yield _chunk(meta, {"index": p * n + j, "text": a.prompt_text, "logprobs": None,
                                    "finish_reason": None}, no_usage)
    completion_tokens = 0
    async for p, delta in deltas:
        if p in waiting_echo:
            waiting_echo.discard(p)
            entries = delta.prompt_logprobs or []
            for j in range(n):
                yield _chunk(meta, {"index": p * n + j, "text": accepted[p].prompt_text,
                                    "logprobs": completion_logprobs(entries, 0), "finish_reason": None}, no_usage)
        for seq in delta.seqs:
            index = p * n + seq.index
            completion_tokens += len(seq.token_ids)
            logprobs = completion_logprobs(seq.logprobs, offsets[index]) if seq.logprobs is not None else None
            offsets[index] += len(seq.text)
            choice = {"index": index, "text": seq.text, "logprobs": logprobs, "finish_reason": seq.finish_reason,
                      "stop_reason": seq.stop_reason}
            if req.prompt_logprobs is not None and delta.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(delta.prompt_logprobs)
            yield _chunk(meta, choice, no_usage)
    if req.include_usage:
        prompt_tokens = sum(a.num_prompt_tokens for a in accepted)
        yield {**meta, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def chat_body(meta: dict, req: ChatCompletionRequest, accepted: list[Accepted], out: Outputs) -> dict:
    body = {**meta, "choices": [
        {"index": i, "message": {"role": "assistant", "content": c.text},
         "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for i, c in sorted(out.choices.items())],
        "usage": usage(accepted[0].num_prompt_tokens, out.completion_tokens)}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs.get(0, []))
    return body


async def chat_chunks(meta: dict, req: ChatCompletionRequest, accepted: list[Accepted], n: int,
                      deltas: AsyncIterator[tuple[int, RequestDelta]]) -> AsyncIterator[dict]:
    no_usage = {"usage": None} if req.include_usage else {}
    for j in range(n):
        yield _chunk(meta, {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}, no_usage)
    completion_tokens = 0
    async for _, delta in deltas:
        for seq in delta.seqs:
            completion_tokens += len(seq.token_ids)
            yield _chunk(meta, {"index": seq.index, "delta": {"content": seq.text} if seq.text else {},
                                "logprobs": chat_logprobs(seq.logprobs) if seq.logprobs else None,
                                "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}, no_usage)
    if req.include_usage:
        yield {**meta, "choices": [], "usage": usage(accepted[0].num_prompt_tokens, completion_tokens)}


def _chunk(meta: dict, choice: dict, no_usage: dict) -> dict:
    return {**meta, "choices": [choice], **no_usage}
