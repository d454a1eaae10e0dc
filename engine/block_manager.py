"""The paged KV pool's bookkeeping on the driver: which block holds what, for whom.

    block table of a request (block_size 4, 10 tokens):
    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    block ids  [  7    |   2     |   9    ]      full blocks 7 and 2 carry hashes and can be shared
                                                  by a later request with the same prefix

A block is either free (ref count 0, in the LRU free queue; it may still carry a prefix-cache hash and be revived
by a hit) or owned (ref count = number of block tables holding it). The workers hold the tensors; block id b means
the same block on every rank.

The scheduler sees the pool through these calls only: `admit` a waiting request (its reusable prefix and room for
its first tokens, all or nothing), `grow` a running one, `free` either; `commit` after a step publishes what it
computed, `take_transfers` hands over the KV moves the step must make. Which block is where stays in here.

The host tier (`num_host_blocks` > 0, `--swap-space`) is a second pool of blocks in host memory, a level of the
prefix cache below the device's: every block `commit` publishes is also written to the host (write-through, an
offload the next step makes beside its forward), host blocks are evicted least recently used, and `admit` continues
a request's cached prefix on the host where the device's ends: those blocks are copied back (onloads) instead of
computed. A preempted request's computed blocks are on the host already, so it resumes by copying them back. A
host continuation shorter than `min_onload_blocks` is computed again instead (engine/onload_cost.py: copying a few
blocks back can cost more than computing them).

    device pool   [ prefix-cache hits | onloaded from the host | computed now ]    one block table
    host pool     every committed block's copy, LRU; found by the same hash chain

Write-back (`write_back`, kv_offload_policy "write-back") copies a cached block to the host only when the device
cache is about to reuse it: each step copies the next `write_back_ahead` free blocks in LRU order that the host
lacks, beside its forward, and a block reached before its copy is passed over for a step. While the device pool has
room nothing is copied (write-through copies every block); what the device evicts reaches the host either way.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request, RequestStatus


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and its KV is computed


@dataclass
class Allocation:
    """What `admit` gave a waiting request."""

    block_ids: list[int]  # its whole block table
    num_computed_tokens: int  # tokens whose KV the table already holds: a cached prefix, or its leader's prompt
    num_new_tokens: int  # tokens to compute now (within the budget); the table has room for them
    num_onloaded_blocks: int = 0  # of the computed ones, blocks copied back from the host tier


@dataclass
class Growth:
    """What `grow` changed in a running request's table: the block ids the workers must learn."""

    new_block_ids: list[int]  # appended to the table...
    replaces_block_ids: bool = False  # ...or, after a copy-on-write, the whole new table
    num_kept_blocks: int | None = None  # the table's length before new_block_ids (after any `shrink`)


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained hash of a full block: depends on every token before it, not only its own."""
    h = hashlib.blake2b(parent_hash or b"pagoda", digest_size=16)
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, min_onload_blocks: int = 1, write_back: bool = False,
                 write_back_ahead: int = 0):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        assert not num_host_blocks or enable_prefix_caching, "the host tier is a level of the prefix cache"
        assert min_onload_blocks >= 1, min_onload_blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self.min_onload_blocks = min_onload_blocks  # a shorter host continuation is computed, not copied back
        # Host copies made when the device cache evicts a block, not when it is committed (kv_offload_policy
        # "write-back"), and ahead of that for the write_back_ahead free blocks to be reused first (a step's worth):
        # those are copied beside a step, so that reusing them later waits for nothing.
        self.write_back = write_back
        self.write_back_ahead = write_back_ahead
        # Prompt tokens of new requests (vLLM's prefix_cache_* and external_prefix_cache_*): looked up, found on the
        # device, looked up while a host tier exists (the whole prompt, as vLLM counts its connector's queries),
        # found on the host (copied back).
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.host_queries_tokens = 0
        self.host_hits_tokens = 0
        # Preempted requests: computed tokens the host held when they were preempted (written through: a swap-out
        # that copies nothing more), tokens copied back from the host when they resumed, and tokens computed again.
        self.swapped_out_tokens = 0
        self.swapped_in_tokens = 0
        self.preemption_recomputed_tokens = 0
        self.num_offloaded_blocks = 0
        self.num_onloaded_blocks = 0
        self._host_cached: OrderedDict[bytes, int] = OrderedDict()  # block hash -> host block, least recent first
        self._host_free = list(range(num_host_blocks))
        self._offloads: dict[int, int] = {}  # device block -> host block, not yet taken by a step
        self._onloads: list[tuple[int, int]] = []  # (host block, device block), not yet taken
        self._host_writing: set[int] = set()  # the host blocks of _offloads
        self._host_reading: set[int] = set()  # the host blocks of _onloads
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}  # req_id -> block ids
        self._num_committed: dict[str, int] = {}  # req_id -> full blocks already hashed into the cache
        self._pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), taken by the scheduler

    # ---- queries -------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- admit / grow / free -------------------------------------------------------------------------------------
    def admit(self, req: Request, num_tokens_budget: int, leader: Request | None = None) -> Allocation | None:
        """Gives a waiting request its block table: first the blocks whose KV is already computed, then room for
        up to num_tokens_budget tokens more. None, changing nothing, when the pool cannot hold that.

        The computed part is, with a running `leader` (n > 1, the same prompt), the leader's blocks of every prompt
        token but the last (a partly filled last one is copied on write); otherwise the longest cached prefix of
        full blocks. Either way at least one token is left to compute, so that the last position's logits exist.
        Cached blocks that sit in the free queue count against the room, as they are revived."""
        assert req.req_id not in self._tables, f"{req.req_id} already has blocks"
        if leader is not None and req.num_prompt_tokens > 1:
            num_computed = req.num_prompt_tokens - 1
            prefix = self._tables[leader.req_id][:self._num_blocks_for(num_computed)]
            num_committed = min(num_computed // self.block_size, self._num_committed[leader.req_id])
        else:
            leader = None  # a one-token prompt has nothing to share
            hashes = self._prefix_hashes(req)
            prefix = self._cached_prefix(hashes)
            host_hits = self._host_prefix(hashes[len(prefix):])
            if len(host_hits) < self.min_onload_blocks:
                host_hits = []  # cheaper to compute again than to copy back
            num_committed = len(prefix) + len(host_hits)
            num_computed = num_committed * self.block_size
        num_new = min(req.num_tokens - num_computed, num_tokens_budget)
        num_appended = self._num_blocks_for(num_computed + num_new) - len(prefix)
        is_copy = num_computed % self.block_size != 0  # only a fork's last block: partly filled and shared
        num_revived = sum(1 for block_id in prefix if self._blocks[block_id].ref_count == 0)
        if num_appended + is_copy + num_revived > self.num_free_blocks:
            return None
        if leader is None and self.enable_prefix_caching:  # counted once the request is admitted, not at each attempt
            self._count_admission(req, len(prefix), len(host_hits), num_computed)
        for block_id in prefix:
            self._take(block_id)
        table = self._tables[req.req_id] = list(prefix)
        self._num_committed[req.req_id] = num_committed
        added = self._extend(table, num_computed, num_appended, is_copy)
        if leader is None:
            for (block_hash, host_block), block_id in zip(host_hits, added):
                self._onload(block_hash, host_block, block_id)
        return Allocation(list(table), num_computed, num_new, len(host_hits) if leader is None else 0)

    def _count_admission(self, req: Request, num_device_hits: int, num_host_hits: int, num_computed: int) -> None:
        """A new request's prefix-cache lookup (vLLM counts a preempted one's apart, and so does this), or what a
        preempted one got back: copied from the host, or computed again."""
        if req.status == RequestStatus.PREEMPTED:
            self.swapped_in_tokens += num_host_hits * self.block_size
            self.preemption_recomputed_tokens += max(req.num_preempted_tokens - num_computed, 0)
            return
        self.prefix_queries_tokens += req.num_tokens
        self.prefix_hits_tokens += num_device_hits * self.block_size
        if self.num_host_blocks:
            self.host_queries_tokens += req.num_tokens
            self.host_hits_tokens += num_host_hits * self.block_size

    def grow(self, req: Request, num_new_tokens: int) -> Growth | None:
        """Makes room in a running request's table for num_new_tokens more tokens; None, changing nothing, when the
        pool has none left (the scheduler then preempts). One pass: called for every running request every step."""
        table = self._tables[req.req_id]
        num_appended, is_copy = self._growth(table, req.num_computed_tokens, num_new_tokens)
        if num_appended + is_copy > self.num_free_blocks:
            return None
        added = self._extend(table, req.num_computed_tokens, num_appended, is_copy)
        if is_copy:
            return Growth(list(table), replaces_block_ids=True)
        return Growth(added, num_kept_blocks=len(table) - len(added))

    def shrink(self, req: Request) -> None:
        """Gives back the blocks past the request's computed tokens: those reserved for drafts a speculative step
        rejected (engine/spec_decode.py). They hold no committed block: commit never passes the known tokens."""
        table = self._tables[req.req_id]
        keep = self._num_blocks_for(req.num_computed_tokens)
        assert keep >= self._num_committed[req.req_id], f"{req.req_id}: a committed block past its computed tokens"
        for block_id in reversed(table[keep:]):
            self._release(block_id)
        del table[keep:]

    def free(self, req: Request) -> None:
        """Returns the request's blocks; tail blocks first into the LRU queue, so they are evicted first."""
        for block_id in reversed(self._tables.pop(req.req_id, [])):
            self._release(block_id)
        self._num_committed.pop(req.req_id, None)

    def preempt(self, req: Request) -> None:
        """Frees a preempted request's blocks (as `free`), counting the computed tokens the host tier holds: those it
        gets back by onloads when it resumes, unless the device still has them."""
        if self.num_host_blocks and req.req_id in self._num_committed:
            held = sum(1 for block_hash in req.block_hashes[:self._num_committed[req.req_id]]
                       if block_hash in self._host_cached)
            self.swapped_out_tokens += held * self.block_size
        self.free(req)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """The KV moves the next step makes before its forward (engine/outputs.py SchedulerOutput): offloads (device
        block, host block), copy-on-write (src, dst) and onloads (host block, device block). A device block offloaded
        in a step is not written by it, nor a host block written by a step read by it (see _pop_free and
        _host_prefix), so the offloads may run beside the step. Write-back: this step also copies the next free blocks
        to be reused that the host lacks."""
        if self.write_back:
            for block_id in itertools.islice(self._free_queue, self.write_back_ahead):
                if block_id not in self._offloads and self._lacks_host_copy(block_id):
                    self._offload(self._blocks[block_id])
        offloads, copies, onloads = list(self._offloads.items()), self._pending_copies, self._onloads
        self._offloads, self._pending_copies, self._onloads = {}, [], []
        self._host_writing, self._host_reading = set(), set()
        self.num_offloaded_blocks += len(offloads)
        self.num_onloaded_blocks += len(onloads)
        return offloads, copies, onloads

    @property
    def host_usage(self) -> float:
        return len(self._host_cached) / self.num_host_blocks if self.num_host_blocks else 0.0

    # ---- prefix cache --------------------------------------------------------------------------------------------
    def commit(self, req: Request) -> None:
        """Publishes the request's newly full, computed blocks to the prefix cache. Call only after the step that
        computed them has run, so a hit never reads KV that is not there."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(req.req_id, [])
        num_full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(table))
        start = self._num_committed.get(req.req_id, 0)
        if num_full <= start:
            return
        self._update_hashes(req)
        for i in range(start, num_full):
            block = self._blocks[table[i]]
            if block.block_hash is None and req.block_hashes[i] not in self._cached:
                block.block_hash = req.block_hashes[i]
                self._cached[block.block_hash] = block.block_id
                if not self.write_back:
                    self._offload(block)
        self._num_committed[req.req_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block no request holds, on the device and on the host."""
        for block in self._blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                block.block_hash = None
        for block_hash, host_block in list(self._host_cached.items()):
            if host_block not in self._host_writing and host_block not in self._host_reading:
                del self._host_cached[block_hash]
                self._host_free.append(host_block)

    def evict_device_cache(self) -> None:
        """Forgets the device's cached blocks that no request holds; the host tier keeps its copies, so a later hit on
        them is copied back (benchmarks/kv_tier_cost.py). A block whose offload is pending stays (its copy is not
        on the host yet); write-back offloads those the host lacks first."""
        for block in self._blocks:
            if self.write_back and block.ref_count == 0 and self._lacks_host_copy(block.block_id):
                self._offload(block)
        for block in self._blocks:
            if block.ref_count == 0 and block.block_hash is not None and block.block_id not in self._offloads:
                if self._cached.get(block.block_hash) == block.block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None

    def _prefix_hashes(self, req: Request) -> list[bytes]:
        """The hashes a cached prefix may cover: every full block but the one with the last token. None for a
        request that wants prompt logprobs: it computes every position."""
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        self._update_hashes(req)
        return req.block_hashes[:(req.num_tokens - 1) // self.block_size]

    def _cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """Device block ids of the longest cached prefix of `hashes`."""
        hits = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _host_prefix(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        """(hash, host block) of the longest prefix of `hashes` on the host, short of a block this step writes."""
        hits = []
        for block_hash in hashes:
            host_block = self._host_cached.get(block_hash)
            if host_block is None or host_block in self._host_writing:
                break
            hits.append((block_hash, host_block))
        return hits

    # ---- the host tier -------------------------------------------------------------------------------------------
    def _offload(self, block: Block) -> None:
        """A device block gets a copy on the host (the next step makes it), unless the host holds its hash: when it is
        committed (write-through) or evicted from the device cache (write-back)."""
        if not self.num_host_blocks:
            return
        assert block.block_hash is not None
        if block.block_hash in self._host_cached:
            self._host_cached.move_to_end(block.block_hash)
            return
        host_block = self._free_host_block()
        if host_block is not None:
            self._host_cached[block.block_hash] = host_block
            self._offloads[block.block_id] = host_block
            self._host_writing.add(host_block)

    def _free_host_block(self) -> int | None:
        """A free host block, evicting the least recently used one that the next step neither reads nor writes."""
        if self._host_free:
            return self._host_free.pop()
        victim = next((h for h, host in self._host_cached.items()
                       if host not in self._host_writing and host not in self._host_reading), None)
        return None if victim is None else self._host_cached.pop(victim)

    def _onload(self, block_hash: bytes, host_block: int, block_id: int) -> None:
        """Device block block_id gets the host's copy of block_hash (in the next step, before its forward) and is
        a cached block from now on."""
        self._host_cached.move_to_end(block_hash)
        self._onloads.append((host_block, block_id))
        self._host_reading.add(host_block)
        block = self._blocks[block_id]
        block.block_hash = block_hash
        self._cached[block_hash] = block_id

    def _update_hashes(self, req: Request) -> None:
        """Extends the request's hash chain over every full block of its known tokens."""
        tokens, size = req.all_token_ids, self.block_size
        # A LoRA adapter's KV differs from the base's (and another adapter's) for the same tokens: its id starts
        # the chain, so its blocks are never shared with them.
        root = None if req.lora is None else f"pagoda-lora-{req.lora.request.id}".encode()
        for i in range(len(req.block_hashes), len(tokens) // size):
            parent = req.block_hashes[i - 1] if i else root
            req.block_hashes.append(hash_block(parent, tokens[i * size:(i + 1) * size]))

    # ---- internals -----------------------------------------------------------------------------------------------
    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _growth(self, table: list[int], num_computed: int, num_new: int) -> tuple[int, bool]:
        """(blocks to append, whether the block written first must be copied: partly filled and shared) for num_new
        tokens after num_computed."""
        num_appended = max(self._num_blocks_for(num_computed + num_new) - len(table), 0)
        offset, index = num_computed % self.block_size, num_computed // self.block_size
        return num_appended, offset != 0 and index < len(table) and self._blocks[table[index]].ref_count > 1

    def _extend(self, table: list[int], num_computed: int, num_appended: int, is_copy: bool) -> list[int]:
        """Takes the blocks `_growth` counted: a copy of the block written first (queued as (src, dst)), then the
        appended ones. Returns the ids added."""
        added = []
        if is_copy:
            index = num_computed // self.block_size
            src, dst = table[index], self._pop_free()
            self._release(src)
            table[index] = dst
            self._pending_copies.append((src, dst))
            added.append(dst)
        for _ in range(num_appended):
            block_id = self._pop_free()
            table.append(block_id)
            added.append(block_id)
        return added

    def _pop_free(self) -> int:
        """The least recently used free block, past those whose offload the next step makes (it must not write them):
        those go to the back of the queue. Write-back: a cached block the host lacks is offloaded now, and passed
        over likewise. If every free block waits for its offload, the last one's is dropped."""
        assert self._free_queue, "no free block: the caller checks num_free_blocks first"
        for _ in range(len(self._free_queue)):
            block_id = next(iter(self._free_queue))
            if block_id not in self._offloads and self.write_back and self._lacks_host_copy(block_id):
                self._offload(self._blocks[block_id])
            if block_id not in self._offloads:
                break
            self._free_queue.move_to_end(block_id)
        else:
            self._drop_offload(block_id)
        del self._free_queue[block_id]
        block = self._blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _lacks_host_copy(self, block_id: int) -> bool:
        """A device-cached block whose hash the host tier does not hold (write-back copies it before reusing it)."""
        block_hash = self._blocks[block_id].block_hash
        return (self.num_host_blocks > 0 and block_hash is not None and self._cached.get(block_hash) == block_id
                and block_hash not in self._host_cached)

    def _drop_offload(self, block_id: int) -> None:
        host_block = self._offloads.pop(block_id)
        self._host_writing.discard(host_block)
        block_hash = self._blocks[block_id].block_hash
        if block_hash is not None and self._host_cached.get(block_hash) == host_block:
            del self._host_cached[block_hash]
        self._host_free.append(host_block)

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free_queue[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_queue[block_id] = None

    def table(self, req: Request) -> list[int]:
        """A copy of the request's block table (checks)."""
        return list(self._tables.get(req.req_id, ()))

    def check_integrity(self) -> None:
        """Every block is free or owned, ref counts equal the tables' references, the cache points at its blocks."""
        refs = [0] * self.num_blocks
        for req_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"{req_id} holds a block twice: {table}"
            for block_id in table:
                refs[block_id] += 1
        for block in self._blocks:
            assert block.ref_count == refs[block.block_id], \
                f"block {block.block_id}: ref_count {block.ref_count}, referenced {refs[block.block_id]} times"
            is_free = block.block_id in self._free_queue
            assert is_free == (block.ref_count == 0), f"block {block.block_id} free={is_free} ref={block.ref_count}"
        for block_hash, block_id in self._cached.items():
            assert self._blocks[block_id].block_hash == block_hash, f"cache entry of block {block_id} is stale"
        assert not self._pending_copies and not self._onloads, \
            f"copies never sent: {self._pending_copies} {self._onloads}"
        host_blocks = list(self._host_cached.values()) + self._host_free
        assert sorted(host_blocks) == list(range(self.num_host_blocks)), "a host block is lost or held twice"
        assert set(self._offloads.values()) <= set(self._host_cached.values()), "an offload to an uncached host block"
        assert self._host_writing == set(self._offloads.values()), "the host blocks written this step are miscounted"
