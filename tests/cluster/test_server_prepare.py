"""A replica of a GPU model imports xgrammar while it starts, as its ingress does: each constrained request's grammar
is built in the replica's `_prepare` too, and without it the first constrained request paid the import (2 s of CPU
here; the first burst of 64 constrained streams through `pagoda serve` on an H200 lagged plain's by 0.2-0.4 s)."""

import sys

from cluster.app import build_app
from cluster.placement import ReplicaPlacement
from cluster.server import LLMServer, ServerSettings
from engine.config import EngineArgs


def _settings_and_ingress_config(device: str):
    app = build_app({"models": [{"model": "tiny", "served_model_name": "m", "device": device}]})
    models, _cards, config = app._bound_deployment.init_args
    return models["m"]._bound_deployment.init_args[1], config


def test_build_app_prepares_structured_outputs_where_the_model_runs_on_gpus():
    settings, config = _settings_and_ingress_config("cuda")
    assert settings.prepare_structured_outputs and config["prepare_structured_outputs"]
    settings, config = _settings_and_ingress_config("cpu")
    assert not settings.prepare_structured_outputs and not config["prepare_structured_outputs"]


def test_a_replica_told_to_prepare_imports_xgrammar_as_it_starts(tiny_model_dir):
    args = EngineArgs(model=tiny_model_dir, device="cpu", num_kv_blocks=64)
    placement = ReplicaPlacement(1, "cpu", engine_process=False)
    plain = LLMServer.func_or_class(args, ServerSettings("tiny", placement))
    prepared = LLMServer.func_or_class(args, ServerSettings("tiny", placement, prepare_structured_outputs=True))
    try:
        assert plain.xgrammar_import is None
        prepared.xgrammar_import.join(timeout=120)
        assert not prepared.xgrammar_import.is_alive()
        assert "xgrammar" in sys.modules
    finally:
        plain.engine.shutdown()
        prepared.engine.shutdown()
