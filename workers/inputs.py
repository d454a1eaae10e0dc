"""Step inputs, built on the host in preallocated (pinned) numpy buffers and copied to persistent device tensors
with one asynchronous copy each. The device tensors are also the static inputs of the decode CUDA graphs, so a
graph replay needs no copies beyond these.

    host (pinned)                      device (persistent, max sizes)
    input_ids   [max_tokens]   ──►     input_ids   [max_tokens]        a step uses the first T entries
    positions   [max_tokens]   ──►     positions
    slot_mapping[max_tokens]   ──►     slot_mapping                    -1 pads: no KV write
    seq_lens    [max_seqs]     ──►     seq_lens                        the first B entries
    query_start [max_seqs + 1] ──►     query_start_loc
    block_table [max_seqs, max_blocks] ──► block_tables
    lora_slots  [max_tokens]   ──►     lora_slots                      each token's LoRA slot, -1: base (with LoRA)
    lora_order  [max_tokens]   ──►     lora_order                      the rows sorted by slot (argsort, at the copy)

The sequence buffers have one row more than max_seqs: a verify graph's (workers/cuda_graphs.py) padding row.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.layers.attention import AttentionMetadata


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list or array as a device tensor, without waiting for the device.

    A copy from pageable host memory makes CUDA drain the stream first (the step launched before would then
    finish before this one is even launched: no overlap), so the values go through pinned memory, whose caching
    allocator keeps the block until the asynchronous copy has read it."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


_SCALAR_WRITES = 8  # a sequence of at most this many tokens is written token by token, not with numpy slices


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, has_lora: bool = False, full_width_tables: bool = False):
        self.block_size = block_size
        self.has_lora = has_lora  # LoRA slots are filled, copied and seen by the model (CUDA graphs: always)
        # every step's block-table view as wide as the buffer (the kernels read only a sequence's blocks): a
        # compiled model then sees no width that varies, or that is 1 and compiles a graph of its own
        self.full_width_tables = full_width_tables
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        pin = device.type == "cuda"

        def host(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        def host_set():
            return {
                "input_ids": host(max_tokens, torch.int64), "positions": host(max_tokens, torch.int64),
                "slot_mapping": host(max_tokens, torch.int64), "seq_lens": host(max_seqs + 1, torch.int32),
                "query_start_loc": host(max_seqs + 2, torch.int32),
                "block_tables": host((max_seqs + 1, max_blocks_per_seq), torch.int32),
                "lora_slots": host(max_tokens if has_lora else 1, torch.int32),
                "lora_order": host(max_tokens if has_lora else 1, torch.int32),
            }

        # Two host sets, used in turn: with overlapped steps the host writes step N+1's inputs while step N's
        # asynchronous copies may still be queued behind step N-1 on the device.
        self.host_sets = [host_set(), host_set()]
        self.np_sets = [{name: t.numpy() for name, t in hs.items()} for hs in self.host_sets]  # views, same memory
        self.copied: list[torch.cuda.Event | None] = [None, None]  # recorded after each set's copies
        self.current = 0
        self.host, self.np = self.host_sets[0], self.np_sets[0]
        self.dev = {name: torch.zeros_like(t, device=device) for name, t in self.host.items()}

    def next_step(self) -> None:
        """Switches to the other host set, once the device has copied what it held."""
        self.current ^= 1
        if self.copied[self.current] is not None:
            self.copied[self.current].synchronize()
        self.host, self.np = self.host_sets[self.current], self.np_sets[self.current]

    def fill(self, token_ids: list[list[int]], starts: list[int], counts: list[int],
             block_ids: list[list[int]], lora_slots: list[int] | None = None) -> tuple[int, int]:
        """Writes one step's inputs into the host buffers; returns (num_tokens, max_blocks in the batch).
        lora_slots: each sequence's LoRA slot (-1: none), with has_lora."""
        self.next_step()
        n = self.np
        if self.has_lora:
            assert lora_slots is not None, "a LoRA runner's step needs its sequences' slots"
            n["lora_slots"][:sum(counts)] = np.repeat(lora_slots, counts)
        bs = self.block_size
        ids, positions, slots = n["input_ids"], n["positions"], n["slot_mapping"]
        offset, max_blocks = 0, 1
        n["query_start_loc"][0] = 0
        for i, (tokens, start, count, blocks) in enumerate(zip(token_ids, starts, counts, block_ids)):
            end = start + count
            if count <= _SCALAR_WRITES:  # decode (and its drafts): skip numpy's per-call overhead
                for j, pos in enumerate(range(start, end), offset):
                    ids[j] = tokens[pos] if pos < len(tokens) else 0  # 0: fed on the device
                    positions[j] = pos
                    slots[j] = blocks[pos // bs] * bs + pos % bs
            else:
                pos = np.arange(start, end)
                chunk = tokens[start:end]
                n["input_ids"][offset:offset + count] = chunk + [0] * (count - len(chunk))
                n["positions"][offset:offset + count] = pos
                n["slot_mapping"][offset:offset + count] = np.asarray(blocks)[pos // bs] * bs + pos % bs
            offset += count
            n["query_start_loc"][i + 1] = offset
            n["seq_lens"][i] = end
            n["block_tables"][i, :len(blocks)] = blocks
            max_blocks = max(max_blocks, len(blocks))
        return offset, max_blocks

    def _pad_tokens(self, start: int, stop: int) -> None:
        """Token slots start..stop of a padded batch: token 0 at position 0, no adapter, no KV write."""
        n = self.np
        n["input_ids"][start:stop] = 0
        if self.has_lora:
            n["lora_slots"][start:stop] = -1
        n["positions"][start:stop] = 0
        n["slot_mapping"][start:stop] = -1

    def pad_decode(self, num_seqs: int, padded: int) -> None:
        """Rows num_seqs..padded of a padded decode batch: no KV write, a one-token context in block 0."""
        n = self.np
        self._pad_tokens(num_seqs, padded)
        n["seq_lens"][num_seqs:padded] = 1
        n["block_tables"][num_seqs:padded, 0] = 0
        n["query_start_loc"][num_seqs + 1:padded + 1] = np.arange(num_seqs + 1, padded + 1)

    def pad_verify(self, num_seqs: int, num_tokens: int, padded_seqs: int, padded_tokens: int) -> None:
        """Pads a step of num_seqs sequences and num_tokens tokens to a verify graph's layout: padded_seqs + 1
        sequences over padded_tokens tokens. Rows num_seqs..padded_seqs - 1 get no token (a one-token context in
        block 0); the last row takes every leftover token slot (none when the real rows fill them), at position 0,
        writing no KV, over a context of as many tokens, all in block 0. Nothing past the real tokens is read back.

            real rows       padding rows (no token)      last row: the leftover slots
            [a a | b | c c c] [] [] ... []               [p p p ... p]       padded_tokens in all
        """
        assert num_seqs <= padded_seqs and num_tokens <= padded_tokens, \
            f"{num_seqs} sequences / {num_tokens} tokens do not fit a graph of {padded_seqs} / {padded_tokens}"
        n = self.np
        leftover = padded_tokens - num_tokens
        context = max(leftover, 1)
        assert context <= self.max_blocks_per_seq * self.block_size, f"{leftover} padding tokens overflow a block table"
        self._pad_tokens(num_tokens, padded_tokens)
        n["seq_lens"][num_seqs:padded_seqs] = 1
        n["seq_lens"][padded_seqs] = context
        n["block_tables"][num_seqs:padded_seqs, 0] = 0
        n["block_tables"][padded_seqs, :-(-context // self.block_size)] = 0
        n["query_start_loc"][num_seqs + 1:padded_seqs + 1] = num_tokens
        n["query_start_loc"][padded_seqs + 1] = padded_tokens

    def copy_to_device(self, num_tokens: int, num_seqs: int, num_block_cols: int) -> None:
        h, d = self.host, self.dev
        if self.has_lora:  # after any padding: the LoRA kernels tile the rows in this order (kernels/lora.py)
            self.np["lora_order"][:num_tokens] = np.argsort(self.np["lora_slots"][:num_tokens], kind="stable")
        lora = ("lora_slots", "lora_order") if self.has_lora else ()
        for name in ("input_ids", "positions", "slot_mapping") + lora:
            d[name][:num_tokens].copy_(h[name][:num_tokens], non_blocking=True)
        d["seq_lens"][:num_seqs].copy_(h["seq_lens"][:num_seqs], non_blocking=True)
        d["query_start_loc"][:num_seqs + 1].copy_(h["query_start_loc"][:num_seqs + 1], non_blocking=True)
        d["block_tables"][:num_seqs, :num_block_cols].copy_(h["block_tables"][:num_seqs, :num_block_cols],
                                                            non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.copied[self.current] = event

    def metadata(self, num_tokens: int, num_seqs: int, max_query_len: int, num_block_cols: int,
                 use_lora: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Device views for a step of num_tokens tokens over num_seqs sequences. use_lora: whether the model adds
        adapter deltas (default: whenever the buffers have LoRA slots; False for a step with no adapter)."""
        d = self.dev
        use_lora = self.has_lora if use_lora is None else use_lora
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:num_tokens], query_start_loc=d["query_start_loc"][:num_seqs + 1],
            seq_lens=d["seq_lens"][:num_seqs],
            block_tables=d["block_tables"][:num_seqs, :None if self.full_width_tables else num_block_cols],
            max_query_len=max_query_len, is_decode_only=max_query_len == 1,
            lora_slots=d["lora_slots"][:num_tokens] if use_lora else None,
            lora_order=d["lora_order"][:num_tokens] if use_lora else None)
        return d["input_ids"][:num_tokens], d["positions"][:num_tokens], meta
