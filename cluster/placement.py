"""Where every actor of a model replica runs, derived in one place from the parallel config and the app args.

    one model replica                        GPU, tp N                          CPU, tp 1
    ──────────────────────────────────────────────────────────────────────────────────────────────────────
    placement group (STRICT_PACK, a node)    bundle 0 {CPU: c, GPU: 1, +R}      none
                                             bundle i {GPU: 1}, i < N
    Serve replica (driver, HTTP streams)     bundle 0, CPU c                    {CPU: c, +R}
    EngineCore actor (scheduler, step loop)  bundle 0 (tp 1: holds the GPU)     hard affinity to the replica's node
    WorkerActor rank r (tp > 1)              bundle r, GPU 1                    —

R: the model's `replica_resources` (custom resources) and `accelerator_type` (Ray's `accelerator_type:<T>`
resource), asked for once, by the bundle or the replica that lands on the node. CPU with tp N > 1 is the GPU
layout with {CPU: 1} in place of each GPU (a core per rank). Nothing else places actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEMENT_STRATEGY = "STRICT_PACK"  # every rank of a replica on one node (NVLink)
ACCELERATOR_RESOURCE_AMOUNT = 0.001  # how Ray asks for an accelerator type: a sliver of its marker resource


@dataclass(frozen=True)
class ReplicaPlacement:
    tensor_parallel_size: int
    device: str  # resolved: "cpu" or "cuda"
    num_cpus: float = 1.0  # the replica's own CPUs
    engine_process: bool = True  # the EngineCore in an actor of its own (else in the replica's process)
    accelerator_type: str | None = None  # e.g. "H100": only nodes with that accelerator
    resources: dict[str, float] = field(default_factory=dict)  # custom resources, e.g. {"model_slot": 1}
    label_selector: dict[str, str] = field(default_factory=dict)  # Ray node labels the replica's node must have

    def __post_init__(self):
        assert self.device in ("cpu", "cuda"), f"resolve the device first, got {self.device!r}"

    @property
    def _extra(self) -> dict[str, float]:
        extra = dict(self.resources)
        if self.accelerator_type:
            extra[f"accelerator_type:{self.accelerator_type}"] = ACCELERATOR_RESOURCE_AMOUNT
        return extra

    @property
    def uses_placement_group(self) -> bool:
        return self.tensor_parallel_size > 1 or (self.device == "cuda" and self.engine_process)

    def bundles(self) -> list[dict[str, float]]:
        """One bundle per rank; bundle 0 also holds the replica and the engine actor."""
        unit = "GPU" if self.device == "cuda" else "CPU"
        first = {"CPU": self.num_cpus} if self.num_cpus > 0 else {}
        if unit == "GPU":
            first["GPU"] = 1
        else:
            first["CPU"] = max(self.num_cpus, 1.0)  # rank 0 computes beside the replica: a core at least
        first |= self._extra
        return [first] + [{unit: 1} for _ in range(self.tensor_parallel_size - 1)]

    def replica_options(self) -> dict:
        """Serve deployment options for the replica."""
        if not self.uses_placement_group:
            in_replica_gpu = self.device == "cuda" and not self.engine_process  # the engine is in the replica
            options = {"num_cpus": self.num_cpus, "num_gpus": 1 if in_replica_gpu else 0}
            if self.resources:
                options["resources"] = dict(self.resources)
            if self.accelerator_type:
                options["accelerator_type"] = self.accelerator_type
            if self.label_selector:
                options["label_selector"] = dict(self.label_selector)
            return {"ray_actor_options": options}
        bundles = self.bundles()
        options = {"ray_actor_options": {"num_cpus": bundles[0].get("CPU", 0) if self.device == "cpu"
                                         else self.num_cpus, "num_gpus": 0},
                   "placement_group_bundles": bundles, "placement_group_strategy": PLACEMENT_STRATEGY}
        if self.label_selector:
            options["placement_group_bundle_label_selector"] = [dict(self.label_selector)] * len(bundles)
        return options

    def engine_actor_options(self, env_vars: dict[str, str]) -> dict:
        """Called inside the replica: the engine actor in the replica's bundle, or pinned to its node."""
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        holds_gpu = self.device == "cuda" and self.tensor_parallel_size == 1
        options = {"num_cpus": 0, "num_gpus": 1 if holds_gpu else 0, "runtime_env": {"env_vars": env_vars}}
        pg = get_current_placement_group()
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                              placement_group_bundle_index=0)
        else:  # it reserves nothing (its replica did): it must never land on another node
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                            soft=False)
        return options


def worker_actor_options(device: str, placement_group, rank: int, env_vars: dict[str, str]) -> dict:
    """Rank r's WorkerActor: bundle r of the replica's placement group; it asks for the bundle's GPU only."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group, placement_group_bundle_index=rank)
    return {"num_cpus": 0, "num_gpus": 1 if device == "cuda" else 0, "scheduling_strategy": strategy,
            "runtime_env": {"env_vars": env_vars}}


def ingress_options(num_cpus: float, resources: dict[str, float], label_selector: dict[str, str]) -> dict:
    """The HTTP ingress replicas' ray_actor_options (e.g. `{"head": 1}` to keep them on the head node)."""
    options: dict = {"num_cpus": num_cpus}
    if resources:
        options["resources"] = dict(resources)
    if label_selector:
        options["label_selector"] = dict(label_selector)
    return options
