"""A replica of a GPU model imports xgrammar while it starts, as its ingress and engine do: each constrained
request's grammar is built in the replica's `_prepare` too, and without it the first constrained request paid the
import (2 s of CPU here; the first burst of 64 constrained streams through `pagoda serve` on an H200 lagged plain's
by 0.2-0.4 s)."""

import sys

import cluster.server
from cluster.app import build_app
from cluster.placement import ReplicaPlacement
from cluster.server import LLMServer, ServerSettings
from engine.config import EngineArgs


def _replica_args_and_ingress_config(device: str):
    app = build_app({"models": [{"model": "tiny", "served_model_name": "m", "device": device}]})
    models, _cards, config = app._bound_deployment.init_args
    return models["m"]._bound_deployment.init_args[0], config


def test_build_app_prepares_structured_outputs_where_the_model_runs_on_gpus():
    engine_args, config = _replica_args_and_ingress_config("cuda")
    assert engine_args.device == "cuda" and config["prepare_structured_outputs"]  # the replica reads its device
    engine_args, config = _replica_args_and_ingress_config("cpu")
    assert engine_args.device == "cpu" and not config["prepare_structured_outputs"]


def test_a_gpu_models_replica_imports_xgrammar_as_it_starts(tiny_model_dir, monkeypatch):
    args = EngineArgs(model=tiny_model_dir, device="cpu", num_kv_blocks=64)
    settings = ServerSettings("tiny", ReplicaPlacement(1, "cpu", engine_process=False))
    plain = LLMServer.func_or_class(args, settings)
    # no GPU here: the replica's device rule answers "cuda" (the engine it builds keeps its own rule: it runs on CPU)
    monkeypatch.setattr(cluster.server, "resolve_device", lambda device: "cuda")
    prepared = LLMServer.func_or_class(args, settings)
    try:
        assert plain.xgrammar_import is None
        prepared.xgrammar_import.join(timeout=120)
        assert not prepared.xgrammar_import.is_alive()
        assert "xgrammar" in sys.modules
    finally:
        plain.engine.shutdown()
        prepared.engine.shutdown()
