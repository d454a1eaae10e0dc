"""`LLM`: the offline API, as vLLM's users know it. It sits above engine/ (which imports no executor) and hands the
engine Pagoda's choice of one: the worker in this process, or a Ray actor group for tensor parallelism.

    llm = LLM()                                   # the built-in SmolLM2-135M-Instruct; LLM(model="tiny") for tests
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=8))
    outs[0].outputs[0].text
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from cluster.executors import pick_executor
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.prompts import Prompt
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams, default_sampling_overrides
from engine.tokenizer import apply_chat_template


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """`model` and every other `EngineArgs` field (engine/config.py) as keyword arguments."""
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs).create_engine_config(), pick_executor)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**default_sampling_overrides(self.engine.config.model))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order. A prompt that is invalid raises
        a ParamError (a ValueError) before any work starts. lora_request: one adapter for every prompt, or one
        (or None: the base model) per prompt; needs LLM(enable_lora=True)."""
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
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            self.engine.lora_adapter(lora)  # a bad adapter fails here, before any request is added
        processed = [self.engine.process_prompt(p, sp) for p, sp in zip(prompts, params_list)]
        # Each request gets its own params object (the engine fills in its stop ids); stream=False: the engine
        # reports each request once, finished, with its whole output.
        ids = [self.engine.add_processed(None, token_ids, replace(sp), stream=False, lora_request=lora)
               for (_, token_ids), sp, lora in zip(processed, params_list, loras)]
        return self._run(ids, processed, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        conversations = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict) else messages)
        prompts = [{"prompt": apply_chat_template(self.engine.tokenizer, conv, add_generation_prompt, chat_template),
                    "add_special_tokens": False} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], processed: list[tuple[str | None, list[int]]],
             use_tqdm: bool) -> list[RequestOutput]:
        prompts = dict(zip(request_ids, processed))
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.finished:
                        text, token_ids = prompts[delta.request_id]
                        finished[delta.request_id] = RequestOutput.from_final_delta(delta, text, token_ids)
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
        except Exception:  # noqa: BLE001 - a finalizer must not raise; shutdown() is the call that reports
            pass
