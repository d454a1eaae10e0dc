"""Weight loading: sharded checkpoints, per-rank tensor-parallel slices, random weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from checkpoints.tiny import make_tiny_model
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.models import get_model_class
from workers.models.args import ModelArgs
from workers.models.llama import LlamaForCausalLM
from workers.weights import iterate_weights, load_model, safetensors_files


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("sharded")), "llama", seed=3, max_shard_size="100KB")
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    full = {}
    for file in safetensors_files(path):
        full.update(load_file(file))
    return path, hf_config, full


class RecordingSlice:
    """Wraps a safetensors slice and records which regions were read."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.log.append(index)
        return self.inner[index]


def _load_rank(path, hf_config, rank, tp_size, tp_state, reads=None):
    tp_state(rank, tp_size)
    model = get_model_class(hf_config)(ModelArgs.from_hf_config(hf_config), torch.float32, "cpu")
    weights = iterate_weights(path)
    if reads is not None:
        weights = ((name, RecordingSlice(s, reads.setdefault(name, []))) for name, s in weights)
    model.load_weights(weights)
    return dict(model.named_parameters())


def test_sharded_checkpoint_is_read_through_the_index(sharded):
    path, hf_config, full = sharded
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len(safetensors_files(path)) > 1
    assert {name for name, _ in iterate_weights(path)} == set(full)
    params = dict(load_model(hf_config, path, torch.float32, "cpu").named_parameters())
    layer = "model.layers.1"
    torch.testing.assert_close(params[f"{layer}.self_attn.qkv_proj.weight"], torch.cat(
        [full[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]), rtol=0, atol=0)
    torch.testing.assert_close(params[f"{layer}.mlp.gate_up_proj.weight"], torch.cat(
        [full[f"{layer}.mlp.gate_proj.weight"], full[f"{layer}.mlp.up_proj.weight"]]), rtol=0, atol=0)
    for name in ("model.norm.weight", "lm_head.weight", f"{layer}.input_layernorm.weight"):
        assert torch.equal(params[name], full[name])


def test_tp2_ranks_hold_complementary_slices(sharded, tp_state):
    path, hf_config, full = sharded
    reads: dict[str, list] = {}
    ranks = [_load_rank(path, hf_config, rank, 2, tp_state, reads) for rank in range(2)]
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    q, k, v = (full[f"{attn}.{p}_proj.weight"] for p in "qkv")  # q [64, 64], k v [32, 64]
    for rank, params in enumerate(ranks):
        qkv = params[f"{attn}.qkv_proj.weight"]  # [2 heads * 16 + 2 * (1 kv head * 16), 64]
        assert torch.equal(qkv, torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]]))
        gate_up = params[f"{mlp}.gate_up_proj.weight"]
        assert torch.equal(gate_up, torch.cat([full[f"{mlp}.gate_proj.weight"].chunk(2)[rank],
                                               full[f"{mlp}.up_proj.weight"].chunk(2)[rank]]))
    for name, dim in ((f"{attn}.o_proj.weight", 1), (f"{mlp}.down_proj.weight", 1),
                      ("model.embed_tokens.weight", 0), ("lm_head.weight", 0)):
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=dim), full[name]), name
    assert torch.equal(ranks[1]["model.norm.weight"], full["model.norm.weight"])
    # Each rank read only its own half of every split tensor, never the whole tensor.
    expected_rows = {f"{attn}.q_proj.weight": 32, f"{attn}.k_proj.weight": 16, "model.embed_tokens.weight": 500}
    for name, rows in expected_rows.items():
        assert [(i.stop - i.start) for i in reads[name]] == [rows, rows], name
    for index in reads[f"{mlp}.down_proj.weight"]:
        assert index[0] == slice(None) and index[1].stop - index[1].start == 64


def test_tp4_replicates_kv_heads(sharded, tp_state):
    """2 KV heads on 4 ranks: ranks 0, 1 hold KV head 0 and ranks 2, 3 hold KV head 1."""
    path, hf_config, full = sharded
    attn = "model.layers.1.self_attn"
    q, k, v = (full[f"{attn}.{p}_proj.weight"] for p in "qkv")
    for rank in range(4):
        qkv = _load_rank(path, hf_config, rank, 4, tp_state)[f"{attn}.qkv_proj.weight"]
        kv_head = rank * 2 // 4
        expected = torch.cat([q.chunk(4)[rank], k.chunk(2)[kv_head], v.chunk(2)[kv_head]])
        assert torch.equal(qkv, expected), rank


def _checkpoint(tmp_path, arch):
    path = make_tiny_model(str(tmp_path / arch), arch, seed=5)
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    return path, hf_config, load_file(os.path.join(path, "model.safetensors"))


def _rows_read(indexes) -> list[tuple[int, int]]:
    return [(i.start, i.stop) if isinstance(i, slice) else (i[0].start, i[0].stop) for i in indexes]


def test_phi3_fused_tensors_are_read_per_rank(tmp_path, tp_state):
    """Phi-3 stores qkv_proj and gate_up_proj fused: each rank reads its heads' rows of q, k and v and its half of
    gate and of up, through row ranges of the one tensor."""
    path, hf_config, full = _checkpoint(tmp_path, "phi3")
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    q, k, v = full[f"{attn}.qkv_proj.weight"].split([64, 32, 32])
    gate, up = full[f"{mlp}.gate_up_proj.weight"].chunk(2)
    for rank in range(2):
        reads: dict[str, list] = {}
        params = _load_rank(path, hf_config, rank, 2, tp_state, reads)
        assert torch.equal(params[f"{attn}.qkv_proj.weight"],
                           torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]]))
        assert torch.equal(params[f"{mlp}.gate_up_proj.weight"], torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))
        assert _rows_read(reads[f"{attn}.qkv_proj.weight"]) == [(32 * rank, 32 * rank + 32),
                                                                (64 + 16 * rank, 80 + 16 * rank),
                                                                (96 + 16 * rank, 112 + 16 * rank)]
        assert _rows_read(reads[f"{mlp}.gate_up_proj.weight"]) == [(64 * rank, 64 * rank + 64),
                                                                   (128 + 64 * rank, 192 + 64 * rank)]


@pytest.mark.parametrize("arch,prefix,names,inter", [
    ("mixtral", "block_sparse_moe", ("w1", "w3", "w2"), 128),
    ("qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj"), 32)])
def test_experts_split_their_intermediate_dimension(arch, prefix, names, inter, tmp_path, tp_state):
    path, hf_config, full = _checkpoint(tmp_path, arch)
    layer = "model.layers.1"
    gate_name, up_name, down_name = (f"{layer}.{prefix}.experts.{{}}.{n}.weight" for n in names)
    for rank in range(2):
        reads: dict[str, list] = {}
        params = _load_rank(path, hf_config, rank, 2, tp_state, reads)
        w13, w2 = params[f"{layer}.mlp.experts.w13_weight"], params[f"{layer}.mlp.experts.w2_weight"]
        assert w13.shape == (4, inter, 64) and w2.shape == (4, 64, inter // 2)
        for e in range(4):
            assert torch.equal(w13[e], torch.cat([full[gate_name.format(e)].chunk(2)[rank],
                                                  full[up_name.format(e)].chunk(2)[rank]]))
            assert torch.equal(w2[e], full[down_name.format(e)].chunk(2, dim=1)[rank])
            assert _rows_read(reads[gate_name.format(e)]) == [(rank * inter // 2, (rank + 1) * inter // 2)]
        assert torch.equal(params[f"{layer}.mlp.gate.weight"], full[f"{layer}.{prefix}.gate.weight"])  # replicated
    if arch == "qwen2_moe":
        shared = params[f"{layer}.mlp.shared_expert.down_proj.weight"]
        assert torch.equal(shared, full[f"{layer}.mlp.shared_expert.down_proj.weight"].chunk(2, dim=1)[1])


def test_vocab_that_does_not_divide_is_padded(tp_state):
    full = torch.randn(1000, 8)
    parts = []
    for rank in range(3):
        tp_state(rank, 3)
        embedding = VocabParallelEmbedding(1000, 8)
        embedding.weight.weight_loader(embedding.weight, full)
        assert embedding.weight.shape == (334, 8)
        parts.append(embedding.weight.data)
    assert torch.equal(torch.cat(parts)[:1000], full)
    assert torch.equal(parts[2][332:], torch.zeros(2, 8))


def test_lm_head_logits_drop_the_padding(tp_state):
    tp_state(0, 1)
    head = ParallelLMHead(10, 4)
    head.weight.weight_loader(head.weight, torch.randn(10, 4))
    hidden = torch.randn(3, 4)
    logits = head.compute_logits(hidden)
    assert logits.shape == (3, 10) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ head.weight.T)


def test_missing_and_unknown_weights_are_reported(sharded):
    path, hf_config, full = sharded
    model = LlamaForCausalLM(ModelArgs.from_hf_config(hf_config), torch.float32, "cpu")
    partial = [(n, t) for n, t in full.items() if n != "model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"qkv_proj.weight\[k\]"):
        model.load_weights(partial)
    with pytest.raises(ValueError, match="no parameter"):
        model.load_weights([("model.layers.9.foo.weight", torch.zeros(1))])


def test_random_weights_are_deterministic_and_scaled(sharded):
    _, hf_config, _ = sharded
    a = dict(load_model(hf_config, None, torch.float32, "cpu", load_format="random", seed=5).named_parameters())
    b = dict(load_model(hf_config, None, torch.float32, "cpu", load_format="random", seed=5).named_parameters())
    c = dict(load_model(hf_config, None, torch.float32, "cpu", load_format="random", seed=6).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    std = a["model.layers.0.mlp.gate_up_proj.weight"].std().item()
    assert abs(std - hf_config["initializer_range"]) < 0.02
