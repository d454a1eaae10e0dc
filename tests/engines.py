"""Engines built as Pagoda's callers build them: with cluster.executors.pick_executor handed in (engine/ imports no
executor of its own)."""

from cluster.executors import pick_executor
from engine.async_engine import AsyncLLMEngine, LocalConnection
from engine.config import EngineArgs, EngineConfig
from engine.executor import Executor, ExecutorPicker
from engine.llm_engine import LLMEngine


def llm_engine(**engine_args) -> LLMEngine:
    """An LLMEngine of EngineArgs(**engine_args), on the executor Pagoda picks for them."""
    return LLMEngine(EngineArgs(**engine_args).create_engine_config(), pick_executor)


def local_async_engine(config: EngineConfig, **kwargs) -> AsyncLLMEngine:
    """An AsyncLLMEngine whose core runs in this process (a replica's LocalConnection)."""
    return AsyncLLMEngine(config, LocalConnection(config, pick_executor), **kwargs)


def the_executor(executor: Executor) -> ExecutorPicker:
    """A picker that hands the engine an executor the test started already."""
    return lambda _config: lambda _config: executor
