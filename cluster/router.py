"""Prefix-cache affinity routing: a Ray Serve `RequestRouter` for the LLMServer deployment.

A replica's prefix cache holds the KV blocks of prompts it has seen, so a request whose prompt starts like an
earlier one should go where that one went. The router hashes a request's prompt text in fixed chunks, the way
the engine hashes KV blocks (each chunk's hash covers everything before it):

    "You are a helpful assistant. Answer briefly. | What is the capital of | France?"
     └──────────── chunk 0 ──────────────────────┘ └──── chunk 1 ─────────┘ (partial: not hashed)
     h0 = H(chunk0)                                 h1 = H(h0, chunk1)

and remembers, per chunk hash, the replica it last routed that prefix to. A replica's caches (its device pool, and its
host KV tier behind it) hold a bounded number of blocks, least recently used out first; the table keeps, per replica,
about as many chunks as that replica's caches hold tokens (it reports them: `record_routing_stats`), so an entry
lives about as long as the blocks it stands for, and a replica with a large host tier keeps its prefixes (and gets
their requests) far longer. Routing:

1. longest known prefix → its replica, if that replica is not much busier than the least-loaded candidate
   (`queue_len <= min_queue_len + imbalance_threshold`; a candidate whose queue length the router has not heard of
   lately counts as idle);
2. a request for a LoRA adapter: the replicas it last routed that adapter to (the adapter is likely resident there:
   in a GPU slot or the workers' host cache), those not much busier than the least-loaded candidate, Serve picking
   the shortest queue among them; when every one of them is that busy, the next rule sends it to another replica,
   which holds it from then on too: a hot adapter spreads over as many replicas as its load needs;
3. otherwise (no known prefix, or loads unbalanced) power of two choices: two random replicas, Serve picks the one
   with the shorter queue.

A LoRA request's chunk hashes start from its adapter's name, as the engine's block hashes start from its id: the
same prompt under two adapters (or the base) shares no prefix.

`PrefixAffinity` is the policy without Ray (tested directly); `PrefixAffinityRouter` plugs it into Serve's
request-router API (`RequestRouterConfig(request_router_class=...)` in the deployment options). Each handle
(each ingress replica) has its own table: with several ingress replicas a prefix may be cached on as many replicas.
The table counts only the prompts it routed: a replica's caches also hold outputs and other ingress replicas' prompts,
so its entries outlive some of their blocks (a miss then costs what routing without affinity costs).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_CHARS = 64  # about one 16-token KV block of English text
DEFAULT_IMBALANCE_THRESHOLD = 8  # ongoing requests
DEFAULT_MAX_ENTRIES = 1_000_000  # the whole table's bound (an ingress replica's memory: ~300 bytes an entry)
CHARS_PER_TOKEN = 4  # of English text: a replica's cached tokens as chunks of prompt text


def routing_stats(stats, block_size: int) -> dict[str, int]:
    """What a replica reports to the routers (Serve's record_routing_stats): the tokens its device pool and its host
    KV tier hold, from its engine's EngineStats."""
    return {"kv_cache_tokens": stats.num_kv_blocks * block_size,
            "host_kv_cache_tokens": stats.num_host_kv_blocks * block_size}


def cached_tokens(stats: dict) -> int | None:
    """A replica's cache capacity in tokens from its routing stats; None before its first report."""
    if "kv_cache_tokens" not in stats:
        return None
    return int(stats["kv_cache_tokens"]) + int(stats.get("host_kv_cache_tokens", 0))


class PrefixAffinity:
    """Chunk hashes of routed prompts → the replica that got them; and the routing decision."""

    def __init__(self, chunk_chars: int = DEFAULT_CHUNK_CHARS, imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD,
                 max_entries: int = DEFAULT_MAX_ENTRIES, rng: random.Random | None = None):
        assert chunk_chars >= 1, chunk_chars
        self.chunk_chars = chunk_chars
        self.imbalance_threshold = imbalance_threshold
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, Hashable] = OrderedDict()  # chunk hash -> replica id, LRU order
        self._held: dict[Hashable, OrderedDict[bytes, None]] = {}  # replica -> its chunks, LRU order
        self._capacity: dict[Hashable, int] = {}  # replica -> chunks its caches hold (unknown: only max_entries)
        # adapter name -> the replicas its requests went to (most recent last); adapters in LRU order
        self._holders: OrderedDict[str, OrderedDict[Hashable, None]] = OrderedDict()
        self._rng = rng or random.Random()

    def set_capacity(self, replica: Hashable, num_tokens: int) -> None:
        """The tokens a replica's caches hold (device pool + host tier): the table keeps that many tokens' chunks
        of it, least recently routed out first."""
        chunks = max(1, num_tokens * CHARS_PER_TOKEN // self.chunk_chars)
        if self._capacity.get(replica) != chunks:
            self._capacity[replica] = chunks
            self._trim(replica)

    def capacity(self, replica: Hashable) -> int | None:
        return self._capacity.get(replica)

    def chunk_hashes(self, text: str, adapter: str | None = None) -> list[bytes]:
        hashes, parent = [], b"" if adapter is None else b"lora:" + adapter.encode()
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            parent = hashlib.blake2b(parent + text[start:start + self.chunk_chars].encode(), digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def lookup(self, hashes: Sequence[bytes], alive: set) -> tuple[Hashable | None, int]:
        """The live replica that holds the longest prefix, and how many chunks of it."""
        for i in range(len(hashes) - 1, -1, -1):
            owner = self._owner.get(hashes[i])
            if owner is not None and owner in alive:
                self._owner.move_to_end(hashes[i])
                return owner, i + 1
        return None, 0

    def record(self, hashes: Sequence[bytes], replica: Hashable, adapter: str | None = None) -> None:
        if adapter is not None:
            holders = self._holders.setdefault(adapter, OrderedDict())
            holders[replica] = None
            holders.move_to_end(replica)
            self._holders.move_to_end(adapter)
            while len(self._holders) > self.max_entries:
                self._holders.popitem(last=False)
        held = self._held.setdefault(replica, OrderedDict())
        for h in hashes:
            previous = self._owner.get(h)
            if previous is not None and previous != replica:
                self._held[previous].pop(h, None)
            self._owner[h] = replica
            self._owner.move_to_end(h)
            held[h] = None
            held.move_to_end(h)
        self._trim(replica)
        while len(self._owner) > self.max_entries:
            h, owner = self._owner.popitem(last=False)
            self._held[owner].pop(h, None)

    def _trim(self, replica: Hashable) -> None:
        """Drops the replica's least recently routed chunks past its capacity (its caches evicted them by now)."""
        held, capacity = self._held.get(replica), self._capacity.get(replica)
        while held and capacity is not None and len(held) > capacity:
            h, _ = held.popitem(last=False)
            if self._owner.get(h) == replica:
                del self._owner[h]

    def forget(self, replica: Hashable) -> None:
        for h in self._held.pop(replica, {}):
            if self._owner.get(h) == replica:
                del self._owner[h]
        self._capacity.pop(replica, None)
        for holders in self._holders.values():
            holders.pop(replica, None)

    def holders(self, adapter: str) -> list[Hashable]:
        """The replicas requests for the adapter went to, most recent last."""
        return list(self._holders.get(adapter, ()))

    def choose(self, text: str, replicas: Sequence[Hashable], queue_lens: dict[Hashable, int | None],
               adapter: str | None = None) -> list[list[Hashable]]:
        """Ranks of replicas, most preferred first (Serve tries each rank, picking its shortest queue)."""
        ranks = []
        owner, _ = self.lookup(self.chunk_hashes(text, adapter), set(replicas)) if text else (None, 0)
        if owner is not None and not self._is_busy(owner, queue_lens):
            ranks.append([owner])
        if adapter is not None:
            alive = set(replicas)
            holders = [r for r in self.holders(adapter) if r in alive and not self._is_busy(r, queue_lens)]
            if holders:
                ranks.append(holders)
        return ranks + [self.two_choices(replicas)]

    def _is_busy(self, replica: Hashable, queue_lens: dict[Hashable, int | None]) -> bool:
        """Much busier than the least-loaded candidate (imbalance_threshold more ongoing requests). A candidate whose
        queue length is unknown (never probed, or Serve's entry for it older than its 10 s timeout, as it is for a
        replica no request went to lately) counts as idle: the two-choices rank then has Serve probe it. Left out of
        the minimum, it would let one hot prefix or adapter keep its replica forever."""
        queue_len = queue_lens.get(replica)
        least = min((q or 0 for q in queue_lens.values()), default=0)
        return queue_len is not None and queue_len > least + self.imbalance_threshold

    def two_choices(self, replicas: Sequence[Hashable]) -> list[Hashable]:
        """Two random replicas, in random order (Serve takes the first of equal queues)."""
        return self._rng.sample(list(replicas), min(2, len(replicas)))


def routing_key(pending_request: PendingRequest | None) -> str:
    """The prompt text of a `GenerateRequest` call; "" for other methods (tokenize, ...)."""
    if pending_request is None:
        return ""
    for arg in list(pending_request.args) + list(pending_request.kwargs.values()):
        key = getattr(arg, "routing_key", None)
        if isinstance(key, str):
            return key
    return ""


def routing_adapter(pending_request: PendingRequest | None) -> str | None:
    """The LoRA adapter's name of a `GenerateRequest` call; None for the base model and other methods."""
    if pending_request is None:
        return None
    for arg in list(pending_request.args) + list(pending_request.kwargs.values()):
        lora = getattr(arg, "lora_request", None)
        if lora is not None:
            return lora.name
    return None


class PrefixAffinityRouter(RequestRouter):
    """Serve's request-router plug-in around `PrefixAffinity`."""

    def initialize_state(self, chunk_chars: int = DEFAULT_CHUNK_CHARS,
                         imbalance_threshold: float = DEFAULT_IMBALANCE_THRESHOLD,
                         max_entries: int = DEFAULT_MAX_ENTRIES, **_):
        self.affinity = PrefixAffinity(chunk_chars, imbalance_threshold, max_entries)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        for replica in candidate_replicas:  # Serve refreshes each replica's stats every routing-stats period
            num_tokens = cached_tokens(replica.routing_stats or {})
            if num_tokens is not None:
                self.affinity.set_capacity(replica.replica_id, num_tokens)
        key, adapter = routing_key(pending_request), routing_adapter(pending_request)
        queue_lens = {rid: self.replica_queue_len_cache.get(rid) for rid in by_id} if key or adapter else {}
        ranks = self.affinity.choose(key, list(by_id), queue_lens, adapter)
        return [[by_id[rid] for rid in rank] for rank in ranks if rank]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key, adapter = routing_key(pending_request), routing_adapter(pending_request)
        if key or adapter:
            self.affinity.record(self.affinity.chunk_hashes(key, adapter), replica_id, adapter)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Gives the replica to the very request it was chosen for.

        Serve's base router finds that request by `internal_request_id`, but every handle call made while one
        HTTP request is served shares its parent's id (a batch of prompts is several concurrent calls): the base
        lookup then misses the second call, whose routing task spins without end. The default router hides this
        by fulfilling in FIFO order, which would give a replica chosen for one prompt's prefix to another prompt.
        """
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                self._remove_pending_request_from_indices(pending)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
