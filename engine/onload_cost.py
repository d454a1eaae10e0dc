"""Copy a prefix back from the host KV tier, or compute it again: the cost model behind `min_onload_blocks`.

A request whose cached prefix continues on the host (engine/block_manager.py `admit`) can have those n blocks copied
back (onloads, on the compute stream before the step's forward) or computed again (prefill):

    onload     latency_s + n * block_bytes_per_rank / onload_bytes_per_s     a step's copies: one launch per layer and
                                                                             tensor, then the bytes over PCIe / C2C
    recompute  n * block_size / prefill_tokens_per_s                         the model's prefill rate on the device

Onloading is cheaper from the smallest n where the two cross; below it the blocks are computed. When a block costs
more to copy than to compute (a small model on a slow link) no continuation is copied back.

The three rates are measured on the machine (`pagoda bench kv-tier-cost`, benchmarks/kv_tier_cost.py). The model is
deliberately small: it charges recompute at the model's prefill rate even when a few tokens would ride along in a
decode batch almost for free, and ignores that a deep prefix's tokens cost more (attention over a longer past); the
benchmark measures whole prefixes end to end, one way and the other, to check the threshold it gives.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

NEVER_ONLOAD = sys.maxsize  # min_onload_blocks when copying a block back costs more than computing it


@dataclass(frozen=True)
class OnloadCost:
    onload_bytes_per_s: float  # host -> device, one rank, through the workers' copy path
    onload_latency_s: float  # the fixed cost of a step's onloads
    prefill_tokens_per_s: float  # the model's prefill rate

    def __post_init__(self):
        assert self.onload_bytes_per_s > 0 and self.prefill_tokens_per_s > 0 and self.onload_latency_s >= 0, self

    def onload_s(self, num_blocks: int, block_bytes_per_rank: int) -> float:
        return self.onload_latency_s + num_blocks * block_bytes_per_rank / self.onload_bytes_per_s

    def recompute_s(self, num_blocks: int, block_size: int) -> float:
        return num_blocks * block_size / self.prefill_tokens_per_s

    def min_onload_blocks(self, block_size: int, block_bytes_per_rank: int) -> int:
        """The fewest host blocks worth copying back: the smallest n with onload_s(n) <= recompute_s(n), at least
        1; NEVER_ONLOAD when no n qualifies."""
        saved_per_block_s = self.recompute_s(1, block_size) - block_bytes_per_rank / self.onload_bytes_per_s
        if saved_per_block_s <= 0:
            return NEVER_ONLOAD
        return max(1, math.ceil(self.onload_latency_s / saved_per_block_s - 1e-9))
