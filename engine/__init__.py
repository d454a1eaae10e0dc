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
    "LoRARequest": "engine.lora",
}

__all__ = list(_EXPORTS)


def lazy_exports(package: str, exports: dict[str, str]):
    """A module `__getattr__` that imports each exported name from its module on first use."""

    def __getattr__(name):
        if name in exports:
            import importlib

            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = lazy_exports("engine", _EXPORTS)
