"""Phi-3: the Llama decoder whose checkpoint already fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`), with
longrope scaling (workers/models/args.py's rope_settings, kernels/rope_scaling.py) and, in the 4k models, a
sliding window over every layer.

A fused checkpoint tensor is loaded as its parts, each through a row range of the tensor, so a rank still reads
only its own heads' and its own intermediate slice's rows; an FP8 checkpoint's scales of such a tensor are split
the same way (per row, per block of rows, or one for the whole tensor that every part takes), and an AWQ / GPTQ /
pack-quantized checkpoint's packed tensors along their N dimension (on int32 boundaries where N is packed).
"""

from __future__ import annotations

from typing import Iterator

from workers.layers.linear import loaded_shape
from workers.models.llama import LlamaForCausalLM


class RowRange:
    """Rows [start, start + length) of a safetensors slice or tensor (`axis` 1: its columns), indexed as one
    (`[a:b]`, `[:, a:b]`, `[a:b, c:d]`)."""

    def __init__(self, loaded, start: int, length: int, axis: int = 0):
        self.loaded, self.start, self.length, self.axis = loaded, start, length, axis

    def get_shape(self) -> list[int]:
        shape = list(loaded_shape(self.loaded))
        shape[self.axis] = self.length
        return shape

    def __getitem__(self, index):
        index = list(index) if isinstance(index, tuple) else [index]
        index += [slice(None)] * (self.axis + 1 - len(index))
        first, stop, step = index[self.axis].indices(self.length)
        assert step == 1, f"RowRange takes contiguous slices, got {index[self.axis]}"
        index[self.axis] = slice(self.start + first, self.start + stop)
        return self.loaded[tuple(index)]


_INT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # AWQ's and GPTQ's names (pack-quantized's renamed)


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_entries(self, name: str, loaded) -> Iterator[tuple[str, object, object]]:
        parts = self._fused_parts(name)
        if parts is None:
            yield from super().checkpoint_entries(name, loaded)
            return
        total = sum(rows for _, _, rows in parts)
        if name.rpartition(".")[2] in _INT_TENSORS:
            yield from self._int_entries(name, loaded, parts)
            return
        if name.endswith(".weight"):
            assert loaded_shape(loaded)[0] == total, f"{name}: expected {total} rows, loaded {loaded_shape(loaded)}"
            for shard_id, start, rows in parts:
                yield name, RowRange(loaded, start, rows), shard_id
            return
        # An FP8 checkpoint's scales of a fused tensor: one for the whole tensor (every part takes it), one per
        # row, or one per block of rows (the parts must start on block boundaries).
        shape = loaded_shape(loaded)
        if all(d == 1 for d in shape):
            for shard_id, _, _ in parts:
                yield name, loaded, shard_id
            return
        block_rows = 1
        if shape[0] != total:  # the blocks of the fused layer's scales (its QuantConfig.block_size)
            block_size = getattr(self.get_submodule(name.rpartition(".")[0]), "block_size", None)
            block_rows = block_size[0] if block_size else 0
            if not block_rows or shape[0] != -(-total // block_rows):
                raise ValueError(f"{name}: {shape[0]} scale rows fit neither the {total} rows nor their blocks")
        for shard_id, start, rows in parts:
            if start % block_rows:
                raise ValueError(f"{name}: the fused tensor's part {shard_id!r} starts at row {start}, inside a "
                                 f"{block_rows}-row scale block")
            yield name, RowRange(loaded, start // block_rows, -(-rows // block_rows)), shard_id

    def _int_entries(self, name: str, loaded, parts) -> Iterator[tuple[str, object, object]]:
        """An int checkpoint's fused tensor (AWQ / GPTQ / pack-quantized: the tool packed q/k/v or gate/up as one
        linear) split along N into its parts: columns of AWQ's and GPTQ's [K-ish, N-ish] tensors, rows of
        compressed-tensors' N-first ones, in the tensor's own units of N (an int32 of p values for AWQ's qweight
        and every qzeros); each part must start on such a boundary. g_idx, over K, is every part's."""
        suffix = name.rpartition(".")[2]
        if suffix == "g_idx":
            for shard_id, _, _ in parts:
                yield name, loaded, shard_id
            return
        layer = self.get_submodule(name.rpartition(".")[0])
        packing = layer.packing
        packed_n = suffix == "qzeros" or (suffix == "qweight" and not packing.is_packed_along_k)
        unit = packing.pack_factor if packed_n else 1
        for shard_id, start, rows in parts:
            if start % unit or rows % unit:
                raise ValueError(f"{name}: the fused tensor's part {shard_id!r} (output rows [{start}, "
                                 f"{start + rows})) is not whole int32s of {unit} packed values")
            yield name, RowRange(loaded, start // unit, rows // unit, axis=0 if layer.is_n_major else 1), shard_id

    def _fused_parts(self, name: str) -> list[tuple[object, int, int]] | None:
        """(shard id, first row, rows) of each part of a fused checkpoint tensor (its weight, an FP8 checkpoint's
        weight_scale / input_scale, an int checkpoint's packed tensors); None for any other tensor."""
        args = self.args
        module, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "weight_scale", "input_scale") + _INT_TENSORS:
            return None
        if module.endswith(".self_attn.qkv_proj"):
            q_rows, kv_rows = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
            return [("q", 0, q_rows), ("k", q_rows, kv_rows), ("v", q_rows + kv_rows, kv_rows)]
        if module.endswith(".mlp.gate_up_proj"):
            inter = args.intermediate_size
            return [(0, 0, inter), (1, inter, inter)]
        return None
