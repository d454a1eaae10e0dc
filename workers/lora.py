"""LoRA adapters on a worker: preallocated GPU slots in every target linear, and loading an adapter into a slot.

Each target linear gets `LoRAWeights`, `max_loras` stacked slots (model dtype, rank zero-padded to max_lora_rank):

    layer          slices         a [S, n, R, K]                    b [S, N, R]
    qkv_proj       q, k, v        hidden (whole)                    this rank's q ; k ; v rows
    gate_up_proj   gate, up       hidden (whole)                    this rank's gate ; up rows
    o_proj         -              this rank's input columns         out (whole)
    down_proj      -              this rank's input columns         out (whole)
    (DeepSeek-V2)  q_proj / q_b_proj: this rank's heads' rows; q_a_proj, kv_a_proj_with_mqa: replicated, whole;
                   kv_b_proj: this rank's heads' rows, used as `LatentLoRAWeights` (below), never as a linear

A step's forward adds `lora_expand(out, lora_shrink(x, a, slots), b, slots, slice_starts)` to each such layer's
output (`LoRAWeights.apply`, which workers/layers/linear.py calls), every token with its own slot: no loop over
adapters; the kernels tile the rows sorted by slot (`order`, the step's argsort of the slots: workers/inputs.py). A
slot an adapter leaves a module out of holds zeros there. In the decode CUDA graphs the shrink, which reads only the
layer's input, runs on a second stream beside the layer's own matmul (workers/side_stream.py: two branches of the
graph), so of the adapter's kernels only the expand lies on the replayed step's path.

An adapter reaches a slot in two moves, both ordered by the driver's steps (engine/lora.py LoRAHostCache):

    SchedulerOutput.lora_reads   a thread of this rank reads adapter_model.safetensors and cuts this rank's parts,
                                 scaled, cast and pinned, into the host cache (`start_read`), while steps run;
                                 `take_reads` tells the driver (through the executor) which reads are done
    SchedulerOutput.lora_loads   the step zeroes the slot and copies the parts in from host memory (`load`)

and leaves the host cache by `lora_evictions` (the driver's LRU of `max_cpu_loras`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from engine.config import LoRAConfig
from engine.lora import WEIGHTS_FILE, LoRAAdapter, lora_module_shapes, parse_tensor_name
from kernels import ops
from kernels.lora import MAX_RANK, lora_expand, lora_shrink
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.side_stream import beside

logger = logging.getLogger(__name__)

NUM_READ_THREADS = 2
# A test hook: called on the reading thread with the adapter before its file is read (a test holds a read back with
# it, as a slow filesystem would). None in production.
before_read: Callable[[LoRAAdapter], None] | None = None

# checkpoint module -> (the layer's attribute path, its slice, the layer's shard id)
_MODULES = {
    "q_proj": ("self_attn.qkv_proj", 0, "q"), "k_proj": ("self_attn.qkv_proj", 1, "k"),
    "v_proj": ("self_attn.qkv_proj", 2, "v"), "o_proj": ("self_attn.o_proj", 0, None),
    "gate_proj": ("mlp.gate_up_proj", 0, 0), "up_proj": ("mlp.gate_up_proj", 1, 1),
    "down_proj": ("mlp.down_proj", 0, None),
}
# DeepSeek-V2's (workers/models/deepseek_v2.py): its latent attention's projections, as its checkpoint names them
_MLA_MODULES = {
    "q_proj": ("self_attn.q_proj", 0, None), "q_a_proj": ("self_attn.q_a_proj", 0, None),
    "q_b_proj": ("self_attn.q_b_proj", 0, None), "kv_a_proj_with_mqa": ("self_attn.kv_a_proj_with_mqa", 0, None),
    "kv_b_proj": ("self_attn.kv_b_proj", 0, None), "o_proj": ("self_attn.o_proj", 0, None),
}
# A fused checkpoint module (Phi-3's) -> its parts: one A for all of them, B's rows in this order. Each part is the
# module above (its slice and shard), its A the fused one and its B its rows of the fused B: the same delta.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class LoRAWeights:
    """One linear's adapter slots."""

    a: torch.Tensor  # [max_loras, n_slices, max_lora_rank, in_features (this rank's part)]
    b: torch.Tensor  # [max_loras, out_features (this rank's part), max_lora_rank], scaling folded in
    slice_starts: tuple[int, ...]  # each slice's first output column

    def apply(self, matmul: Callable[[], torch.Tensor], x: torch.Tensor, slots: torch.Tensor,
              order: torch.Tensor | None = None) -> torch.Tensor:
        """matmul(): the layer's own output [T, N] for x [T, K]; returned with each token's adapter delta added.
        slots: int32 [T]; order: int32 [T], the rows sorted by slot (kernels/lora.py: the kernels' tiles; None: as
        they come). In a decode graph the shrink, which reads only x, runs beside matmul() (workers/side_stream.py)."""
        if torch.compiler.is_compiling():  # the two kernels as one opaque op (kernels/ops.py), after the matmul
            out = matmul()
            ops.lora_apply(out, x, self.a, self.b, slots, list(self.slice_starts), order)
            return out
        y, out = beside(lambda: lora_shrink(x, self.a, slots, order=order), matmul, x.device)
        lora_expand(out, y, self.b, slots, self.slice_starts, order=order)
        return out

    def refresh(self, slot: int) -> None:
        """After a load into the slot (or its zeroing): what the layer derives from a and b (none here)."""


@dataclass
class LatentLoRAWeights(LoRAWeights):
    """kv_b_proj's slots under multi-head latent attention (workers/layers/mla.py), which never runs kv_b_proj: it
    folds each head's rows [W_UK[h] ; W_UV[h]] into the queries and the outputs. An adapter's B A adds B_K[h] A and
    B_V[h] A to them, so the same reassociation takes the delta per token and head, through the LoRA kernels with
    the (token, head) pairs as rows (slot s, head h: row slot s * H + h where B differs by head):

        q_lat[t, h]  += ((q_nope[t, h] B_K[s, h]) A[s])        shrink by bk_t [S*H, 1, R, nope], expand by a_t
        out[t, h]    += ((out_lat[t, h] A[s]^T) B_V[s, h]^T)   shrink by a, expand by bv [S*H, v, R]

    bk_t, a_t and bv are copies of a and b in those layouts, made when a slot is loaded (`refresh`)."""

    num_heads: int  # this rank's
    nope: int  # qk_nope_head_dim
    a_t: torch.Tensor  # [S, L, R]
    bk_t: torch.Tensor  # [S * H, 1, R, nope]
    bv: torch.Tensor  # [S * H, v, R]

    def refresh(self, slot: int) -> None:
        h, rank = self.num_heads, self.b.shape[-1]
        self.a_t[slot].copy_(self.a[slot, 0].T)
        b = self.b[slot].view(h, -1, rank)  # [H, nope + v, R]
        heads = slice(slot * h, (slot + 1) * h)
        self.bk_t[heads, 0].copy_(b[:, :self.nope].transpose(1, 2))
        self.bv[heads].copy_(b[:, self.nope:])

    def row_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] adapter slots -> the [T * H] (token, head) rows' slots in A (each token's) and in the per-head
        tensors (s * H + h); -1 stays -1. Once a layer's step, for both absorbs."""
        h = self.num_heads
        per_head = slots[:, None] * h + torch.arange(h, dtype=slots.dtype, device=slots.device)
        return slots.repeat_interleave(h), torch.where(slots[:, None] >= 0, per_head, -1).reshape(-1)

    def absorb_query(self, q_lat: torch.Tensor, q_nope: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        # q_lat [T, H, L] (contiguous) += each token's delta; q_nope [T, H, nope]; rows: row_slots(slots)
        token_slots, head_slots = rows
        u = lora_shrink(q_nope.reshape(-1, self.nope), self.bk_t, head_slots)  # [1, T*H, R]
        lora_expand(q_lat.view(token_slots.shape[0], -1), u, self.a_t, token_slots, (0,))

    def absorb_output(self, out: torch.Tensor, out_lat: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
        # out [T, H, v] (contiguous) += each token's delta; out_lat [T, H, L]; rows: row_slots(slots)
        token_slots, head_slots = rows
        u = lora_shrink(out_lat.reshape(token_slots.shape[0], -1), self.a, token_slots)  # [1, T*H, R]
        lora_expand(out.view(token_slots.shape[0], -1), u, self.bv, head_slots, (0,))


@dataclass
class _Part:
    """One LoRA tensor pair, cut to this rank, ready to copy into a slot."""

    weights: LoRAWeights
    index: int  # the slice
    rows: slice  # the output rows of b it fills
    a: torch.Tensor  # [r, K part]
    b: torch.Tensor  # [rows, r], scaled


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, hf_config: dict, dtype: torch.dtype, device):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and config.max_lora_rank > MAX_RANK:
            raise ValueError(f"max_lora_rank {config.max_lora_rank}: the LoRA kernels take ranks up to {MAX_RANK}")
        self.layers = model.model.layers
        self.modules = lora_module_shapes(hf_config)  # the linears that take adapters: the driver checks against it
        self.paths = _MLA_MODULES if "kv_b_proj" in self.modules else _MODULES
        self.weights: dict[str, LoRAWeights] = {}  # "{layer}.{attribute path}" -> its slots
        for i, layer in enumerate(self.layers):
            for path in dict.fromkeys(self.paths[p][0] for m in self.modules for p in _FUSED.get(m, (m,))):
                linear = _submodule(layer, path)
                if linear is not None:  # (a family's layers could differ: skip one without the module)
                    linear.lora = self.weights[f"{i}.{path}"] = self._make_slots(linear)
        self.cache: dict[int, Future[list[_Part]]] = {}  # adapter id -> its parts, read or being read
        self.slots: list[int | None] = [None] * config.max_loras  # the adapter id in each slot
        self.load_errors: dict[int, str] = {}  # slot -> why its last load failed
        self._reads: dict[int, Future[list[_Part]]] = {}  # read id -> its read, until take_reads reports it
        self._reads_lock = threading.Lock()  # (the step thread starts reads; the executor's thread takes them)
        self._pool = ThreadPoolExecutor(NUM_READ_THREADS, thread_name_prefix="lora-read")

    def _make_slots(self, linear: torch.nn.Module) -> LoRAWeights:
        slots, rank = self.config.max_loras, self.config.max_lora_rank
        if isinstance(linear, RowParallelLinear):
            k, n, starts = linear.in_features_per_rank, linear.out_features, (0,)
        else:  # column-parallel (a ReplicatedLinear is one of a single part)
            assert isinstance(linear, ColumnParallelLinear), type(linear)
            k, n = linear.in_features, linear.out_features_per_rank
            if hasattr(linear, "q_size"):  # QKVParallelLinear
                starts = (0, linear.q_size, linear.q_size + linear.kv_size)
            elif hasattr(linear, "sizes_per_rank"):  # MergedColumnParallelLinear: gate ; up
                starts = (0, linear.sizes_per_rank[0])
            else:
                starts = (0,)
        a = torch.zeros(slots, len(starts), rank, k, dtype=self.dtype, device=self.device)
        b = torch.zeros(slots, n, rank, dtype=self.dtype, device=self.device)
        if getattr(linear, "absorbed_heads", None) is None:
            return LoRAWeights(a, b, starts)
        heads, nope = linear.absorbed_heads  # kv_b_proj under latent attention
        v = n // heads - nope

        def zeros(*shape):
            return torch.zeros(*shape, dtype=self.dtype, device=self.device)

        return LatentLoRAWeights(a, b, starts, heads, nope, zeros(slots, k, rank), zeros(slots * heads, 1, rank, nope),
                                 zeros(slots * heads, v, rank))

    def start_read(self, read_id: int, adapter: LoRAAdapter) -> None:
        """Reads the adapter's parts into the host cache on a thread of the pool; returns at once."""
        future = self._pool.submit(self._read, adapter)
        self.cache[adapter.request.id] = future
        with self._reads_lock:
            self._reads[read_id] = future

    def evict(self, adapter_id: int) -> None:
        """Drops the adapter's parts from the host cache (a read still running finishes into nothing)."""
        self.cache.pop(adapter_id, None)

    def take_reads(self) -> dict[int, str | None]:
        """The reads finished since the last call: read id -> None, or why it failed."""
        with self._reads_lock:
            done = {read_id: future for read_id, future in self._reads.items() if future.done()}
            for read_id in done:
                del self._reads[read_id]
        errors = {read_id: future.exception() for read_id, future in done.items()}
        return {read_id: None if e is None else f"{type(e).__name__}: {e}" for read_id, e in errors.items()}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts the adapter into the slot (in the step's order on the device: after the steps before it). If its
        files cannot be read now, the slot is left empty (zeros) with the error in `load_errors`: a request in that
        slot then fails (ModelRunner.check_lora_slots) rather than run with what the slot held before, and the
        step's other loads still happen."""
        self.slots[slot] = None
        for weights in self.weights.values():
            weights.a[slot].zero_()
            weights.b[slot].zero_()
            weights.refresh(slot)
        try:
            parts = self._parts(adapter)
        except Exception as e:  # noqa: BLE001 - logged, and the requests of this slot fail with it
            logger.exception("LoRA adapter %r failed to load into slot %d", adapter.request.name, slot)
            self.load_errors[slot] = f"adapter {adapter.request.name!r} failed to load: {type(e).__name__}: {e}"
            return
        self.load_errors.pop(slot, None)
        non_blocking = self.device.type == "cuda"
        for part in parts:
            r = part.a.shape[0]
            part.weights.a[slot, part.index, :r].copy_(part.a, non_blocking=non_blocking)
            part.weights.b[slot, part.rows, :r].copy_(part.b, non_blocking=non_blocking)
        for weights in self.weights.values():
            weights.refresh(slot)
        self.slots[slot] = adapter.request.id

    def _parts(self, adapter: LoRAAdapter) -> list[_Part]:
        """The adapter's parts for this rank from the host cache, where the driver has them read ahead (it puts an
        adapter in a slot only once every rank has read it); else read now, in the step (not cached)."""
        future = self.cache.get(adapter.request.id)
        if future is None:
            logger.warning("LoRA adapter %r was not read ahead: reading it in the step", adapter.request.name)
            return self._read(adapter)
        return future.result()

    def _read(self, adapter: LoRAAdapter) -> list[_Part]:
        request = adapter.request
        if before_read is not None:
            before_read(adapter)
        tensors = load_file(os.path.join(request.path, WEIGHTS_FILE))
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            parsed = parse_tensor_name(name)
            if (parsed is None or parsed[1] not in self.modules or parsed[0] >= len(self.layers)
                    or any(f"{parsed[0]}.{self.paths[m][0]}" not in self.weights
                           for m in _FUSED.get(parsed[1], (parsed[1],)))):
                raise ValueError(f"adapter {request.name!r}: tensor {name!r} has no LoRA slot in this model")
            in_features, out_features = self.modules[parsed[1]]
            expected = (adapter.rank, in_features) if parsed[2] == "A" else (out_features, adapter.rank)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"adapter {request.name!r}: tensor {name!r} has shape {tuple(tensor.shape)}, the "
                                 f"base model needs {expected}")
            pairs.setdefault(parsed[:2], {})[parsed[2]] = tensor
        parts = []
        for (layer, module), pair in sorted(pairs.items()):
            a, b = pair["A"].float(), pair["B"].float() * adapter.scaling  # b: [out, r]
            for name, b_rows in self._unfused(layer, module, b):
                parts.append(self._part(layer, name, a, b_rows))
        return parts

    def _unfused(self, layer: int, module: str, b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(module, its B) of a checkpoint module: itself, or a fused module's parts (B's rows cut in order)."""
        if module not in _FUSED:
            return [(module, b)]
        linear = self.layers[layer].get_submodule(self.paths[_FUSED[module][0]][0])
        sizes = ((linear.num_heads * linear.head_dim, linear.num_kv_heads * linear.head_dim,
                  linear.num_kv_heads * linear.head_dim) if module == "qkv_proj" else (b.shape[0] // 2,) * 2)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [(name, b[start:start + size]) for name, start, size in zip(_FUSED[module], starts, sizes)]

    def _part(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor) -> _Part:
        """One module's pair, cut to this rank, cast (and pinned on a GPU)."""
        path, index, shard_id = self.paths[module]
        linear = self.layers[layer].get_submodule(path)
        if isinstance(linear, RowParallelLinear):
            a, rows = a[:, linear.shard().src_cols], slice(None)
        else:
            shard = linear.shard(shard_id)
            b, rows = b[shard.src_rows], shard.dst
        a, b = a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous()
        if self.device.type == "cuda":
            a, b = a.pin_memory(), b.pin_memory()
        return _Part(self.weights[f"{layer}.{path}"], index, rows, a, b)


def _submodule(layer: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None
