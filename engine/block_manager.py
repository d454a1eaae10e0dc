"""The paged KV pool's bookkeeping on the driver: which block holds what, for whom.

    block table of a request (block_size 4, 10 tokens):
    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    block ids  [  7    |   2     |   9    ]      full blocks 7 and 2 carry hashes and can be shared
                                                  by a later request with the same prefix

A block is either free (ref count 0, in the LRU free queue; it may still carry a prefix-cache hash and be revived
by a hit) or owned (ref count = number of block tables holding it). The workers hold the tensors; block id b means
the same block on every rank.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and its KV is computed


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained hash of a full block: depends on every token before it, not only its own."""
    h = hashlib.blake2b(parent_hash or b"pagoda", digest_size=16)
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.tables: dict[str, list[int]] = {}  # req_id -> block ids
        self.num_committed: dict[str, int] = {}  # req_id -> full blocks already hashed into the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), taken by the scheduler
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # ---- queries -------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, req_id: str) -> list[int]:
        return self.tables.get(req_id, [])

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks to add so that positions up to num_computed + num_new fit, counting a copy-on-write block."""
        appended, copy = self._growth(req, self.tables.get(req.req_id, []), num_new_tokens)
        return appended + int(copy)

    def needs_copy(self, req: Request) -> bool:
        return self._needs_copy(req, self.tables.get(req.req_id, []))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(req, num_new_tokens) <= self.num_free_blocks

    # ---- prefix cache --------------------------------------------------------------------------------------------
    def update_hashes(self, req: Request) -> None:
        """Extends the request's hash chain over every full block of its known tokens."""
        tokens, size = req.all_token_ids, self.block_size
        for i in range(len(req.block_hashes), len(tokens) // size):
            parent = req.block_hashes[i - 1] if i else None
            req.block_hashes.append(hash_block(parent, tokens[i * size:(i + 1) * size]))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of full blocks. At least one token is always left to compute, so
        that the last position's logits exist."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in req.block_hashes[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_cached(self, req: Request, block_ids: list[int]) -> None:
        """Starts a request's table with cached blocks (hits revive free blocks)."""
        assert req.req_id not in self.tables, f"{req.req_id} already has blocks"
        if self.enable_prefix_caching:  # counted once the request is scheduled, not at each attempt
            self.prefix_queries_tokens += req.num_tokens
            self.prefix_hits_tokens += len(block_ids) * self.block_size
        for block_id in block_ids:
            self._take(block_id)
        self.tables[req.req_id] = list(block_ids)
        self.num_committed[req.req_id] = len(block_ids)

    def commit(self, req: Request) -> None:
        """Publishes the request's newly full, computed blocks to the prefix cache. Call only after the step that
        computed them has run, so a hit never reads KV that is not there."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(req.req_id, [])
        num_full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(table))
        start = self.num_committed.get(req.req_id, 0)
        if num_full <= start:
            return
        self.update_hashes(req)
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            if block.block_hash is None and req.block_hashes[i] not in self.cached:
                block.block_hash = req.block_hashes[i]
                self.cached[block.block_hash] = block.block_id
        self.num_committed[req.req_id] = num_full

    # ---- allocate / fork / free ----------------------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int) -> list[int]:
        """Makes room for num_new_tokens more tokens; returns the block ids added to the table (copy-on-write
        replacements included, which also queue a (src, dst) copy). Caller checks `can_allocate` first."""
        reserved = self.try_allocate(req, num_new_tokens)
        assert reserved is not None, f"no room for {num_new_tokens} tokens of {req.req_id}"
        return reserved[0]

    def try_allocate(self, req: Request, num_new_tokens: int) -> tuple[list[int], bool] | None:
        """`allocate` when there is room: (block ids added, whether the last block was copied on write); None,
        changing nothing, when there is not. One pass: the scheduler calls it for every running request at
        every step."""
        table = self.tables.get(req.req_id, [])
        needed, copy = self._growth(req, table, num_new_tokens)
        if needed == 0 and not copy:
            return [], False  # a decode step inside the last block: the common case
        if needed + copy > self.num_free_blocks:
            return None
        self.tables[req.req_id] = table
        self.num_committed.setdefault(req.req_id, 0)
        added = []
        if copy:
            index = req.num_computed_tokens // self.block_size
            src, dst = table[index], self._pop_free()
            self._release(src)
            table[index] = dst
            self.pending_copies.append((src, dst))
            added.append(dst)
        for _ in range(needed):
            block_id = self._pop_free()
            table.append(block_id)
            added.append(block_id)
        return added, copy

    def fork(self, src: Request, dst: Request, num_tokens: int) -> None:
        """dst shares src's blocks that cover its first num_tokens tokens (n > 1: one prompt, many completions).
        A shared, partly filled last block is copied when dst first writes into it."""
        assert dst.req_id not in self.tables, f"{dst.req_id} already has blocks"
        assert num_tokens > 0, "a fork shares at least one token"
        shared = self.tables[src.req_id][:-(-num_tokens // self.block_size)]
        for block_id in shared:
            self._take(block_id)
        self.tables[dst.req_id] = list(shared)
        self.num_committed[dst.req_id] = min(num_tokens // self.block_size, self.num_committed.get(src.req_id, 0))

    def free(self, req: Request) -> None:
        """Returns the request's blocks; tail blocks first into the LRU queue, so they are evicted first."""
        for block_id in reversed(self.tables.pop(req.req_id, [])):
            self._release(block_id)
        self.num_committed.pop(req.req_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                self.cached.pop(block.block_hash, None)
                block.block_hash = None

    # ---- internals -----------------------------------------------------------------------------------------------
    def _growth(self, req: Request, table: list[int], num_new_tokens: int) -> tuple[int, bool]:
        """(blocks to append, whether the block written first must be copied on write) for num_new_tokens more."""
        needed = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
        return max(needed, 0), self._needs_copy(req, table)

    def _needs_copy(self, req: Request, table: list[int]) -> bool:
        """Writing into a partly filled block that another table shares: copy it first."""
        offset, index = req.num_computed_tokens % self.block_size, req.num_computed_tokens // self.block_size
        return offset != 0 and index < len(table) and self.blocks[table[index]].ref_count > 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def check_integrity(self) -> None:
        """Every block is free or owned, ref counts equal the tables' references, the cache points at its blocks."""
        refs = [0] * self.num_blocks
        for req_id, table in self.tables.items():
            assert len(set(table)) == len(table), f"{req_id} holds a block twice: {table}"
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], \
                f"block {block.block_id}: ref_count {block.ref_count}, referenced {refs[block.block_id]} times"
            is_free = block.block_id in self.free_queue
            assert is_free == (block.ref_count == 0), f"block {block.block_id} free={is_free} ref={block.ref_count}"
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cache entry of block {block_id} is stale"
        assert not self.pending_copies, f"copies never sent: {self.pending_copies}"
