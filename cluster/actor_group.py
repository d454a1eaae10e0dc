"""`RayExecutor`: the tensor-parallel ranks as Ray actors in one placement group, one broadcast per step.

    driver (engine, scheduler)                placement group: one bundle per rank (STRICT_PACK: one node)
    RayExecutor.execute_model(sched) ──► compiled graph ──► WorkerActor rank 0 ─┐ torch.distributed
                                                      ├──► WorkerActor rank 1 ─┤ (NCCL on GPUs,
                                                      └──► ...                 ─┘  gloo on CPU)
                                     ◄── rank 0's ModelRunnerOutput (other ranks return None)

Start-up: join or start Ray, take the caller's placement group (a Serve replica deployed with
placement from cluster/placement.py) or create one, start one actor per bundle, rendezvous at
rank 0's `tcp://ip:port`, load the shards, profile memory on every rank and allocate the smallest pool any rank
can hold. Each step's `SchedulerOutput` goes to all ranks through a Ray Compiled Graph (shared-memory channels: a
fraction of a millisecond, where a plain actor call per rank costs about a millisecond each); plain calls are
the fallback when the graph cannot be compiled.

Failures: a step that raised on every rank (the same bad input) is an `ExecutorError` and the engine goes on; a dead
actor, a channel error, a step past its timeout or ranks that disagree is `ExecutorError(is_fatal=True)`, and
`check_health()` keeps raising it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from dataclasses import dataclass, replace

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)

from cluster.placement import PLACEMENT_STRATEGY, ReplicaPlacement, worker_actor_options
from cluster.ray_utils import actor_env_vars, ensure_ray_initialized, resolve_cluster_device
from engine import envs
from engine.config import EngineConfig
from engine.executor import Executor, ExecutorError, StepHandle
from engine.outputs import DraftAsk, GrammarBitmask, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0
HEALTH_CHECK_INTERVAL_S = 1.0  # check_health pings only when no step has answered for this long
SHUTDOWN_TIMEOUT_S = 10.0


# ---- the worker actor ------------------------------------------------------------------------------------------
@dataclass
class StepFailure:
    """What a rank returns instead of raising: the engine turns it into an ExecutorError."""

    rank: int
    error: str
    traceback: str
    is_fatal: bool = False  # a KV move failed: the rank's pools no longer match the driver's books


@dataclass
class SampleStep:
    """The driver's second message for a step that deferred sampling: its constrained rows' grammar bitmask."""

    bitmask: GrammarBitmask


@dataclass
class AwaitingBitmask:
    """A rank's answer to a step that launched its forward and awaits its SampleStep: the constrained rows, each
    with the drafts it verifies (Executor.awaiting)."""

    drafts: dict[str, list[int]]


class WorkerActor:
    """One tensor-parallel rank in its own Ray actor: a `workers.worker.Worker` plus device and rendezvous set-up."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int):
        self.config, self.rank, self.world_size = config, rank, world_size
        self.is_cuda = config.parallel.device == "cuda"
        if self.is_cuda:
            _list_all_gpus_when_ray_sets_none()
        else:
            import torch

            torch.set_num_threads(envs.get("PAGODA_TORCH_THREADS"))
        self.worker = None
        self.device_index: int | None = None
        self.awaiting = None  # the launched step (workers.model_runner.PendingStep) that awaits a SampleStep

    def get_init_method(self) -> str:
        """Rank 0: a free port on this node, as torch.distributed's `tcp://ip:port` rendezvous."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"

    def init_worker(self, init_method: str) -> tuple[int, int, int]:
        """Joins the group, loads this rank's shard; returns how many KV blocks fit here, on the device and in the
        host tier, and a block's bytes on this rank."""
        from workers.worker import Worker

        self.device_index = local_gpu_index() if self.is_cuda else None
        self.worker = Worker(self.config, self.rank, self.world_size, init_method, self.device_index)
        self.worker.init_device()
        self.worker.load_model()
        return self.worker.determine_num_blocks(), self.worker.determine_num_host_blocks(), self.worker.block_bytes

    def init_kv_cache(self, num_blocks: int, num_host_blocks: int) -> float | None:
        """The pools, the graphs and the warm-up; returns the rank's batch-1 decode step (Worker.decode_step_s)."""
        self.worker.init_kv_cache(num_blocks, num_host_blocks)
        return self.worker.decode_step_s

    def startup_phases(self) -> dict[str, float]:
        return dict(self.worker.startup.phases)

    def execute_model(self, message: SchedulerOutput | SampleStep | DraftAsk,
                      ) -> ModelRunnerOutput | AwaitingBitmask | StepFailure | dict | None:
        """A step (its output, or AwaitingBitmask when its constrained rows wait for the driver's bitmask), the
        SampleStep of the step that waits (its output), or a DraftAsk (the draft model's drafts, before a step)."""
        try:
            if self.is_cuda:
                self._ensure_current_device()
            if isinstance(message, DraftAsk):
                return self.worker.propose_drafts(message)
            if isinstance(message, SampleStep):
                step, self.awaiting = self.awaiting, None
                if step is None:
                    raise RuntimeError("a grammar bitmask came for no step")
                step.sample(message.bitmask)
                return step.result()
            step = self.worker.runner.execute_model_async(message, defer_sampling=True)
            if step.bitmask_req_ids:
                self.awaiting = step
                return AwaitingBitmask(step.awaiting_drafts())
            return step.result()
        except Exception as e:  # noqa: BLE001 - an error value, not an exception: the graph and the actor stay usable
            from workers.kv_pool import KVMoveError  # (loaded with the worker already)

            return StepFailure(self.rank, f"{type(e).__name__}: {e}", traceback.format_exc(),
                               is_fatal=isinstance(e, KVMoveError))

    def _ensure_current_device(self) -> None:
        """The compiled graph runs steps on its own thread; CUDA's current device is per thread (Triton uses it)."""
        import torch

        if torch.cuda.current_device() != self.device_index:
            torch.cuda.set_device(self.device_index)

    def take_lora_reads(self) -> dict[int, str | None]:
        """This rank's adapter reads finished since the last call (beside the steps: the compiled graph runs them
        on a thread of its own)."""
        return self.worker.take_lora_reads()

    def ping(self) -> int:
        return self.rank

    def check_integrity(self, block_tables: dict[str, list[int]] | None = None) -> None:
        self.worker.check_integrity(block_tables)

    def device_stats(self) -> tuple[int, float]:
        return self.worker.device_stats()

    def describe(self) -> dict:
        return self.worker.describe()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()  # destroys the process group
            self.worker = None


def _list_all_gpus_when_ray_sets_none() -> None:
    """With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES Ray leaves CUDA_VISIBLE_DEVICES unset, yet its compiled
    graphs look the actor's GPU ids up in it ("CUDA_VISIBLE_DEVICES set incorrectly"): name every GPU, in order,
    which is what the process sees anyway."""
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        import torch

        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(torch.cuda.device_count()))


def local_gpu_index(gpu_ids: list | None = None, visible: str | None = None) -> int:
    """The torch device index of this actor's GPU.

    Ray's default sets CUDA_VISIBLE_DEVICES to the actor's GPU, which is then index 0. With
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 every rank sees all of the node's GPUs (torch symmetric memory
    needs that) and the index is Ray's GPU id, or its position when the node itself restricts the visible set."""
    gpu_ids = ray.get_gpu_ids() if gpu_ids is None else gpu_ids
    assert gpu_ids, "a GPU worker actor was given no GPU (is its bundle missing 'GPU'?)"
    gpu_id = str(gpu_ids[0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [v.strip() for v in visible.split(",")] if visible else []
    return ids.index(gpu_id) if gpu_id in ids else int(gpu_id)


# ---- the per-step broadcast ------------------------------------------------------------------------------------
class StepBroadcast:
    """Sends one SchedulerOutput to every rank's `execute_model` and gathers the results, in rank order.

    Through a compiled graph when it compiles (one serialization, shared-memory channels, no task submission per
    rank), else one plain actor call per rank."""

    def __init__(self, actors: list, use_compiled_graph: bool = True):
        self.actors = actors
        self.compiled = None
        if use_compiled_graph:
            try:
                from ray.dag import InputNode, MultiOutputNode

                with InputNode() as inp:
                    dag = MultiOutputNode([a.execute_model.bind(inp) for a in actors])
                self.compiled = dag.experimental_compile()
            except Exception:
                logger.exception("could not compile the step graph; using one actor call per rank")

    @property
    def is_compiled(self) -> bool:
        return self.compiled is not None

    def launch(self, sched) -> list:
        """Sends the step without waiting for it (steps queue up in order on every rank)."""
        if self.compiled is not None:
            return self.compiled.execute(sched)
        return [a.execute_model.remote(sched) for a in self.actors]  # by value: inlined, faster than a put

    def collect(self, pending: list, timeout_s: float) -> list:
        return ray.get(pending, timeout=timeout_s)

    def run(self, sched, timeout_s: float) -> list:
        return self.collect(self.launch(sched), timeout_s)

    def teardown(self) -> None:
        compiled, self.compiled = self.compiled, None
        if compiled is not None:
            try:
                compiled.teardown()
            except Exception:
                logger.exception("tearing down the step graph failed")


@dataclass
class RayStep:
    """A step on the ranks, as the driver tracks it: the answers still to read (of the step, then of its SampleStep)
    and what the step's answer said."""

    refs: list | None  # the graph's (or the actor calls') refs of the message last sent for this step
    awaiting: dict[str, list[int]] | None = None  # None: the step's answer is not read yet
    output: ModelRunnerOutput | None = None


# ---- the executor ----------------------------------------------------------------------------------------------
class RayExecutor(Executor):
    """`tensor_parallel_size` WorkerActors in one placement group; rank 0's output is the step's output."""

    # The driver launches step N+1 before reading step N; each rank runs its steps in order, so by the time it
    # runs N+1 it has appended N's token itself.
    supports_overlap = True
    supports_deferred_sampling = True

    def __init__(self, config: EngineConfig, use_compiled_graph: bool | None = None):
        if use_compiled_graph is None:
            use_compiled_graph = not envs.get("PAGODA_DISABLE_COMPILED_GRAPH")
        self.world_size = config.parallel.tensor_parallel_size
        self.actors: list = []
        self.placement_group: PlacementGroup | None = None
        self._owns_placement_group = False
        self._broadcast: StepBroadcast | None = None
        self._dead_error: str | None = None
        self._is_shut_down = False
        self._steps_in_flight: set[int] = set()  # ids of the steps launched and not yet collected
        self._last_contact = time.monotonic()
        self._startup_phases: dict[str, float] = {}
        self._lora_polls: list = []  # each rank's take_lora_reads call in flight (None: none)
        self._lora_reports: dict[int, list[str | None]] = {}  # read id -> the ranks' answers so far
        ensure_ray_initialized(num_cpus_needed=self.world_size + 1)
        try:
            caller_pg = get_current_placement_group()
            device = resolve_cluster_device(config.parallel.device, caller_pg.bundle_specs if caller_pg else None)
            self.config = replace(config, parallel=replace(config.parallel, device=device))
            self.placement_group = self._acquire_placement_group(caller_pg, device)
            self.actors = self._start_actors(device)
            self.num_kv_blocks, self.num_host_kv_blocks = self._init_workers()
            self._broadcast = StepBroadcast(self.actors, use_compiled_graph)
        except BaseException:
            self._dead_error = "start-up failed"  # no orderly shutdown: ranks may be stuck in the rendezvous
            self.shutdown()
            raise
        logger.info("%d ranks on %s, %d KV blocks (%d in the host tier), step broadcast through %s",
                    self.world_size, device, self.num_kv_blocks, self.num_host_kv_blocks,
                    "a compiled graph" if self.is_compiled_graph else "actor calls")

    def startup_phases(self) -> dict[str, float]:
        return dict(self._startup_phases)

    @property
    def is_compiled_graph(self) -> bool:
        return self._broadcast is not None and self._broadcast.is_compiled

    # ---- start-up --------------------------------------------------------------------------------------------
    def _acquire_placement_group(self, caller_pg: PlacementGroup | None, device: str) -> PlacementGroup:
        """The caller's group when it runs in one (never a nested group), else a new one that we remove later."""
        if caller_pg is not None:
            bundles = caller_pg.bundle_specs
            if len(bundles) < self.world_size:
                raise ValueError(f"the caller's placement group has {len(bundles)} bundles; tensor_parallel_size="
                                 f"{self.world_size} needs one per rank: deploy with the bundles of "
                                 f"cluster.placement.ReplicaPlacement")
            if device == "cuda" and any(b.get("GPU", 0) < 1 for b in bundles[:self.world_size]):
                raise ValueError(f"the caller's placement group bundles {bundles} do not each hold a GPU")
            return caller_pg
        bundles = ReplicaPlacement(self.world_size, device).bundles()
        pg = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
        self._owns_placement_group = True
        timeout_s = envs.get("PAGODA_PLACEMENT_TIMEOUT_S")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            self._owns_placement_group = False
            raise RuntimeError(f"could not place {bundles} ({PLACEMENT_STRATEGY}) within {timeout_s:.0f} s;"
                               f" the cluster has {ray.available_resources()} available") from None
        return pg

    def _start_actors(self, device: str) -> list:
        env_vars = actor_env_vars()
        if device == "cuda" and self.world_size > 1:
            # The all-reduce's symmetric memory (workers/parallel.py) maps every peer's buffer: each rank must see
            # its peers' GPUs. local_gpu_index maps Ray's GPU id to the device index either way.
            env_vars.setdefault("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
        remote_class = ray.remote(WorkerActor)
        return [remote_class.options(**worker_actor_options(device, self.placement_group, rank, env_vars))
                .remote(self.config, rank, self.world_size) for rank in range(self.world_size)]

    def _init_workers(self) -> tuple[int, int]:
        """Rendezvous, load every shard, then the smallest KV pool (and host tier) any rank can hold, on every
        rank. Returns (device blocks, host blocks); sets kv_block_bytes and decode_step_s."""
        timeout_s = envs.get("PAGODA_WORKER_INIT_TIMEOUT_S")
        init_method = ray.get(self.actors[0].get_init_method.remote(), timeout=timeout_s)
        answers = _get_all([a.init_worker.remote(init_method) for a in self.actors], timeout_s)
        per_rank = [(blocks, host_blocks) for blocks, host_blocks, _ in answers]
        self.kv_block_bytes = sum(block_bytes for _, _, block_bytes in answers)
        num_blocks, num_host_blocks = (min(counts) for counts in zip(*per_rank))
        if len(set(per_rank)) > 1:
            logger.info("KV blocks per rank (device, host) %s: using %d and %d on every rank", per_rank, num_blocks,
                        num_host_blocks)
        self.decode_step_s = _get_all([a.init_kv_cache.remote(num_blocks, num_host_blocks) for a in self.actors],
                                      timeout_s)[0]  # the driver rank's (the ranks replay their graphs together)
        self._startup_phases = ray.get(self.actors[0].startup_phases.remote(), timeout=timeout_s)
        return num_blocks, num_host_blocks

    # ---- steps -----------------------------------------------------------------------------------------------
    # launch returns at once: the driver schedules the next step while the ranks run this one (the next step
    # waits in the graph's channel). A step whose constrained rows await their bitmask is two messages to the
    # ranks, the step and then its SampleStep; their answers are read in the order they were sent.
    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        step = RayStep(self._launch(scheduler_output))
        self._steps_in_flight.add(id(step))
        return StepHandle(step)

    def awaiting(self, handle: StepHandle) -> dict[str, list[int]]:
        step: RayStep = handle.payload
        if step.awaiting is None:  # the step's answer: AwaitingBitmask, or (no constrained row sampled) its output
            answer = self._collect(step.refs)
            step.refs = None
            if isinstance(answer, AwaitingBitmask):
                step.awaiting = answer.drafts
            else:
                step.awaiting, step.output = {}, answer
        return step.awaiting

    def sample(self, handle: StepHandle, bitmask: GrammarBitmask) -> None:
        step: RayStep = handle.payload
        assert step.awaiting and step.refs is None, "sample() for a step that does not await its bitmask"
        step.refs = self._launch(SampleStep(bitmask))

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        step: RayStep = handle.payload
        self._steps_in_flight.discard(id(step))
        if self.awaiting(handle) and step.output is None:
            if step.refs is None:  # the ranks hold a step that nothing will sample: no later step can run
                raise self._mark_dead(f"a step of {sorted(step.awaiting)} was collected before its grammar bitmask "
                                      "came")
            step.output = self._collect(step.refs)
        return step.output

    def propose_drafts(self, ask: DraftAsk) -> dict[str, list[int]]:
        """Every rank runs the draft model's passes (sharded as the target); rank 0's answer. No step is in flight:
        speculation turns overlapped steps off."""
        return self._collect(self._launch(ask))

    def check_integrity(self, block_tables: dict[str, list[int]] | None = None) -> None:
        # The ranks' tables only with no step in flight: a rank may not have taken the last launched one yet (its
        # compiled graph runs steps on a thread of their own).
        tables = block_tables if not self._steps_in_flight else None
        ray.get([a.check_integrity.remote(tables) for a in self.actors], timeout=PING_TIMEOUT_S)

    def _launch(self, message: SchedulerOutput | SampleStep | DraftAsk) -> list:
        if self._dead_error is not None:
            raise ExecutorError(self._dead_error, is_fatal=True)
        if self._is_shut_down:
            raise ExecutorError("the executor is shut down", is_fatal=True)
        try:
            return self._broadcast.launch(message)
        except Exception as e:  # the graph was torn down (a rank died) or its channel is full
            raise self._mark_dead(f"worker group failed: {_one_line(e)}") from e

    def _collect(self, pending: list) -> ModelRunnerOutput:
        try:
            results = self._broadcast.collect(pending, envs.get("PAGODA_STEP_TIMEOUT_S"))
        except RayTaskError as e:  # raised in a rank outside the step's own try (e.g. deserializing the step)
            raise ExecutorError(f"step failed on a worker: {_one_line(e)}") from e
        except Exception as e:  # a dead actor, a closed channel, a step past its timeout
            raise self._mark_dead(f"worker group failed: {_one_line(e)}") from e
        self._last_contact = time.monotonic()
        failures = [r for r in results if isinstance(r, StepFailure)]
        if failures:
            message = f"step failed on rank {failures[0].rank}: {failures[0].error}"
            logger.error("%s\n%s", message, failures[0].traceback)
            if len(failures) < len(results):  # the ranks' persistent batches no longer agree
                raise self._mark_dead(f"{message} (and not on every rank)")
            if any(f.is_fatal for f in failures):
                raise self._mark_dead(message)
            raise ExecutorError(message)
        return results[0]

    def _mark_dead(self, message: str) -> ExecutorError:
        self._dead_error = message
        logger.error(message)
        return ExecutorError(message, is_fatal=True)

    def take_lora_reads(self) -> dict[int, str | None]:
        """Asks every rank (at most one call in flight each) which reads it finished, never waiting for an answer;
        a read is done once every rank has reported it."""
        if self._dead_error is not None:
            raise ExecutorError(self._dead_error, is_fatal=True)
        if not self._lora_polls:
            self._lora_polls = [None] * len(self.actors)
        for rank, actor in enumerate(self.actors):
            if self._lora_polls[rank] is None:
                self._lora_polls[rank] = actor.take_lora_reads.remote()
        ready, _ = ray.wait(self._lora_polls, num_returns=len(self._lora_polls), timeout=0)
        for rank, ref in enumerate(self._lora_polls):
            if ref not in ready:
                continue
            self._lora_polls[rank] = None
            try:
                answer = ray.get(ref)
            except Exception as e:  # a dead actor
                raise self._mark_dead(f"worker group failed: {_one_line(e)}") from e
            for read_id, error in answer.items():
                self._lora_reports.setdefault(read_id, []).append(error)
        done = {read_id: next((e for e in errors if e is not None), None)
                for read_id, errors in self._lora_reports.items() if len(errors) == len(self.actors)}
        for read_id in done:
            del self._lora_reports[read_id]
        return done

    def check_health(self) -> None:
        """Raises ExecutorError(is_fatal=True) once a rank is known dead. Cheap while steps run: it pings the
        actors only when no step has answered for HEALTH_CHECK_INTERVAL_S."""
        if self._dead_error is not None:
            raise ExecutorError(self._dead_error, is_fatal=True)
        if self._is_shut_down or time.monotonic() - self._last_contact < HEALTH_CHECK_INTERVAL_S:
            return
        try:
            ray.get([a.ping.remote() for a in self.actors], timeout=PING_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as e:
            raise self._mark_dead(f"worker actor is dead or unresponsive: {_one_line(e)}") from e
        self._last_contact = time.monotonic()

    def describe(self) -> list[dict]:
        return ray.get([a.describe.remote() for a in self.actors], timeout=PING_TIMEOUT_S)

    def device_stats(self) -> tuple[int, float]:
        if self.config.parallel.device != "cuda" or self._dead_error is not None:
            return 0, 0.0
        stats = ray.get([a.device_stats.remote() for a in self.actors], timeout=PING_TIMEOUT_S)
        return sum(used for used, _ in stats), sum(u for _, u in stats) / len(stats)

    # ---- shutdown --------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tears down the graph, leaves the process groups, kills the actors, removes our placement group."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        if not ray.is_initialized():  # the cluster is gone, and everything with it
            return
        if self._broadcast is not None:
            self._broadcast.teardown()
        if self.actors and self._dead_error is None:
            refs = [a.shutdown.remote() for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._owns_placement_group and self.placement_group is not None:
            remove_placement_group(self.placement_group)
        self.placement_group = None


def _one_line(e: BaseException) -> str:
    """Ray's errors run over many lines; a request's error message gets the first (of the cause, if any)."""
    cause = getattr(e, "cause", None)
    if isinstance(e, RayTaskError) and isinstance(cause, BaseException):
        e = cause
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _get_all(refs: list, timeout_s: float) -> list:
    """ray.get that fails fast: the first rank to raise stops the wait (the others may block in a rendezvous)."""
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            raise TimeoutError(f"{len(pending)} of {len(refs)} workers did not answer within {timeout_s:.0f} s")
        ray.get(ready)
    return ray.get(refs)
