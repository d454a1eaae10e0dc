"""LoRA in the workers: the shrink / expand references against a per-token loop, the fused linears (q/k/v and gate/up
slices, row-parallel) against W x + B A x token by token, loading into slots (a reloaded slot holds only its new
adapter), and tensor parallelism: two gloo ranks with their slices of A or B give the unsharded model's logits."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from engine.config import LoRAConfig
from engine.lora import LoRARequest, read_adapter
from kernels.lora import lora_expand, lora_shrink
from workers.lora import LoRAManager, LoRAWeights

PROMPTS = [[5, 17, 42, 99, 300, 7, 8], [600, 2, 31], [9, 10, 11, 12, 13]]
SLOTS = [0, -1, 1]


def _per_token(x, a, b, slots, starts):
    """sum over slices of B[slot, cols_i] @ A[slot, i] @ x, one token at a time (float64)."""
    n = b.shape[1]
    out = torch.zeros(x.shape[0], n, dtype=torch.float64)
    ends = list(starts[1:]) + [n]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for i, (start, end) in enumerate(zip(starts, ends)):
            out[t, start:end] = b[slot, start:end].double() @ (a[slot, i].double() @ x[t].double())
    return out


@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_shrink_and_expand_equal_a_per_token_loop(num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    num_slots, rank, k, starts, n = 3, 16, 24, (0, 12, 20), 28
    x = torch.randn(num_tokens, k, generator=generator)
    a = torch.randn(num_slots, len(starts), rank, k, generator=generator)
    b = torch.randn(num_slots, n, rank, generator=generator)
    a[1, :, 8:] = 0  # a rank-8 adapter, zero-padded to 16
    b[1, :, 8:] = 0
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=generator, dtype=torch.int32)
    y = lora_shrink(x, a, slots)
    assert y.shape == (len(starts), num_tokens, rank) and y.dtype == torch.float32
    assert torch.all(y[:, slots < 0] == 0)
    base = torch.randn(num_tokens, n, generator=generator)
    out = base.clone()
    lora_expand(out, y, b, slots, starts)
    torch.testing.assert_close(out.double(), base.double() + _per_token(x, a, b, slots, starts), atol=1e-4, rtol=1e-4)
    assert torch.equal(out[slots < 0], base[slots < 0])


def _with_slots(linear, num_slots, rank, starts, k, n, generator):
    linear.weight.data.normal_(generator=generator)
    linear.lora = LoRAWeights(torch.randn(num_slots, len(starts), rank, k, generator=generator),
                              torch.randn(num_slots, n, rank, generator=generator), starts)
    return linear


def test_fused_linears_add_each_tokens_adapter(tp_state):
    from kernels.activation import silu_and_mul
    from workers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    generator = torch.Generator().manual_seed(0)
    tokens, hidden, inter = 6, 16, 12
    x = torch.randn(tokens, hidden, generator=generator)
    slots = torch.tensor([0, -1, 2, 1, 0, -1], dtype=torch.int32)
    qkv = _with_slots(QKVParallelLinear(hidden, 4, 4, 2), 3, 8, (0, 16, 24), hidden, 32, generator)
    gate_up = _with_slots(MergedColumnParallelLinear(hidden, [inter, inter]), 3, 8, (0, inter), hidden, 2 * inter,
                          generator)
    down = _with_slots(RowParallelLinear(inter, hidden), 3, 8, (0,), inter, hidden, generator)
    for layer, inp in ((qkv, x), (gate_up, x), (down, x[:, :inter])):
        expected = inp.double() @ layer.weight.double().T + _per_token(inp, layer.lora.a, layer.lora.b, slots,
                                                                      layer.lora.slice_starts)
        torch.testing.assert_close(layer(inp, lora_slots=slots).double(), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer(inp).double(), inp.double() @ layer.weight.double().T, atol=1e-4, rtol=1e-4)
    gated = gate_up(x, gated=True, lora_slots=slots)
    torch.testing.assert_close(gated, silu_and_mul(gate_up(x, lora_slots=slots)))
    assert not gate_up.takes_quantized_rows


def _adapters(model_dir: str, root: Path) -> list[LoRARequest]:
    from tests.lora_adapters import make_adapter

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return [LoRARequest("every", 1, make_adapter(model_dir, str(root / "every"), 16, 32.0, every, seed=1)),
            LoRARequest("qv-down", 2, make_adapter(model_dir, str(root / "qv-down"), 8, 8.0,
                                                   ["q_proj", "v_proj", "down_proj"], seed=2, use_rslora=True))]


def _paged_sequences_class():
    spec = importlib.util.spec_from_file_location("_workers_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PagedSequences


def _logits(model, lora_slots) -> torch.Tensor:
    seqs = _paged_sequences_class()(model, num_seqs=len(PROMPTS))
    prefill = seqs.step([p[:-1] for p in PROMPTS], lora_slots)
    decode = seqs.step([p[-1:] for p in PROMPTS], lora_slots)
    return None if prefill is None else torch.cat([prefill, decode])


def _load(model_dir: str, loras: list[LoRARequest], max_loras: int = 2):
    """The tiny model with a LoRAManager, adapter i read into its host cache in the background (as the driver's
    SchedulerOutput.lora_reads has it) and then loaded into slot i % max_loras."""
    from workers.weights import load_model

    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    model = load_model(hf_config, model_dir, torch.float32, "cpu")
    manager = LoRAManager(model, LoRAConfig(max_loras=max_loras, max_lora_rank=16), hf_config, torch.float32, "cpu")
    adapters = [read_adapter(lora, hf_config, 16) for lora in loras]
    for read_id, adapter in enumerate(adapters):
        manager.start_read(read_id, adapter)
    reads: dict[int, str | None] = {}
    for adapter in adapters:
        manager.cache[adapter.request.id].result()  # (a test may wait; the engine polls take_reads)
    reads.update(manager.take_reads())
    assert reads == dict.fromkeys(range(len(adapters))), reads
    for i, adapter in enumerate(adapters):
        manager.load(i % max_loras, adapter)
    return model, manager


def test_slots_match_peft_and_a_reloaded_slot_holds_only_its_adapter(tiny_model_dir, tmp_path):
    from tests.hf_oracle import hf_logprobs
    from tests.lora_adapters import peft_model

    loras = _adapters(tiny_model_dir, tmp_path)
    model, manager = _load(tiny_model_dir, loras)
    logits = _logits(model, SLOTS)
    # the sequence in slot 0, prefill and decode rows, against transformers + peft
    ref = torch.exp(hf_logprobs(peft_model(tiny_model_dir, loras[0].path), PROMPTS[0]))
    mine = torch.softmax(torch.cat([logits[:len(PROMPTS[0]) - 1], logits[-3:-2]]), -1)
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-4)
    # slot 0 reloaded with the other adapter: exactly as if it had been loaded there first
    manager.load(0, read_adapter(loras[1], _config(tiny_model_dir), 16))
    fresh, _ = _load(tiny_model_dir, [loras[1]])
    torch.testing.assert_close(_logits(model, [0, -1, 0]), _logits(fresh, [0, -1, 0]), atol=0, rtol=0)
    assert set(manager.cache) == {loras[0].id, loras[1].id} and manager.slots == [2, 2]
    assert manager.take_reads() == {}  # each read is reported once
    manager.evict(loras[0].id)  # the driver's LRU dropped it: gone from host memory, the slots keep what they hold
    assert set(manager.cache) == {loras[1].id} and manager.slots == [2, 2]
    manager.load(0, read_adapter(loras[0], _config(tiny_model_dir), 16))  # not read ahead: read in the step
    assert set(manager.cache) == {loras[1].id} and manager.slots == [1, 2]
    torch.testing.assert_close(_logits(model, SLOTS), logits, atol=0, rtol=0)


def test_a_failed_background_read_is_reported_and_its_slot_stays_empty(tiny_model_dir, tmp_path):
    loras = _adapters(tiny_model_dir, tmp_path)
    _, manager = _load(tiny_model_dir, loras[:1], max_loras=2)
    adapter = read_adapter(loras[1], _config(tiny_model_dir), 16)  # checked, then its file goes
    os.remove(os.path.join(loras[1].path, "adapter_model.safetensors"))
    manager.start_read(5, adapter)
    with pytest.raises(FileNotFoundError):
        manager.cache[adapter.request.id].result()
    error = manager.take_reads()[5]
    assert error is not None and error.startswith("FileNotFoundError")
    manager.load(1, adapter)  # (the driver never loads a failed read; if it did, the slot is empty and says why)
    assert manager.slots == [1, None] and "failed to load" in manager.load_errors[1]


def _config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _rank_main(rank, model_dir, loras, init_method, out_dir):
    from workers import parallel

    torch.set_num_threads(1)
    parallel.init_parallel(rank, 2, backend="gloo", init_method=init_method)
    try:
        model, _ = _load(model_dir, loras)
        torch.save(_logits(model, SLOTS), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel.destroy_parallel()


def test_tp2_matches_tp1(tiny_model_dir, tmp_path):
    """Column-parallel layers hold their rows of B, row-parallel ones their columns of A, whose partial deltas the
    all-reduce sums: rank 0's logits equal the unsharded model's."""
    loras = _adapters(tiny_model_dir, tmp_path)
    model, _ = _load(tiny_model_dir, loras)
    expected = _logits(model, SLOTS)
    assert not torch.allclose(expected, _logits(model, None), atol=1e-2)  # the adapters do change the logits
    mp.start_processes(_rank_main, args=(tiny_model_dir, loras, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)),
                       nprocs=2, start_method="spawn")
    assert torch.load(tmp_path / "rank1.pt") is None
    torch.testing.assert_close(torch.load(tmp_path / "rank0.pt"), expected, atol=1e-4, rtol=1e-4)


def test_input_buffers_sort_the_rows_by_slot_after_padding():
    """The step's lora_order (the LoRA kernels' tiles, kernels/lora.py `order`): the rows, padding included, sorted
    by slot, stable, beside the slots themselves; the base-only metadata carries neither."""
    from workers.inputs import InputBuffers

    buffers = InputBuffers(max_tokens=16, max_seqs=8, max_blocks_per_seq=4, block_size=4, device=torch.device("cpu"),
                           has_lora=True)
    slots = [2, -1, 0, 2, 1]
    num_tokens, cols = buffers.fill([[7]] * 5, [0] * 5, [1] * 5, [[i] for i in range(5)], slots)
    buffers.pad_decode(num_tokens, 8)
    buffers.copy_to_device(8, 8, cols)
    _, _, meta = buffers.metadata(8, 8, 1, cols)
    assert meta.lora_slots.tolist() == slots + [-1] * 3
    assert meta.lora_order.tolist() == [1, 5, 6, 7, 2, 4, 0, 3]
    _, _, base = buffers.metadata(8, 8, 1, cols, use_lora=False)
    assert base.lora_slots is None and base.lora_order is None


@pytest.mark.parametrize("use_kernel", [False, True], ids=["reference", "triton-interpreter"])
def test_latent_lora_folds_kv_b_proj_delta_per_token_and_head(monkeypatch, use_kernel):
    """DeepSeek-V2's kv_b_proj slots (LatentLoRAWeights): q_lat += q_nope (B_K[h] A) and out += out_lat (B_V[h] A)^T
    for each token's adapter, base rows (-1) unchanged, against the definition token by token and head by head;
    through the torch references and through the Triton kernels under the interpreter (the GPU's path: the
    per-head rows and layouts the kernels check)."""
    import functools

    import workers.lora as lora_module
    from workers.lora import LatentLoRAWeights

    if use_kernel:
        monkeypatch.setattr(lora_module, "lora_shrink", functools.partial(lora_shrink, use_kernel=True))
        monkeypatch.setattr(lora_module, "lora_expand", functools.partial(lora_expand, use_kernel=True))
    torch.manual_seed(0)
    num_slots, heads, nope, v, latent, rank = 2, 3, 16, 8, 32, 8
    a = torch.randn(num_slots, 1, rank, latent)
    b = torch.randn(num_slots, heads * (nope + v), rank)

    def zeros(*shape):
        return torch.zeros(*shape)

    w = LatentLoRAWeights(a, b, (0,), heads, nope, zeros(num_slots, latent, rank),
                          zeros(num_slots * heads, 1, rank, nope), zeros(num_slots * heads, v, rank))
    for slot in range(num_slots):
        w.refresh(slot)
    slots = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    q_nope, out_lat = torch.randn(4, heads, nope), torch.randn(4, heads, latent)
    q_lat, out = torch.randn(4, heads, latent), torch.randn(4, heads, v)
    want_q, want_out = q_lat.clone().double(), out.clone().double()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        per_head = b[s].view(heads, nope + v, rank).double()
        for h in range(heads):
            want_q[t, h] += q_nope[t, h].double() @ per_head[h, :nope] @ a[s, 0].double()
            want_out[t, h] += per_head[h, nope:] @ (a[s, 0].double() @ out_lat[t, h].double())
    rows = w.row_slots(slots)
    w.absorb_query(q_lat, q_nope, rows)
    w.absorb_output(out, out_lat, rows)
    assert torch.allclose(q_lat.double(), want_q, atol=1e-3) and torch.allclose(out.double(), want_out, atol=1e-3)
