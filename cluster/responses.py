"""OpenAI response bodies and SSE chunks, built from the engine's deltas (cluster/ingress.py runs the requests).

    non-streaming: each prompt's final delta (its whole output) ──► one JSON body
    streaming:     every delta as it comes ──► one chunk per sequence delta (choices: [one])

A choice's index is prompt index * n + sequence index. An echoed prompt with logprobs carries the prompt's own
logprobs (the first token's None), as OpenAI's legacy completions and vLLM answer. A chat with tools reads each
choice's text with a tool parser (cluster/tool_parsers.py): `message.tool_calls` whole, `delta.tool_calls` streamed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cluster.protocol import Accepted, ChatCompletionRequest, CompletionRequest
from cluster.tool_parsers import NamedToolParser, ToolCall, ToolCallDelta, ToolCallsDelta, ToolParser
from engine.request_output import RequestDelta, SequenceDelta, TokenLogprob

MIN_LOGPROB = -9999.0  # what a masked token's -inf logprob reads as (vLLM's value)


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
                  "stop_reason": c.stop_reason, "prompt_logprobs": None}  # null unless asked for, as vLLM's
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs.get(i // n, []))
        choices.append(choice | _token_ids(req, prompt.prompt_token_ids, c.token_ids))
    prompt_tokens = sum(a.num_prompt_tokens for a in accepted)
    return {**meta, "choices": choices, "usage": usage(prompt_tokens, out.completion_tokens)}


async def completion_chunks(meta: dict, req: CompletionRequest, accepted: list[Accepted], n: int,
                            deltas: AsyncIterator[tuple[int, RequestDelta]]) -> AsyncIterator[dict]:
    """The echoed prompt goes first: at once, or, when its logprobs are asked for, with the first delta (which
    brings them)."""
    prompt_tokens = sum(a.num_prompt_tokens for a in accepted)
    usage_so_far = _chunk_usage(req, prompt_tokens)
    offsets: dict[int, int] = {}
    waiting_echo = set()
    first: set[int] = set()  # choices whose first chunk went out (with the prompt's token ids, when asked)
    for p, a in enumerate(accepted):
        for j in range(n):
            offsets[p * n + j] = len(a.prompt_text or "")
            if a.prompt_text and req.logprobs is not None:
                waiting_echo.add(p)
            elif a.prompt_text:
                first.add(p * n + j)
                yield _chunk(meta, {"index": p * n + j, "text": a.prompt_text, "logprobs": None,
                                    "finish_reason": None, **_token_ids(req, a.prompt_token_ids, [])}, usage_so_far(0))
    completion_tokens = 0
    async for p, delta in deltas:
        if p in waiting_echo:
            waiting_echo.discard(p)
            entries = delta.prompt_logprobs or []
            for j in range(n):
                first.add(p * n + j)
                yield _chunk(meta, {"index": p * n + j, "text": accepted[p].prompt_text,
                                    "logprobs": completion_logprobs(entries, 0), "finish_reason": None,
                                    **_token_ids(req, accepted[p].prompt_token_ids, [])},
                             usage_so_far(completion_tokens))
        for seq in delta.seqs:
            index = p * n + seq.index
            completion_tokens += len(seq.token_ids)
            logprobs = completion_logprobs(seq.logprobs, offsets[index]) if seq.logprobs is not None else None
            offsets[index] += len(seq.text)
            choice = {"index": index, "text": seq.text, "logprobs": logprobs, "finish_reason": seq.finish_reason,
                      "stop_reason": seq.stop_reason}
            if req.prompt_logprobs is not None and delta.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(delta.prompt_logprobs)
            choice |= _token_ids(req, accepted[p].prompt_token_ids, seq.token_ids, with_prompt=index not in first)
            first.add(index)
            yield _chunk(meta, choice, usage_so_far(completion_tokens))
    if req.include_usage:
        yield {**meta, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def chat_body(meta: dict, req: ChatCompletionRequest, accepted: list[Accepted], out: Outputs,
              tool_parser: Callable[[], ToolParser | None] | None = None) -> dict:
    """`tool_parser` makes a choice's parser: its output's tool calls become the message's `tool_calls`."""
    choices = []
    for i, c in sorted(out.choices.items()):
        message = {"role": "assistant", "content": c.text}
        parser = tool_parser() if tool_parser else None
        finish_reason = c.finish_reason
        if parser is not None:
            parsed = parser.parse(c.text)
            message = {"role": "assistant", "content": parsed.content,
                       "tool_calls": [tool_call_json(call) for call in parsed.tool_calls]}
            finish_reason = _tool_finish_reason(parser, finish_reason, bool(parsed.tool_calls))
        if req.echo:  # vLLM's: the answer continues the last message
            message["content"] = req.echo_text + (message["content"] or "")
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason}
                       | _token_ids(req, None, c.token_ids, with_prompt=False))
    body = {**meta, "choices": choices, "usage": usage(accepted[0].num_prompt_tokens, out.completion_tokens),
            "prompt_logprobs": None}  # null unless asked for, as vLLM's
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs.get(0, []))
    if req.return_token_ids:
        body["prompt_token_ids"] = accepted[0].prompt_token_ids
    return body


async def chat_chunks(meta: dict, req: ChatCompletionRequest, accepted: list[Accepted], n: int,
                      deltas: AsyncIterator[tuple[int, RequestDelta]],
                      tool_parser: Callable[[], ToolParser | None] | None = None) -> AsyncIterator[dict]:
    """With a tool parser, each choice's text goes through its own: content as it settles, `delta.tool_calls`
    entries as calls are written (the first of a call with its id and name, then its arguments piece by piece)."""
    usage_so_far = _chunk_usage(req, accepted[0].num_prompt_tokens)
    prompt_ids = {"prompt_token_ids": accepted[0].prompt_token_ids} if req.return_token_ids else {}
    for j in range(n):
        yield _chunk(meta, {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}, usage_so_far(0)) | prompt_ids
    for j in range(n if req.echo_text else 0):  # vLLM's echo: the continued message first
        yield _chunk(meta, {"index": j, "delta": {"content": req.echo_text}, "logprobs": None,
                            "finish_reason": None}, usage_so_far(0))
    parsers = {j: tool_parser() for j in range(n)} if tool_parser else {}
    completion_tokens = 0
    async for _, delta in deltas:
        for seq in delta.seqs:
            completion_tokens += len(seq.token_ids)
            parser, finish_reason = parsers.get(seq.index), seq.finish_reason
            if parser is None:
                message = {"content": seq.text} if seq.text else {}
            else:
                message = _merge(parser.feed(seq.text), parser.finish() if finish_reason else None)
                if finish_reason:  # as the whole answer's: a call cut off (partly sent) counts for nothing
                    finish_reason = _tool_finish_reason(parser, finish_reason, parser.num_calls > 0)
                if not message and not finish_reason and not seq.logprobs and not req.return_token_ids:
                    continue  # the parser holds this text back (it may become a call)
            yield _chunk(meta, {"index": seq.index, "delta": message,
                                "logprobs": chat_logprobs(seq.logprobs) if seq.logprobs else None,
                                "finish_reason": finish_reason, "stop_reason": seq.stop_reason,
                                **_token_ids(req, None, seq.token_ids, with_prompt=False)},
                         usage_so_far(completion_tokens))
    if req.include_usage:
        yield {**meta, "choices": [], "usage": usage(accepted[0].num_prompt_tokens, completion_tokens)}


def _chunk_usage(req, prompt_tokens: int) -> Callable[[int], dict]:
    """completion tokens so far -> a chunk's usage field: none without include_usage, null with it (the last chunk
    brings the usage), the counts so far with continuous_usage_stats."""
    if req.continuous_usage:
        return lambda completion_tokens: {"usage": usage(prompt_tokens, completion_tokens)}
    return lambda completion_tokens: {"usage": None} if req.include_usage else {}


def _token_ids(req, prompt_token_ids: list[int] | None, token_ids: list[int], with_prompt: bool = True) -> dict:
    """vLLM's return_token_ids in a choice: its (new) token ids, and the prompt's where `with_prompt` (a completion
    choice, or its first chunk; a chat has them once, beside the choices)."""
    if not req.return_token_ids:
        return {}
    return ({"prompt_token_ids": prompt_token_ids} if with_prompt else {}) | {"token_ids": list(token_ids)}


def _chunk(meta: dict, choice: dict, usage_field: dict) -> dict:
    return {**meta, "choices": [choice], **usage_field}


def _merge(first: ToolCallsDelta, last: ToolCallsDelta | None) -> dict:
    """One chunk's delta from a feed and (at the end) the parser's finish."""
    content = first.content + (last.content if last else "")
    calls = first.tool_calls + (last.tool_calls if last else [])
    message = {"content": content} if content else {}
    if calls:
        message["tool_calls"] = [tool_call_delta_json(d) for d in calls]
    return message


def _tool_finish_reason(parser: ToolParser, finish_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's: 'tool_calls' when the model stopped after calling tools, 'stop' for a named tool_choice."""
    if has_calls and finish_reason == "stop" and not isinstance(parser, NamedToolParser):
        return "tool_calls"
    return finish_reason


def tool_call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_json(delta: ToolCallDelta) -> dict:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


# ---- response pieces ---------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(logprobs: list[TokenLogprob], text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, `text_offset` from the start of the choice's text. An echoed
    prompt's first token has no logprob (None), as in OpenAI's and vLLM's answers."""
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [None if lp.logprob is None else ({t: _finite(v) for _, t, v in lp.top}
                                                              or {lp.token: _finite(lp.logprob)})
                             for lp in logprobs],
            "text_offset": offsets}


def prompt_logprobs_json(entries: list[TokenLogprob]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id -> logprob, rank among the
    alternatives shown (None if it is not among them) and text."""
    out = []
    for entry in entries:
        if entry.logprob is None:
            out.append(None)
            continue
        ranks = {t: rank for rank, (t, _, _) in enumerate(entry.top, start=1)}
        item = {str(t): {"logprob": _finite(v), "rank": ranks[t], "decoded_token": text} for t, text, v in entry.top}
        item.setdefault(str(entry.token_id), {"logprob": _finite(entry.logprob), "rank": ranks.get(entry.token_id),
                                              "decoded_token": entry.token})
        out.append(item)
    return out


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict:
    return {"content": [{"token": lp.token, "logprob": _finite(lp.logprob), "bytes": list(lp.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": _finite(v), "bytes": list(t.encode())}
                                          for _, t, v in lp.top]}
                        for lp in logprobs]}


def _finite(logprob: float | None) -> float | None:
    """A logprob JSON can carry: a token that a grammar masked has -inf, which is not JSON; vLLM clamps it to
    -9999.0 and keeps it in the top list, as here."""
    return None if logprob is None else max(logprob, MIN_LOGPROB)
