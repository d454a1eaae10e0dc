"""BlockManager: admission, growth, prefix caching, fork with copy-on-write, integrity."""

import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_req(req_id, tokens, **kw):
    return Request(req_id, list(tokens), SamplingParams(max_tokens=8, **kw), max_tokens=8)


def admit_computed(bm, req):
    """Admits req's whole prompt and marks it computed and committed, as a step would."""
    allocation = bm.admit(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.commit(req)
    return allocation


def test_admit_grow_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_req("a", range(10))
    allocation = bm.admit(req, 10)
    assert (allocation.num_computed_tokens, allocation.num_new_tokens) == (0, 10)
    assert len(allocation.block_ids) == 3 and bm.num_free_blocks == 5
    req.num_computed_tokens = 10
    assert bm.grow(req, 2).new_block_ids == []  # positions 10, 11 fit in the third block
    assert len(bm.grow(req, 3).new_block_ids) == 1
    bm.check_integrity()
    bm.free(req)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_admit_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.admit(make_req("big", range(9)), 9) is None  # 3 blocks: nothing is taken
    assert bm.num_free_blocks == 2
    bm.check_integrity()
    chunked = bm.admit(make_req("chunked", range(9)), 8)  # the budget leaves the rest for a later step
    assert chunked.num_new_tokens == 8 and len(chunked.block_ids) == 2


def test_grow_refuses_past_the_pool_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_req("a", range(4))
    bm.admit(req, 4)
    req.num_computed_tokens = 4
    assert bm.grow(req, 5) is None and bm.num_free_blocks == 1
    assert len(bm.grow(req, 4).new_block_ids) == 1
    bm.check_integrity()


def test_prefix_hit_after_commit_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", range(12))
    a_blocks = bm.admit(a, 12).block_ids
    b = make_req("b", list(range(8)) + [99, 98, 97])
    assert bm.admit(b, 16).num_computed_tokens == 0  # a's blocks are not computed yet: no hit
    bm.free(b)
    a.num_computed_tokens = 12
    bm.commit(a)
    c = make_req("c", list(range(8)) + [99, 98, 97])
    allocation = bm.admit(c, 16)
    assert allocation.block_ids[:2] == a_blocks[:2] and allocation.num_computed_tokens == 8
    assert allocation.num_new_tokens == 3
    assert bm.prefix_hits_tokens == 8 and bm.prefix_queries_tokens == 12 + 11 + 11  # one query per admission
    bm.check_integrity()


def test_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit_computed(bm, make_req("a", range(8)))
    same = bm.admit(make_req("b", range(8)), 8)
    assert same.num_computed_tokens == 4  # block-aligned prompt: the second block is recomputed


def test_no_hit_for_a_request_that_wants_prompt_logprobs():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit_computed(bm, make_req("a", range(9)))
    assert bm.admit(make_req("b", range(9), prompt_logprobs=1), 9).num_computed_tokens == 0


def test_free_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=5, block_size=2)
    a = make_req("a", range(6))
    admit_computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 5
    b = make_req("b", list(range(4)) + [50])
    assert bm.admit(b, 8).num_computed_tokens == 4
    assert bm.num_free_blocks == 2  # two cached blocks revived, one fresh block for the last token
    c = make_req("c", [7, 7, 7, 7])
    bm.admit(c, 4)  # evicts the free cached block of a (the tail block of a was freed first)
    bm.free(b)
    bm.free(c)
    assert bm.admit(make_req("d", list(range(6)) + [9]), 8).num_computed_tokens == 4  # a's third block is gone
    bm.check_integrity()


def test_revived_cached_blocks_count_against_the_room():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_req("a", range(6))
    admit_computed(bm, a)
    bm.free(a)  # 3 free blocks, all cached
    b = make_req("b", list(range(4)) + [50, 51, 52])
    assert bm.admit(b, 3) is None  # 2 hits revived + 2 fresh blocks > 3
    assert bm.num_free_blocks == 3 and bm.prefix_queries_tokens == 6  # a failed attempt counts no query
    assert bm.admit(b, 2).num_computed_tokens == 4  # 2 hits revived + 1 fresh block
    assert bm.num_free_blocks == 0
    bm.check_integrity()


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    leader = make_req("p#0", range(6))
    leader_blocks = bm.admit(leader, 6).block_ids
    leader.num_computed_tokens = 6
    child = make_req("p#1", range(6))
    allocation = bm.admit(child, 8, leader)  # positions 0..4: blocks 0 and 1 (block 1 partly filled)
    assert (allocation.num_computed_tokens, allocation.num_new_tokens) == (5, 1)
    _, copies, _ = bm.take_transfers()
    assert copies == [(leader_blocks[1], allocation.block_ids[1])]  # copied before the child writes position 5
    assert allocation.block_ids[0] == leader_blocks[0] and allocation.block_ids[1] != leader_blocks[1]
    assert bm.prefix_queries_tokens == 6  # the leader's; a fork is no prefix-cache query
    bm.check_integrity()
    bm.free(leader)
    bm.free(child)
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_fork_without_room_for_its_copy_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    leader = make_req("p#0", range(6))
    bm.admit(leader, 6)
    leader.num_computed_tokens = 6
    assert bm.admit(make_req("p#1", range(6)), 8, leader) is None
    assert bm.num_free_blocks == 0 and bm.take_transfers() == ([], [], [])
    bm.check_integrity()


def test_integrity_catches_a_leak():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.admit(make_req("a", range(4)), 4)
    bm._tables.pop("a")  # lose the table without freeing: a bug nothing public can make
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_integrity()
