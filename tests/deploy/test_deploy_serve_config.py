"""deploy/serve*.yaml: valid Ray Serve config files (Ray's own schema) holding the args of cluster.app:build_app."""

import copy

import pydantic
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

SERVE_FILES = ["deploy/serve.yaml", "deploy/serve-70b.yaml", "deploy/serve-70b-fp8.yaml"]


def _load(repo, name):
    return yaml.safe_load((repo / name).read_text())


@pytest.mark.parametrize("name", SERVE_FILES)
def test_serve_config_passes_rays_schema(repo, name):
    config = ServeDeploySchema.model_validate(_load(repo, name))
    assert config.http_options.host == "0.0.0.0" and config.http_options.port == 8000
    (app,) = config.applications
    assert app.import_path == "cluster.app:build_app"
    assert app.route_prefix == "/"


@pytest.mark.parametrize("name", SERVE_FILES)
def test_serve_config_args_are_build_app_args(repo, name):
    """build_app's own validation (pydantic, unknown keys refused) accepts the args; no cluster is touched."""
    app = pytest.importorskip("cluster.app")
    args = app.parse_args(_load(repo, name)["applications"][0]["args"])
    for model in args.models:
        assert model.engine.model.startswith("/models/") and model.served_model_name
        assert model.engine.device == "cuda", \
            "device 'auto' would resolve to cpu if no GPU pod has joined at build time"
        assert (model.num_replicas is None) != (model.autoscaling_config is None)


def test_build_app_args_check_can_fail(repo):
    app = pytest.importorskip("cluster.app")
    args = copy.deepcopy(_load(repo, "deploy/serve.yaml")["applications"][0]["args"])
    args["models"][0]["tensor_paralel_size"] = 2
    with pytest.raises(ValueError, match="tensor_paralel_size"):
        app.parse_args(args)


def test_serve_schema_check_can_fail(repo):
    """Ray's schema really rejects a broken config (here: an import path with no module separator)."""
    config = copy.deepcopy(_load(repo, "deploy/serve.yaml"))
    config["applications"][0]["import_path"] = "build_app"
    with pytest.raises(pydantic.ValidationError, match="import path"):
        ServeDeploySchema.model_validate(config)


@pytest.mark.parametrize("name", SERVE_FILES)
def test_pagoda_policy_is_on_and_serves_own_one_flag_away(repo, name):
    """The config names Pagoda's policy and its knobs; `policy: ongoing_requests` gives Serve's own policy."""
    app = pytest.importorskip("cluster.app")
    from cluster.autoscaling import POLICY_PATH

    args = _load(repo, name)["applications"][0]["args"]
    scaling = args["models"][0]["autoscaling_config"]
    assert scaling["policy"] == "pagoda"
    assert {"target_kv_cache_usage", "target_waiting_requests", "upscale_delay_s", "downscale_delay_s"} <= set(scaling)
    config = app.parse_args(args).models[0].autoscaling_config.serve_config()
    assert config["policy"]["policy_function"] == POLICY_PATH
    assert config["policy"]["policy_kwargs"]["target_kv_cache_usage"] == scaling["target_kv_cache_usage"]
    serves_own = copy.deepcopy(args)
    serves_own["models"][0]["autoscaling_config"]["policy"] = "ongoing_requests"
    config = app.parse_args(serves_own).models[0].autoscaling_config.serve_config()
    assert "policy" not in config and config["upscale_delay_s"] == scaling["upscale_delay_s"]


@pytest.mark.parametrize("name", ["deploy/serve.yaml", "k8s/rayservice-8b.yaml"])
def test_the_commented_lora_example_is_valid_app_args(repo, name):
    """Uncommented, the LoRA lines of the example are args build_app takes: the adapters, on the model's name."""
    import re

    app = pytest.importorskip("cluster.app")
    keys = r"(enable_lora|max_loras|max_lora_rank|max_cpu_loras|lora_modules|  - \{name|allow_runtime_lora_updating)"
    text = re.sub(rf"^(\s*)# {keys}", r"\1\2", (repo / name).read_text(), flags=re.M)
    config = yaml.safe_load(text)
    if name.startswith("k8s/"):
        config = yaml.safe_load(config["spec"]["serveConfigV2"])
    args = app.parse_args(config["applications"][0]["args"])
    (model,) = args.models
    assert model.engine.enable_lora and args.allow_runtime_lora_updating
    assert [(m.name, m.base_model_name) for m in model.lora_modules] == [("sql", "llama-3-8b"),
                                                                         ("support", "llama-3-8b")]
