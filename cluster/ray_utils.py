"""Ray helpers the other cluster modules share: joining or starting a cluster, what device it offers, and the
environment of the actors Pagoda starts."""

from __future__ import annotations

import logging
import os

import ray

from engine import envs

logger = logging.getLogger(__name__)

# Always off on the H200 machines: NVLink multicast (NVLS / multimem) must never be used there.
ACTOR_ENV_VARS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Ray's own variable, passed on when the caller sets it (symmetric memory needs every rank to see every GPU).
FORWARDED_RAY_VARS = ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",)


def actor_env_vars() -> dict[str, str]:
    """The environment of the actors Pagoda starts (workers, the engine actor): the fixed settings above, and
    the PAGODA_* variables and forwarded Ray variables that this process has."""
    forwarded = {k: os.environ[k] for k in FORWARDED_RAY_VARS if k in os.environ}
    return ACTOR_ENV_VARS | envs.forwarded() | forwarded


def resolve_cluster_device(device: str, bundles: list[dict] | None = None) -> str:
    """'auto' is 'cuda' when the placement group's bundles (or, without one, the cluster) have GPUs; the
    driver's own devices do not count: a replica may hold no GPU while its workers do."""
    if device != "auto":
        return device
    if bundles is not None:
        return "cuda" if any(b.get("GPU", 0) > 0 for b in bundles) else "cpu"
    if ray.is_initialized():
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    from engine.config import resolve_device

    return resolve_device(device)


def ensure_ray_initialized(num_cpus_needed: int = 1) -> None:
    """Joins the running cluster (RAY_ADDRESS, or the one `ray start` made) or starts a local one; never re-inits.

    Not plain `address="auto"` when there is no such cluster: its legacy fallback attaches to any Ray process it
    finds on the machine (another program's private cluster)."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS") or _bootstrap_address():
        try:
            ray.init(address="auto")
            return
        except ConnectionError as e:
            logger.warning("no Ray cluster at the recorded address (%s); starting a local one", e)
    # Ray's CPUs are logical: a small machine still gets a bundle for every rank.
    ray.init(num_cpus=max(os.cpu_count() or 1, num_cpus_needed))


def _bootstrap_address() -> str | None:
    try:
        return ray._private.utils.read_ray_address()
    except Exception:  # noqa: BLE001 - private API: treat any failure as "no cluster started with `ray start`"
        return None
