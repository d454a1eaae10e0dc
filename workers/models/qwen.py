"""Qwen2 and Qwen3 (dense): the Llama decoder with Qwen's attention options.

    Qwen2  q/k/v biases (no o_proj bias); tied embeddings where the config says so.
    Qwen3  no q/k/v bias (`attention_bias`), and an RMSNorm over each q and k head before RoPE.

Both slide their attention window only with use_sliding_window, in the layers >= max_window_layers (where a
transformers 5 config lists `layer_types`, those decide).
"""

from __future__ import annotations

from workers.models.args import ModelArgs
from workers.models.llama import LlamaForCausalLM, sliding_windows


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(args: ModelArgs) -> tuple[bool, bool]:
        return True, False

    @staticmethod
    def layer_windows(args: ModelArgs) -> list[int | None]:
        return sliding_windows(args, lambda i: i >= args.max_window_layers, use_by_default=False)


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    qk_norm = True

    @staticmethod
    def attention_biases(args: ModelArgs) -> tuple[bool, bool]:
        return LlamaForCausalLM.attention_biases(args)
