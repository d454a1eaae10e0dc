"""Phi-3: the Llama decoder whose checkpoint already fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`), with
longrope scaling (workers/models/llama.py's rope_settings, kernels/rope_scaling.py) and, in the 4k models, a
sliding window over every layer.

A fused checkpoint tensor is loaded as its parts, each through a row range of the tensor, so a rank still reads
only its own heads' and its own intermediate slice's rows.
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
        cfg = self.hf_config
        if name.endswith(".self_attn.qkv_proj.weight"):
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            q_rows = cfg["num_attention_heads"] * head_dim
            kv_rows = (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * head_dim
            assert loaded_shape(loaded)[0] == q_rows + 2 * kv_rows, (
                f"{name}: expected {q_rows + 2 * kv_rows} rows, loaded {loaded_shape(loaded)}")
            for shard_id, start, rows in (("q", 0, q_rows), ("k", q_rows, kv_rows), ("v", q_rows + kv_rows, kv_rows)):
                yield name, RowRange(loaded, start, rows), shard_id
        elif name.endswith(".mlp.gate_up_proj.weight"):
            inter = cfg["intermediate_size"]
            assert loaded_shape(loaded)[0] == 2 * inter, f"{name}: expected {2 * inter} rows, loaded {loaded_shape(loaded)}"
            yield name, RowRange(loaded, 0, inter), 0
            yield name, RowRange(loaded, inter, inter), 1
        else:
            yield from super().checkpoint_entries(name, loaded)
