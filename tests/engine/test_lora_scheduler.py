"""LoRA admission, driven with hand-made outputs: a request runs only with its adapter in a GPU slot; with more
adapters than slots the others wait (never fail) and take a slot once no running request uses it (LRU); each
slot's load is sent once, in the step that first needs it. With a host cache (the engine's), an adapter takes a
slot only once the workers have read it into host memory in the background; the reads and the cache's evictions
travel with the steps."""

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.lora import LoRAAdapter, LoRARequest, LoRASlots
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from tests.engine.test_scheduler import fake_step


def adapter(adapter_id: int) -> LoRAAdapter:
    return LoRAAdapter(LoRARequest(f"a{adapter_id}", adapter_id, f"/adapters/{adapter_id}"), 8, 2.0,
                       frozenset({(0, "q_proj")}))


def make_scheduler(max_loras: int) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, 1024), BlockManager(64, 4), LoRASlots(max_loras))


def request(req_id: str, lora: LoRAAdapter | None, max_tokens: int = 3) -> Request:
    return Request(req_id, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens), max_tokens, lora=lora)


def users(s: Scheduler) -> list[int]:
    counts = [0] * s.lora_slots.num_slots
    for req in s.running:
        if req.lora is not None:
            counts[req.lora_slot] += 1
    return counts


def test_more_adapters_than_slots_wait_then_take_the_lru_slot():
    s = make_scheduler(max_loras=2)
    a1, a2, a3 = adapter(1), adapter(2), adapter(3)
    for req in [request("x1", a1), request("y2", a2, max_tokens=6), request("z3", a3), request("base", None),
                request("x1b", a1)]:
        s.add_request(req)
    first = fake_step(s)
    assert [(slot, a.request.id) for slot, a in first.lora_loads] == [(0, 1), (1, 2)]
    assert set(first.num_scheduled_tokens) == {"x1", "y2", "base", "x1b"}  # z3 waits: both slots in use
    assert {n.req_id: n.lora_slot for n in first.new_reqs} == {"x1": 0, "y2": 1, "base": -1, "x1b": 0}
    assert [r.req_id for r in s.waiting] == ["z3"]
    outs = [fake_step(s) for _ in range(2)]  # x1 and x1b finish (3 tokens); slot 0 is used by nobody now
    assert all(not o.lora_loads for o in outs) and "z3" not in s.running
    s.lora_slots.check_integrity(users(s))
    fourth = fake_step(s)
    assert [(slot, a.request.id) for slot, a in fourth.lora_loads] == [(0, 3)]  # the LRU unused slot: a1's
    assert [n.lora_slot for n in fourth.new_reqs] == [0]
    s.lora_slots.check_integrity(users(s))
    while s.requests:
        fake_step(s)
    s.lora_slots.check_integrity([0, 0])
    s.add_request(request("again", a3))  # still resident: no load
    assert not fake_step(s).lora_loads


def test_preemption_releases_the_slot():
    s = Scheduler(SchedulerConfig(8, 64, 1024), BlockManager(4, 4), LoRASlots(1))
    s.add_request(request("a", adapter(1), max_tokens=8))
    s.add_request(request("b", adapter(1), max_tokens=8))
    while s.num_preemptions == 0:
        fake_step(s)
        s.lora_slots.check_integrity(users(s))
    preempted = next(r for r in s.requests.values() if r not in s.running)
    assert preempted.lora_slot == -1
    while s.requests:
        fake_step(s)
        s.lora_slots.check_integrity(users(s))
    assert s.lora_slots.num_loads == 1  # both always ran in the adapter's one slot


def test_an_adapter_takes_a_slot_only_once_read_into_host_memory():
    s = Scheduler(SchedulerConfig(8, 64, 1024), BlockManager(64, 4), LoRASlots(1, max_cpu_loras=2))
    host = s.lora_slots.host
    a1, a2, a3 = adapter(1), adapter(2), adapter(3)
    for req in [request("x1", a1), request("y2", a2), request("z3", a3), request("base", None)]:
        s.add_request(req)
    first = fake_step(s)
    assert first.lora_reads == [(1, a1), (2, a2)]  # the first two adapters ahead in the queue: the cache's size
    assert set(first.num_scheduled_tokens) == {"base"} and not first.lora_loads  # the others wait for their reads
    assert not fake_step(s).lora_reads  # asked once
    assert host.finish(2, None) is a2  # a2 read on every rank: y2 takes the slot, x1 (read still out) waits
    third = fake_step(s)
    assert [(slot, a.request.id) for slot, a in third.lora_loads] == [(0, 2)] and set(third.num_scheduled_tokens) \
        >= {"y2"} and "x1" not in third.num_scheduled_tokens
    host.finish(1, None)  # read, but the one slot is y2's: x1 waits; a2 (in its slot) leaves the host cache to a3
    fourth = fake_step(s)
    assert fourth.lora_evictions == [2] and fourth.lora_reads == [(3, a3)] and not fourth.lora_loads
    s.lora_slots.check_integrity(users(s))
    assert host.finish(3, "OSError: gone") is a3  # a failed read leaves every rank's cache ...
    s.finish_request("z3", RequestStatus.FINISHED_ERROR)  # ... and the engine fails its requests
    assert fake_step(s).lora_evictions == [3] and not host.is_ready(3) and host.num_reading == 0
    while s.requests:
        out = fake_step(s)
        s.lora_slots.check_integrity(users(s))
    assert out.lora_loads == [] and s.lora_slots.num_loads == 2 and host.num_reads == 3  # x1 ran after y2
