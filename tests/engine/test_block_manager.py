"""BlockManager: allocation, prefix caching, fork with copy-on-write, integrity."""

import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_req(req_id, tokens):
    return Request(req_id, list(tokens), SamplingParams(max_tokens=8), max_tokens=8)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_req("a", range(10))
    assert bm.num_blocks_needed(req, 10) == 3
    added = bm.allocate(req, 10)
    assert len(added) == 3 and bm.num_free_blocks == 5
    req.num_computed_tokens = 10
    assert bm.allocate(req, 2) == []  # positions 10, 11 fit in the third block
    assert len(bm.allocate(req, 3)) == 1
    bm.check_integrity()
    bm.free(req)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_can_allocate_refuses_past_the_pool():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_req("a", range(9))
    assert not bm.can_allocate(req, 9)
    assert bm.can_allocate(req, 8)
    with pytest.raises(AssertionError):
        bm.allocate(req, 9)


def test_prefix_hit_after_commit_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", range(12))
    bm.allocate(a, 12)
    b = make_req("b", list(range(8)) + [99, 98, 97])
    assert bm.find_cached_prefix(b) == []  # a's blocks are not computed yet: no hit
    a.num_computed_tokens = 12
    bm.commit(a)
    hits = bm.find_cached_prefix(b)
    assert hits == bm.block_ids("a")[:2]
    bm.allocate_cached(b, hits)
    assert bm.blocks[hits[0]].ref_count == 2
    bm.check_integrity()


def test_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", range(8))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    same = make_req("b", range(8))
    assert len(bm.find_cached_prefix(same)) == 1  # block-aligned prompt: the second block is recomputed


def test_free_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_req("a", range(6))
    bm.allocate(a, 6)
    a.num_computed_tokens = 6
    bm.commit(a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 3
    b = make_req("b", list(range(4)) + [50])
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    bm.allocate_cached(b, hits)
    assert bm.num_free_blocks == 2
    c = make_req("c", [7, 7, 7, 7])
    bm.allocate(c, 4)  # evicts the free cached block of a (the tail block of a was freed first)
    assert len(bm.cached) == 2
    bm.check_integrity()


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    leader = make_req("p#0", range(6))
    bm.allocate(leader, 6)
    leader.num_computed_tokens = 6
    child = make_req("p#1", range(6))
    bm.fork(leader, child, 5)  # positions 0..4: blocks 0 and 1 (block 1 partly filled)
    child.num_computed_tokens = 5
    assert bm.block_ids("p#1") == bm.block_ids("p#0")
    assert bm.needs_copy(child)
    added = bm.allocate(child, 1)
    copies = bm.take_copies()
    assert len(copies) == 1 and copies[0][0] == bm.block_ids("p#0")[1] and added == [copies[0][1]]
    assert bm.block_ids("p#1")[0] == bm.block_ids("p#0")[0]
    assert bm.block_ids("p#1")[1] != bm.block_ids("p#0")[1]
    bm.check_integrity()
    bm.free(leader)
    bm.free(child)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_integrity_catches_a_leak():
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_req("a", range(4))
    bm.allocate(req, 4)
    bm.tables.pop("a")  # lose the table without freeing
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_integrity()
