"""torch.compile of a model's forward pass (CompilationConfig level 3, engine/config.py).

One graph for every step: dynamic in the number of tokens and sequences (a decode batch of one, whose sizes of 1
torch specializes, compiles once more), with Pagoda's GEMMs, attention (with its KV write) and all-reduces as opaque
custom ops (kernels/ops.py, workers/parallel.py) and inductor's code for the rest, which the layers trace from the
torch references of their other kernels (kernels/_triton.py `use_triton`). The KV pool is not an input of the graph:
the layers get `CacheRef`s and the attention op finds the step's pool (`ops.set_kv_caches`). fullgraph: a graph
break is an error at the first step, not a silently slower model. The decode CUDA graphs (workers/cuda_graphs.py)
capture the compiled code after their warm-up runs compiled it.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from kernels import ops

# Compilations a forward may take: prefill and decode (AttentionMetadata.is_decode_only), each also for one token or
# one sequence (sizes of 1 are specialized); more would mean a guard on something that changes every step, which
# the tests catch.
CACHE_SIZE_LIMIT = 16


class CompiledForward:
    """The model's forward, compiled; called as the forward is (input_ids, positions, kv_caches, meta).

    Dynamo keeps its compiled code on the Python code object it traces, guarded by the model's parameters; two
    models of one class in a process (tests, a draft and its target) would share it, each recompiling it for the
    other until the recompile limit turns compilation off. So each model compiles its own copy of its class's
    forward code. Past the limit a step fails (`fail_on_recompile_limit_hit`), never runs eagerly unnoticed."""

    def __init__(self, model: nn.Module):
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, CACHE_SIZE_LIMIT)
        dynamo.fail_on_recompile_limit_hit = True
        # no "duck" sizes: a first step whose token count equals its sequence count (a decode) must not tie the two
        torch.fx.experimental._config.use_duck_shape = False
        forward = type(model).forward
        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                 forward.__defaults__, forward.__closure__)
        self.compiled = torch.compile(own.__get__(model), dynamic=True, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        return self.compiled(input_ids, positions, ops.set_kv_caches(kv_caches), meta)


def compile_model(model: nn.Module) -> None:
    """Compiles `model`'s forward in place (its first calls trace and compile it); compute_logits stays eager."""
    model.forward = CompiledForward(model)
