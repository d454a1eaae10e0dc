"""`LLM`: the offline API, as vLLM's users know it.

    llm = LLM()                                   # the built-in SmolLM2-135M-Instruct; LLM(model="tiny") for tests
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=8))
    outs[0].outputs[0].text
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.llm_engine import LLMEngine, Prompt, build_engine_config
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams, default_sampling_overrides
from engine.tokenizer import apply_chat_template


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, tensor_parallel_size: int = 1, seed: int = 0,
                 load_format: str = "auto", **kwargs):
        config = build_engine_config(
            model=model, dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tensor_parallel_size, seed=seed,
            load_format=load_format, **kwargs)
        self.engine = LLMEngine(config)
        self.engine.stream_outputs = False  # generate() returns whole outputs: skip the per-step ones

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**default_sampling_overrides(self.engine.config.model))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order. A prompt that is invalid raises
        ValueError before any work starts."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        processed = [self.engine.process_prompt(p, sp) for p, sp in zip(prompts, params_list)]
        ids = [self.engine.add_processed(None, text, token_ids, _copy(sp))
               for (text, token_ids), sp in zip(processed, params_list)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt": apply_chat_template(self.engine.tokenizer, conv, add_generation_prompt, chat_template),
                    "add_special_tokens": False} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request(list(self.engine.groups))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in request_ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __del__(self):
        try:
            self.engine.shutdown()
        except Exception:
            pass


def _copy(params: SamplingParams) -> SamplingParams:
    """Each request gets its own params object (the engine fills in per-request stop ids)."""
    from dataclasses import replace

    return replace(params)
