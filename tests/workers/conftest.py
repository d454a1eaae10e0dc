"""Shared fixtures for the workers tests."""

from __future__ import annotations

import pytest
import torch


class PagedSequences:
    """A few sequences, each with its own (scattered) blocks in a shared per-layer KV pool.

    `step(chunks)` runs one forward pass over the next chunk of tokens of each sequence, packed into one batch,
    exactly as the model runner would: positions continue from what is already cached.
    """

    def __init__(self, model, num_seqs: int, block_size: int = 4, num_blocks: int = 96, max_blocks: int = 24):
        self.model, self.block_size = model, block_size
        from workers.kv_pool import allocate_kv_caches

        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_caches(model.kv_layout, num_blocks, block_size, dtype, torch.device("cpu"))
        # Interleave blocks of different sequences (and in reverse order) so paging bugs show.
        block_ids = torch.arange(num_blocks).flip(0)
        self.block_tables = torch.stack([block_ids[i::num_seqs][:max_blocks] for i in range(num_seqs)]).int()
        self.num_cached = [0] * num_seqs

    def step(self, chunks: list[list[int]], lora_slots: list[int] | None = None) -> torch.Tensor:
        """chunks[b]: the next token ids of sequence b (empty: not scheduled); lora_slots[b]: its LoRA slot (-1:
        none; None: no adapters). Returns float32 logits [T, vocab]."""
        from workers.layers.attention import AttentionMetadata

        ids, positions, slots, query_start, seq_lens, tables, token_loras = [], [], [], [0], [], [], []
        for b, chunk in enumerate(chunks):
            if not chunk:
                continue
            start = self.num_cached[b]
            for i, token in enumerate(chunk):
                pos = start + i
                ids.append(token)
                positions.append(pos)
                token_loras.append(-1 if lora_slots is None else lora_slots[b])
                slots.append(int(self.block_tables[b, pos // self.block_size]) * self.block_size
                             + pos % self.block_size)
            self.num_cached[b] += len(chunk)
            query_start.append(len(ids))
            seq_lens.append(self.num_cached[b])
            tables.append(self.block_tables[b])
        query_lens = [len(c) for c in chunks if c]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.stack(tables),
            max_query_len=max(query_lens),
            is_decode_only=all(n == 1 for n in query_lens),
            lora_slots=None if lora_slots is None else torch.tensor(token_loras, dtype=torch.int32),
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            return self.model.compute_logits(hidden)


@pytest.fixture
def paged_sequences():
    """The `PagedSequences` class (a fixture, so test modules need no import path to this file)."""
    return PagedSequences


@pytest.fixture
def tp_state():
    """Sets a fake tensor-parallel rank/size (no process group) for the test; restores rank 0 of 1 after."""
    from workers import parallel

    yield parallel.set_parallel_state_for_testing
    parallel.destroy_parallel()
