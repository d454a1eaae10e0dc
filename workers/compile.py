"""torch.compile of a model's decoder layers (CompilationConfig level 3, engine/config.py).

One compiled function serves every decoder layer of a model, dynamic in the number of tokens and sequences (a step
of one token or one sequence, whose sizes of 1 torch specializes, compiles once more), with Pagoda's GEMMs,
attention (with its KV write), MoE and LoRA kernels and all-reduces as opaque custom ops (kernels/ops.py,
workers/parallel.py) and inductor's code for the rest, which the layers trace from the torch references of their
other kernels (kernels/_triton.py `use_triton`). The KV pool is not an input of the graph: the layers get
`CacheRef`s and the attention op finds the step's pool (`ops.set_kv_caches`). fullgraph: a graph break is an error
at the first step, not a silently slower model. The decode CUDA graphs (workers/cuda_graphs.py) capture the compiled
code after their warm-up runs compiled it; the prefill warm-up compiles the rest (workers/worker.py).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from kernels import ops

# Compilations of the decoder layer a model may take: the first layer (no residual stream yet) and the others, each
# kind of layer a model mixes (dense and MoE MLPs, windows), prefill and decode (AttentionMetadata.is_decode_only),
# one token or one sequence (sizes of 1 are specialized), with LoRA rows or without. Past it a step fails.
RECOMPILE_LIMIT = 64


def _own_copy(function: types.FunctionType) -> types.FunctionType:
    """A function with a code object of its own: dynamo keeps compiled code on the code object it traces, guarded
    by the module's parameters, so two models of one class in a process (tests, a draft and its target) would
    recompile a shared one for each other until the limit."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


class CompiledForward:
    """The model's forward with its decoder layers compiled; called as the forward is (input_ids, positions,
    kv_caches, meta).

    One compiled function serves every layer of the model (the layers are inputs of its graph, as their
    parameters are), so inductor compiles a layer's code, not 32 copies of it. The embedding, the loop over the
    layers and the final norm run eagerly (in the decode CUDA graphs, as everything else). The KV pool is not an
    input: each layer gets `ops.CacheRef`s whose index is a host tensor (an int would be a constant of the graph,
    one graph per layer), and the attention op finds the step's pool (`ops.set_kv_caches`)."""

    def __init__(self, model: nn.Module):
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        dynamo.fail_on_recompile_limit_hit = True  # never run eagerly unnoticed
        # no "duck" sizes: a first step whose token count equals its sequence count (a decode) must not tie the two
        torch.fx.experimental._config.use_duck_shape = False
        # round where the torch references round (a bf16 cast between float32 steps is not skipped), as the eager
        # kernels do: FP8 quantizes those values
        torch._inductor.config.emulate_precision_casts = True
        self.forward = type(model).forward.__get__(model)
        layers = model.model.layers
        compiled = torch.compile(_own_copy(type(layers[0]).forward), dynamic=True, fullgraph=True)
        for layer in layers:
            layer.forward = compiled.__get__(layer)
        self._refs: tuple[int, list] | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        if self._refs is None or self._refs[0] != id(kv_caches):  # the refs of the pool the step runs on
            self._refs = (id(kv_caches), ops.cache_refs(kv_caches))
        ops.set_kv_caches(kv_caches)
        return self.forward(input_ids, positions, self._refs[1], meta)


def compile_model(model: nn.Module) -> None:
    """Compiles `model`'s decoder layers in place (their first calls trace and compile them); compute_logits stays
    eager."""
    model.forward = CompiledForward(model)
