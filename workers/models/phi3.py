"""Phi-3: the Llama decoder whose checkpoint already fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`), with
longrope scaling (workers/models/args.py's rope_settings, kernels/rope_scaling.py) and, in the 4k models, a
sliding window over every layer.

A fused checkpoint tensor is loaded as its parts, each through a row range of the tensor, so a rank still reads
only its own heads' and its own intermediate slice's rows; an FP8 checkpoint's scales of such a tensor are split
the same way (per row, per block of rows, or one for the whole tensor that every part takes).
"""

from __future__ import annotations

from typing import Iterator

from workers.layers.linear import loaded_shape
from workers.models.llama import LlamaForCausalLM


class RowRange:
    """Rows [start, start + length) of a safetensors slice or tensor, indexed as one (`[a:b]`, `[:, a:b]`)."""

    def __init__(self, loaded, start: int, length: int):
        self.loaded, self.start, self.length = loaded, start, length

    def get_shape(self) -> list[int]:
        return [self.length, *loaded_shape(self.loaded)[1:]]

    def __getitem__(self, index):
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        first, stop, step = rows.indices(self.length)
        assert step == 1, f"RowRange takes contiguous row slices, got {rows}"
        return self.loaded[(slice(self.start + first, self.start + stop), *rest)]


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_entries(self, name: str, loaded) -> Iterator[tuple[str, object, object]]:
        parts = self._fused_parts(name)
        if parts is None:
            yield from super().checkpoint_entries(name, loaded)
            return
        total = sum(rows for _, _, rows in parts)
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

    def _fused_parts(self, name: str) -> list[tuple[object, int, int]] | None:
        """(shard id, first row, rows) of each part of a fused checkpoint tensor (its weight, or an FP8
        checkpoint's weight_scale / input_scale); None for any other tensor."""
        args = self.args
        module, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "weight_scale", "input_scale"):
            return None
        if module.endswith(".self_attn.qkv_proj"):
            q_rows, kv_rows = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
            return [("q", 0, q_rows), ("k", q_rows, kv_rows), ("v", q_rows + kv_rows, kv_rows)]
        if module.endswith(".mlp.gate_up_proj"):
            inter = args.intermediate_size
            return [(0, 0, inter), (1, inter, inter)]
        return None
