"""`RequestGroup`: one user request on the driver — its n sequences, their detokenizers, and what of them has been
reported — and the one place its `RequestDelta`s are built and throttled."""

from __future__ import annotations

import time

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import Logprobs
from engine.request import Request
from engine.request_output import RequestDelta, RequestError, RequestMetrics, SequenceDelta, TokenLogprob
from engine.sampling_params import SamplingParams


class TokenStrings:
    """Token id -> the string the API shows for it (logprobs), cached: a vocabulary's worth at most."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            text = self.tokenizer.convert_tokens_to_string([token]) if token is not None else ""
            self._cache[token_id] = text
        return text


class RequestGroup:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seqs: list[Request],
                 tokenizer, token_strings: TokenStrings, stream: bool, arrival_time: float):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.stream = stream  # False: one delta, when the request finishes
        self.token_strings = token_strings
        self.detokenizers = [
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                   params.include_stop_str_in_output) for _ in seqs]
        self.arrival_time = arrival_time
        self.last_emit: float | None = None  # monotonic time of the last delta
        self.num_sent_tokens = [0] * len(seqs)
        self.is_done_sent = [False] * len(seqs)
        self.sent_prompt_logprobs = False

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def wants_delta(self, now: float, interval_s: float) -> bool:
        """Throttling, the only place: a streaming request's first token and its end go out at once; between them,
        at most one delta per interval (it carries everything since the last, so waiting loses nothing)."""
        if self.is_finished:
            return True
        if not self.stream:
            return False
        return self.last_emit is None or now - self.last_emit >= interval_s

    def make_delta(self, now: float, error: RequestError | None = None) -> RequestDelta:
        """Everything new since the last delta. The last one also carries the request's metrics."""
        self.last_emit = now
        seqs = [d for d in (self._seq_delta(seq, det) for seq, det in zip(self.seqs, self.detokenizers))
                if d is not None]
        finished = self.is_finished
        return RequestDelta(self.request_id, seqs, finished, error, self._metrics() if finished else None,
                            self._prompt_logprobs())

    def _prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs, once, on the first delta (the prompt is computed by then)."""
        k = self.params.prompt_logprobs
        if k is None or self.sent_prompt_logprobs:
            return None
        self.sent_prompt_logprobs = True
        entries = self.seqs[0].prompt_logprobs or [None] * len(self.prompt_token_ids)
        strings = self.token_strings
        return [TokenLogprob(token_id, strings(token_id), None) if entry is None  # the first: nothing predicts it
                else self._token_logprob(token_id, entry, k) for token_id, entry in zip(self.prompt_token_ids, entries)]

    def _token_logprob(self, token_id: int, logprobs: Logprobs, k: int) -> TokenLogprob:
        """A token's logprob and its top k alternatives (best first), with the strings the API shows."""
        strings = self.token_strings
        return TokenLogprob(token_id, strings(token_id), logprobs.sampled_logprob,
                            [(t, strings(t), v) for t, v in zip(logprobs.top_token_ids[:k], logprobs.top_logprobs[:k])])

    def _seq_delta(self, seq: Request, det: IncrementalDetokenizer) -> SequenceDelta | None:
        i = seq.index
        if self.is_done_sent[i]:
            return None
        start = self.num_sent_tokens[i]
        token_ids = seq.output_token_ids[start:]
        text = det.flush(seq.is_finished)
        finish_reason = seq.status.finish_reason
        if not token_ids and not text and finish_reason is None:
            return None
        self.num_sent_tokens[i] = len(seq.output_token_ids)
        self.is_done_sent[i] = finish_reason is not None
        logprobs = None
        if self.params.logprobs is not None:
            k = self.params.logprobs
            logprobs = [self._token_logprob(t, lp, k) if lp else TokenLogprob(t, self.token_strings(t), float("nan"))
                        for t, lp in zip(token_ids, seq.output_logprobs[start:])]
        return SequenceDelta(i, text, token_ids, logprobs, finish_reason,
                             seq.stop_reason if finish_reason is not None else None)

    def _metrics(self) -> RequestMetrics:
        firsts = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        scheduled = [s.first_scheduled_time for s in self.seqs if s.first_scheduled_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time, first_scheduled_time=min(scheduled) if scheduled else None,
            first_token_time=min(firsts) if firsts else None, finish_time=time.time(),
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=sum(s.num_output_tokens for s in self.seqs),
            num_cached_tokens=max(self.seqs[0].num_cached_tokens, 0),
            num_preemptions=sum(s.num_preemptions for s in self.seqs))
