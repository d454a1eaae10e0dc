"""`LLMEngine`: the driver loop. add_request / step / abort; turns sampled tokens into text and outputs.

    step():  scheduler.schedule() ─► executor.execute_model() ─► scheduler.update_from_output()
             ─► detokenize, stop strings ─► RequestOutput for each request that moved
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import Executor, ExecutorError, create_executor
from engine.request import Request, RequestStatus
from engine.request_output import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens: int  # counters since start
    generation_tokens: int


@dataclass
class StepTiming:
    """Where step() spends its time, cumulative. wait_s is the part spent waiting for the device to finish a step
    launched earlier (with overlap): a share near zero means the host, not the device, sets the pace."""

    num_steps: int = 0
    busy_s: float = 0.0  # inside step()
    wait_s: float = 0.0  # of which, waiting for a step's results

    def since(self, earlier: StepTiming) -> dict:
        steps = self.num_steps - earlier.num_steps
        busy, wait = self.busy_s - earlier.busy_s, self.wait_s - earlier.wait_s
        return {"steps": steps, "ms_per_step": 1e3 * busy / max(steps, 1),
                "device_wait_ms_per_step": 1e3 * wait / max(steps, 1)}


class RequestGroup:
    """One user request: its n sequences, their detokenizers and what has been reported."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Request], tokenizer):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.detokenizers = [
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                   params.include_stop_str_in_output) for _ in seqs]
        self.arrival_time = time.monotonic()
        self.last_emit: float | None = None  # when step() last returned an output of it
        self.num_sent_tokens = [0] * len(seqs)  # per sequence, for delta outputs
        self.sent_logprob_sums = [0.0] * len(seqs)
        self.sent_prompt_logprobs = False  # delta outputs: the first output with them carried them

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def make_output(self, error: str | None = None, delta: bool = False) -> RequestOutput:
        """The request's output so far; with delta, only what is new since the last delta output (text, tokens,
        logprobs), so that streaming costs per step what the step added, not the whole output again."""
        outputs = [self._completion(seq, det, delta) for seq, det in zip(self.seqs, self.detokenizers)]
        firsts = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        metrics = RequestMetrics(
            arrival_time=self.arrival_time, first_token_time=min(firsts) if firsts else None,
            finish_time=time.monotonic() if self.is_finished else None,
            num_cached_tokens=max(self.seqs[0].num_cached_tokens, 0),
            num_preemptions=sum(s.num_preemptions for s in self.seqs))
        prompt_logprobs = None
        if self.params.prompt_logprobs is not None and not (delta and self.sent_prompt_logprobs):
            prompt_logprobs = list(self.seqs[0].prompt_logprobs) or [None] * len(self.prompt_token_ids)
            self.sent_prompt_logprobs = delta
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.is_finished,
                             metrics, error, prompt_logprobs)

    def _completion(self, seq: Request, det: IncrementalDetokenizer, delta: bool) -> CompletionOutput:
        start = self.num_sent_tokens[seq.index] if delta else 0
        token_ids = seq.output_token_ids[start:]
        logprobs = cumulative = None
        if self.params.logprobs is not None:
            logprobs = []
            cumulative = self.sent_logprob_sums[seq.index] if delta else 0.0
            for token_id, lp in zip(token_ids, seq.output_logprobs[start:]):
                entry = dict(zip(lp.top_token_ids, lp.top_logprobs)) if lp else {}
                entry[token_id] = lp.sampled_logprob if lp else float("nan")
                logprobs.append(entry)
                if lp:
                    cumulative += lp.sampled_logprob
        if delta:
            self.num_sent_tokens[seq.index] = len(seq.output_token_ids)
            if cumulative is not None:
                self.sent_logprob_sums[seq.index] = cumulative
            text = det.flush(seq.is_finished)
        else:
            text = det.stable_text(seq.is_finished)
        return CompletionOutput(seq.index, text, token_ids, logprobs, seq.status.finish_reason, seq.stop_reason,
                                cumulative)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        from engine.tokenizer import load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer_path, config.model.chat_template)
        self.executor = executor or create_executor(config)
        block_size = config.cache.block_size
        num_blocks = self.executor.num_kv_blocks
        self.max_model_len = min(config.model.max_model_len, num_blocks * block_size)
        if self.max_model_len < config.model.max_model_len:
            logger.warning("max_model_len lowered from %d to %d: the KV pool holds %d blocks of %d tokens",
                           config.model.max_model_len, self.max_model_len, num_blocks, block_size)
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.groups: dict[str, RequestGroup] = {}
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = set(config.model.eos_token_ids) | _tokenizer_eos(self.tokenizer)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._pending = None  # (SchedulerOutput, StepHandle) of the step in flight
        self.stream_outputs = True  # False: step() returns finished requests only (the offline LLM)
        self.delta_outputs = False  # True: each output holds only what is new since the request's last one
        self.output_interval_s = 0.0  # > 0 (delta outputs): a running request's outputs come at most this often
        self.timing = StepTiming()
        self._ids = itertools.count()

    @classmethod
    def from_args(cls, **kwargs) -> LLMEngine:
        return cls(build_engine_config(**kwargs))

    # ---- requests ------------------------------------------------------------------------------------------------
    def process_prompt(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Validates a prompt and its params against the model; returns (text, token ids). Raises ValueError."""
        return process_prompt(prompt, params, self.tokenizer, self.vocab_size, self.max_model_len,
                              self.config.scheduler.max_num_seqs)

    def add_request(self, request_id: str | None, prompt: Prompt, params: SamplingParams) -> str:
        text, token_ids = self.process_prompt(prompt, params)
        return self.add_processed(request_id, text, token_ids, params)

    def add_processed(self, request_id: str | None, text: str | None, token_ids: list[int],
                      params: SamplingParams) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        params.all_stop_token_ids = tuple(sorted(stop_ids))
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None if params.seed is None else params.seed + i
            seqs.append(Request(seq_id, token_ids, params, max_tokens, parent_id=request_id, index=i,
                                leader=seqs[0] if i else None, sample_seed=seed))
        self.groups[request_id] = RequestGroup(request_id, text, token_ids, params, seqs, self.tokenizer)
        for seq in seqs:
            self.scheduler.add_request(seq)
        self.num_prompt_tokens += len(token_ids)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.pop(request_id, None)
            for seq in group.seqs if group else []:
                self.scheduler.finish_request(seq.req_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or self._pending is not None

    # ---- the loop ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step. With overlap, step N+1 is scheduled and launched before step N's tokens are read
        back, so the host's work hides behind the device's; the outputs returned are then step N's."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.timing.num_steps += 1
            self.timing.busy_s += time.perf_counter() - start

    def _step(self) -> list[RequestOutput]:
        if not self._can_overlap():
            if self._pending is not None:
                return self._finish_pending()  # leaving overlap: drain the step in flight first
            sched = self.scheduler.schedule()
            if self._is_idle(sched):
                return []
            try:
                result = self.executor.execute_model(sched)
            except ExecutorError as e:
                return self._fail_step(sched, e)
            return self._process(sched, result)
        sched = self.scheduler.schedule()
        if self._is_idle(sched):
            return self._finish_pending()
        try:
            handle = self.executor.execute_model_async(sched)
        except ExecutorError as e:
            return self._finish_pending() + self._fail_step(sched, e)
        outputs = self._finish_pending()
        self._pending = (sched, handle)
        return outputs

    def _can_overlap(self) -> bool:
        if not (self.config.scheduler.async_scheduling and self.executor.supports_overlap):
            return False
        return not any(req.needs_exact_history for req in self.scheduler.running)

    @staticmethod
    def _is_idle(sched) -> bool:
        return sched.is_empty and not (sched.finished_req_ids or sched.preempted_req_ids)

    def _finish_pending(self) -> list[RequestOutput]:
        if self._pending is None:
            return []
        sched, handle = self._pending
        self._pending = None
        start = time.perf_counter()
        try:
            result = handle.result()
        except ExecutorError as e:
            return self._fail_step(sched, e)
        finally:
            self.timing.wait_s += time.perf_counter() - start
        return self._process(sched, result)

    def _fail_step(self, sched, error: ExecutorError) -> list[RequestOutput]:
        logger.error("step failed, failing %d requests: %s", len(sched.num_scheduled_tokens), error)
        reqs = (self.scheduler.requests.get(seq_id) for seq_id in sched.num_scheduled_tokens)
        return self._fail_requests([r.parent_id for r in reqs if r is not None], str(error))

    def _process(self, sched, result) -> list[RequestOutput]:
        touched: dict[str, RequestGroup] = {}
        for seq in self.scheduler.update_from_output(sched, result):
            group = self.groups.get(seq.parent_id)
            if group is None:
                continue
            self.num_generation_tokens += 1
            stop = group.detokenizers[seq.index].update([seq.output_token_ids[-1]])
            if stop is not None and not seq.is_finished:
                self.scheduler.finish_request(seq.req_id, RequestStatus.FINISHED_STOPPED)
                seq.stop_reason = stop
            touched[group.request_id] = group
        if not self.stream_outputs:
            return [self._emit(group) for group in touched.values() if group.is_finished]
        if self.output_interval_s <= 0:
            return [self._emit(group) for group in touched.values()]
        now = time.monotonic()
        outputs = []
        for group in touched.values():
            # The first token and the end go out at once; between them, at most one output per interval (delta
            # outputs lose nothing by waiting: the next carries everything since the last).
            if group.is_finished or group.last_emit is None or now - group.last_emit >= self.output_interval_s:
                group.last_emit = now
                outputs.append(self._emit(group))
        return outputs

    def _emit(self, group: RequestGroup, error: str | None = None) -> RequestOutput:
        out = group.make_output(error, self.delta_outputs)
        if out.finished:
            del self.groups[group.request_id]
        return out

    def _fail_requests(self, request_ids: list[str], error: str) -> list[RequestOutput]:
        outputs = []
        for parent_id in dict.fromkeys(request_ids):
            group = self.groups.get(parent_id)
            if group is None:
                continue
            for seq in group.seqs:
                self.scheduler.finish_request(seq.req_id, RequestStatus.FINISHED_ERROR)
            outputs.append(self._emit(group, error))
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        return self._fail_requests(list(self.groups), error)

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, bm.usage, bm.num_blocks,
                           bm.prefix_queries_tokens, bm.prefix_hits_tokens, self.scheduler.num_preemptions,
                           self.num_prompt_tokens, self.num_generation_tokens)

    def check_integrity(self) -> None:
        self.block_manager.check_integrity()
        for req in self.scheduler.running:
            assert req.status == RequestStatus.RUNNING, req
        if not self.groups:
            assert not self.scheduler.requests, f"requests left: {list(self.scheduler.requests)}"
            assert self.block_manager.num_free_blocks == self.block_manager.num_blocks, "blocks leaked"

    def shutdown(self) -> None:
        self._pending = None
        self.executor.shutdown()


def process_prompt(prompt: Prompt, params: SamplingParams, tokenizer, vocab_size: int, max_model_len: int,
                   max_num_seqs: int) -> tuple[str | None, list[int]]:
    """Validates a prompt and its params against a model; returns (text, token ids). Raises ValueError.

    A function of the model's limits, so a process without the engine (a Serve replica whose engine runs in
    another process) validates requests exactly as the engine would."""
    add_special_tokens = True
    if isinstance(prompt, dict):
        add_special_tokens = bool(prompt.get("add_special_tokens", True))
        if "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            text, token_ids = prompt["prompt"], None
        else:
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        text, token_ids = prompt, None
    elif isinstance(prompt, (list, tuple)):
        text, token_ids = None, list(prompt)
    else:
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
    if token_ids is None:
        if not isinstance(text, str):
            raise ValueError("prompt must be a string")
        token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not token_ids:
        raise ValueError("prompt is empty")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"prompt_token_ids must be integers in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"prompt is {len(token_ids)} tokens, but this model's maximum context length is "
                         f"{max_model_len} tokens (prompt and at least one output token)")
    params.validate()
    params.validate_for_model(vocab_size)
    if params.n > max_num_seqs:
        raise ValueError(f"n must be at most max_num_seqs={max_num_seqs}, got {params.n}")
    return text, token_ids


def _tokenizer_eos(tokenizer) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if isinstance(eos, int) else set()


def build_engine_config(model: str | None = None, dtype: str = "auto", device: str = "auto", block_size: int = 16,
                        num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                        cpu_kv_cache_bytes: int = 1 << 30, max_num_seqs: int = 256,
                        max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                        enable_prefix_caching: bool = True, tensor_parallel_size: int = 1, seed: int = 0,
                        load_format: str = "auto", tokenizer: str | None = None, enforce_eager: bool = False,
                        use_ray: bool = False, chat_template: str | None = None) -> EngineConfig:
    """The one place where user-facing arguments become the frozen config. `model` is any name
    `engine.model_source.resolve_model` takes (None: the built-in SmolLM2); `chat_template` a file or the template's
    text."""
    from engine.model_source import resolve_model
    from engine.sampling_params import default_sampling_overrides
    from engine.tokenizer import read_chat_template

    model_config = ModelConfig.from_path(resolve_model(model), dtype=dtype, max_model_len=max_model_len or 0,
                                         load_format=load_format, seed=seed, tokenizer=tokenizer,
                                         chat_template=read_chat_template(chat_template))
    default_sampling_overrides(model_config)  # a bad generation_config.json fails here, not at the first request
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(block_size, num_kv_blocks, gpu_memory_utilization, cpu_kv_cache_bytes,
                          enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, model_config.max_model_len),
        parallel=ParallelConfig(tensor_parallel_size, device, enforce_eager, use_ray))
