"""Pagoda's Python API, as vLLM's users know it:

    from pagoda import LLM, SamplingParams
    llm = LLM()                                   # the built-in SmolLM2-135M-Instruct; LLM(model="tiny") for tests
    llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text

Names are resolved lazily, so that `import pagoda` stays light (no torch until used).
"""

from engine import lazy_exports

_EXPORTS = {
    "LLM": "pagoda.llm",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured_outputs",
    "EngineArgs": "engine.config",
    "RequestOutput": "engine.request_output",
    "CompletionOutput": "engine.request_output",
    "ParamError": "engine.errors",
    "LoRARequest": "engine.lora",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports("pagoda", _EXPORTS)
