"""Each tensor-parallel rank's slice of quantized experts, built and loaded as rank r of 2 without a process group
(`tp_state`): dequantized, its w13 is its rows of every expert's gate and up in the one-rank model, its w2 the same
columns of every down (int: whole groups, g_idx renumbered from the rank's first group, or every group under
act-order; FP8 checkpoints: whole scale blocks). Online FP8 quantizes each rank's own slice: its down's scales are
its K half's. Slices that split a group or a scale block are refused when the layer is built, on every rank."""

import json
import os

import pytest
import torch

from checkpoints import int4_rtn as ic
from engine.quantization import resolve_quantization
from kernels.fp8 import dequantize_weight, quantize_weight
from tests import fp8_oracle
from tests.engine.test_moe_int4 import moe_int4_factory
from workers.layers.moe import FusedMoE
from workers.layers.moe_quant import quantized_experts
from workers.weights import load_model


@pytest.fixture(scope="module")
def moe_int4(tmp_path_factory):
    return moe_int4_factory(tmp_path_factory)


def _config(path: str, quantization: str | None = None) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def dequantized_experts(tp_state, path: str, rank: int, world_size: int, quantization: str | None = None):
    """[(w13 [E, 2 I / tp, H], w2 [E, H, I / tp])] per MoE layer of rank `rank`'s shard, float32."""
    tp_state(rank, world_size)
    config = _config(path)
    model = load_model(config, path, torch.float32, "cpu", quant_config=resolve_quantization(quantization, config))
    layers = []
    for module in model.modules():
        if isinstance(module, FusedMoE):
            layers.append(tuple(torch.stack([p.dequantize(e, torch.float32) for e in range(p.num_experts)])
                                for p in quantized_experts(module)))
    return layers


def assert_rank_slices(full, shards) -> None:
    for (w13, w2), *ranks in zip(full, *shards):
        gate, up = w13.chunk(2, dim=1)
        for r, (w13_r, w2_r) in enumerate(ranks):
            rows = slice(r * w2_r.shape[2], (r + 1) * w2_r.shape[2])
            assert torch.equal(w13_r, torch.cat([gate[:, rows], up[:, rows]], dim=1))
            assert torch.equal(w2_r, w2[:, :, rows])


@pytest.mark.parametrize("arch, fmt", [("mixtral", ic.Int4Format("gptq", 32)), ("qwen2_moe", ic.Int4Format("awq", 32)),
                                       ("qwen3_moe", ic.Int4Format("pack-quantized", 32, desc_act=True)),
                                       ("mixtral", ic.Int4Format("gptq", -1, bits=8, sym=True))], ids=str)
def test_int_expert_slices_are_the_one_rank_experts(moe_int4, tp_state, arch, fmt):
    """GPTQ g32 without act-order: each rank its own 4 groups of down's 128 columns (Mixtral's intermediate 256)."""
    dst, _ = moe_int4(arch, fmt)
    full = dequantized_experts(tp_state, dst, 0, 1)
    assert_rank_slices(full, [dequantized_experts(tp_state, dst, r, 2) for r in range(2)])


def test_fp8_checkpoint_slices_are_the_one_rank_experts(tiny_checkpoints, tmp_path, tp_state):
    path, _, _ = fp8_oracle.write_fp8_checkpoint(tiny_checkpoints["qwen2_moe"], str(tmp_path / "ct"), "ct-channel")
    full = dequantized_experts(tp_state, path, 0, 1)
    assert_rank_slices(full, [dequantized_experts(tp_state, path, r, 2) for r in range(2)])


def test_online_fp8_quantizes_each_ranks_slice(tiny_checkpoints, tp_state):
    """Gate and up rows have one scale at any tp; down's rows a scale per rank's K half."""
    from safetensors.torch import load_file

    path = tiny_checkpoints["mixtral"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    full = dequantized_experts(tp_state, path, 0, 1, "fp8")
    for r in range(2):
        (w13_r, w2_r), _ = dequantized_experts(tp_state, path, r, 2, "fp8")
        gate, up = full[0][0].chunk(2, dim=1)
        rows = slice(r * w2_r.shape[2], (r + 1) * w2_r.shape[2])
        assert torch.equal(w13_r, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        for e in range(w2_r.shape[0]):
            down = tensors[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"][:, rows]
            assert torch.equal(w2_r[e], dequantize_weight(*quantize_weight(down)))
        assert not torch.equal(w2_r, full[0][1][:, :, rows])  # not the one-rank scales


@pytest.mark.parametrize("qc, inter, message", [
    (ic.Int4Format("gptq", 64).quantization_config(), 64,
     "tensor_parallel_size 2: this rank's 32 expert intermediate features are not whole groups of group_size 64"),
    ({"quant_method": "fp8", "weight_block_size": [16, 32]}, 32,
     r"this rank's 16 expert intermediate columns of w2 are not whole scale blocks of weight_block_size \[16, 32\]"),
    (ic.Int4Format("awq", 32).quantization_config(), 8,
     "this rank's 4 expert intermediate features do not fill whole int32s of 8 values")])
def test_slices_inside_a_group_or_block_are_refused(tp_state, qc, inter, message):
    """Built as rank 0 of 2 (rank 0's slice starts on a boundary: still refused, as on every rank)."""
    from workers.layers.quantization import quantized_layers

    config = resolve_quantization(None, {"quantization_config": qc})
    tp_state(0, 2)
    with quantized_layers(config), pytest.raises(ValueError, match=message):
        FusedMoE(4, 128, inter)
