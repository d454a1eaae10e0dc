"""Pagoda's engine: scheduler, block manager, step contract and LLMEngine (the offline `LLM` API is pagoda.LLM).

Names are resolved lazily so that `import engine` stays light (no torch, no transformers until used).
"""

_EXPORTS = {
    "SamplingParams": "engine.sampling_params",
    "EngineArgs": "engine.config",
    "StructuredOutputsParams": "engine.structured_outputs",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLMEngine": "engine.async_engine",
    "RequestDelta": "engine.request_output",
    "RequestOutput": "engine.request_output",
    "RequestError": "engine.request_output",
    "CompletionOutput": "engine.request_output",
    "ParamError": "engine.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
