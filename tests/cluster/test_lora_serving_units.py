"""LoRA serving's pure parts, without a Ray cluster: `pagoda serve`'s adapter flags and the app args they become,
the adapter-aware routing policy, and the lora metrics."""

import json
import random

import pytest

from cluster.app import build_app, parse_args
from cluster.lora_registry import adapter_id
from cluster.metrics import ReplicaMetrics, merge_families
from cluster.router import PrefixAffinity
from deploy.cli import build_parser, main, serve_app_args
from engine.llm_engine import EngineStats

SHARED = "You are a helpful assistant. Always answer in one short sentence, politely. " * 3


def app_args(*flags: str) -> dict:
    return serve_app_args(build_parser().parse_args(["serve", "--model", "tiny", *flags]))


# ---- flags and app args ------------------------------------------------------------------------------------------
def test_lora_flags_become_engine_args_and_modules_in_both_of_vllms_forms():
    args = app_args("--enable-lora", "--max-loras", "3", "--max-lora-rank", "16", "--max-cpu-loras", "5",
                    "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}',
                    "--served-model-name", "base", "alias", "--allow-runtime-lora-updating")
    (model,) = args["models"]
    assert (model["enable_lora"], model["max_loras"], model["max_lora_rank"], model["max_cpu_loras"]) == \
        (True, 3, 16, 5)
    assert model["lora_modules"] == [{"name": "sql", "path": "/a/sql"},
                                     {"name": "chat", "path": "/a/chat", "base_model_name": "base"}]
    assert args["allow_runtime_lora_updating"] is True
    parsed = parse_args(args).models[0]
    assert [(m.name, m.path, m.base_model_name) for m in parsed.lora_modules] == \
        [("sql", "/a/sql", "base"), ("chat", "/a/chat", "base")]  # the default base: the model's first name
    engine = parsed.engine.create_engine_config().lora
    assert (engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (3, 16, 5)
    assert "enable_lora" not in app_args()["models"][0] and "allow_runtime_lora_updating" not in app_args()


@pytest.mark.parametrize("item", ["noequals", "=path", "name=", '{"name": "x"}', '{"name": "x", "path": "p", "y": 1}',
                                  "{not json"])
def test_a_malformed_lora_module_is_refused_by_the_parser(item, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", item])
    assert "--lora-modules" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    ({"models": [{"model": "tiny", "lora_modules": [{"name": "a", "path": "/p"}]}]}, "need enable_lora"),
    ({"models": [{"model": "tiny", "served_model_name": "a", "enable_lora": True,
                  "lora_modules": [{"name": "a", "path": "/p"}]}]}, "must be unique, repeated: ['a']"),
    ({"models": [{"model": "tiny", "enable_lora": True,
                  "lora_modules": [{"name": "a", "path": "/p"}, {"name": "a", "path": "/q"}]}]}, "repeated: ['a']"),
    ({"models": [{"model": "tiny", "served_model_name": "m", "enable_lora": True,
                  "lora_modules": [{"name": "a", "path": "/p", "base_model_name": "other"}]}]}, "not a name of its"),
    ({"models": [{"model": "tiny", "enable_lora": True, "lora_modules": [{"name": "", "path": "/p"}]}]}, "name"),
    ({"models": [{"model": "tiny", "enable_lora": True, "max_lora_rank": 0}]}, "max_lora_rank"),
    ({"models": [{"model": "tiny", "enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}]}, "max_cpu_loras"),
])
def test_bad_lora_app_args_are_refused_naming_the_field(args, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_args(args)


def test_build_app_gives_each_adapter_its_id_and_reads_the_runtime_switch(monkeypatch):
    args = {"models": [{"model": "tiny", "served_model_name": "m1", "enable_lora": True,
                        "lora_modules": [{"name": "a", "path": "/p"}, {"name": "b", "path": "/q"}]},
                       {"model": "tiny", "served_model_name": "m2", "enable_lora": True,
                        "lora_modules": [{"name": "c", "path": "/r"}]},
                       {"model": "tiny", "served_model_name": "m3"}]}
    monkeypatch.delenv("PAGODA_ALLOW_RUNTIME_LORA_UPDATING", raising=False)

    def lora_config(app):
        return app._bound_deployment.init_args[2]["lora"]

    lora = lora_config(build_app(args))
    assert [(m["name"], m["id"], m["base_model_name"]) for m in lora["modules"]] == \
        [("a", adapter_id("a", "/p"), "m1"), ("b", adapter_id("b", "/q"), "m1"), ("c", adapter_id("c", "/r"), "m2")]
    assert lora["models"] == ["m1", "m2"]
    assert lora["allow_runtime_updating"] is False
    monkeypatch.setenv("PAGODA_ALLOW_RUNTIME_LORA_UPDATING", "1")
    again = lora_config(build_app(args))
    assert again["allow_runtime_updating"] is True
    assert again["store_key"] != lora["store_key"]  # a new deployment starts from its lora_modules again
    assert lora_config(build_app(args | {"allow_runtime_lora_updating": False}))["allow_runtime_updating"] is False


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    from tests.lora_adapters import make_adapter

    return make_adapter(tiny_model_dir, str(tmp_path_factory.mktemp("lora") / "qv"), rank=8)


@pytest.mark.parametrize(("problem", "says"), [
    ("missing", "adapter 'bad' (id {id}): has no adapter_config.json"),  # after a good one
    ("rank", "adapter 'bad' (id {id}): r = 8 is larger than max_lora_rank (4)"),
])
def test_pagoda_serve_refuses_a_bad_adapter_before_ray_starts(problem, says, adapter_dir, tmp_path, monkeypatch,
                                                              capsys):
    import ray

    def started(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", started)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    bad = str(tmp_path / "nothing") if problem == "missing" else adapter_dir
    if problem == "missing":
        flags = ["--lora-modules", f"good={adapter_dir}", f"bad={bad}"]
    else:
        flags = ["--max-lora-rank", "4", "--lora-modules", f"bad={bad}"]
    assert main(["serve", "--model", "tiny", "--enable-lora", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error: --lora-modules:") and says.format(id=adapter_id("bad", bad)) in err, err


# ---- routing -----------------------------------------------------------------------------------------------------
def test_an_adapter_goes_where_it_went_and_spreads_when_that_replica_is_busy():
    policy = PrefixAffinity(chunk_chars=16, imbalance_threshold=4, rng=random.Random(0))
    replicas = ["r0", "r1", "r2"]
    idle, busy = {"r0": 0, "r1": 0, "r2": 0}, {"r0": 0, "r1": 5, "r2": 1}
    policy.record([], "r1", adapter="sql")
    ranks = policy.choose("short", replicas, idle, adapter="sql")
    assert ranks[0] == ["r1"] and len(ranks) == 2 and len(ranks[1]) == 2  # its replica, then two choices
    assert [len(rank) for rank in policy.choose("short", replicas, idle, adapter="chat")] == [2]  # unknown one
    assert [len(rank) for rank in policy.choose("short", replicas, busy, adapter="sql")] == [2]  # r1 too busy
    policy.record([], "r2", adapter="sql")  # the replica it spread to holds it too
    assert policy.choose("short", replicas, busy, adapter="sql")[0] == ["r2"]  # r1 is still too busy
    assert policy.choose("short", replicas, idle, adapter="sql")[0] == ["r1", "r2"]  # Serve takes the shorter
    policy.forget("r2")
    assert policy.holders("sql") == ["r1"]
    assert [len(rank) for rank in policy.choose("short", ["r0", "r2"], idle, adapter="sql")] == [2]  # r1 not a
    # candidate (scaled down): two choices


def test_prefix_affinity_is_per_adapter_and_comes_before_the_adapters_holders():
    policy = PrefixAffinity(chunk_chars=16, rng=random.Random(0))
    assert policy.chunk_hashes(SHARED) != policy.chunk_hashes(SHARED, "sql")
    assert policy.chunk_hashes(SHARED, "sql") != policy.chunk_hashes(SHARED, "chat")
    policy.record(policy.chunk_hashes(SHARED, "sql"), "r0", adapter="sql")
    policy.record(policy.chunk_hashes("other prompt, long enough to hash", "sql"), "r2", adapter="sql")
    idle = {"r0": 0, "r1": 0, "r2": 0}
    ranks = policy.choose(SHARED + "q", ["r0", "r1", "r2"], idle, adapter="sql")
    assert ranks[:2] == [["r0"], ["r0", "r2"]] and len(ranks) == 3
    # the same prompt for the base model or another adapter knows no prefix: two choices only
    assert [len(rank) for rank in policy.choose(SHARED + "q", ["r0", "r1", "r2"], idle)] == [2]
    assert [len(rank) for rank in policy.choose(SHARED + "q", ["r0", "r1", "r2"], idle, adapter="chat")] == [2]


# ---- metrics -----------------------------------------------------------------------------------------------------
def lines(metrics: ReplicaMetrics, prefix: str) -> list[str]:
    return sorted(line for line in merge_families([metrics.snapshot()]).decode().splitlines()
                  if line.startswith(prefix))


def test_lora_requests_info_is_one_series_a_replica_naming_running_and_waiting_adapters():
    metrics = ReplicaMetrics("tiny", "r0", use_ray=False)
    metrics.sync_engine_stats(EngineStats(0, 0, 0.0, 64, 0, 0, 0, 0, 0))
    assert lines(metrics, "pagoda:lora_requests_info{") == []  # LoRA off: no series
    metrics.sync_engine_stats(EngineStats(2, 1, 0.1, 64, 0, 0, 0, 0, 0, running_lora_adapters=("a", "b"),
                                          waiting_lora_adapters=("c",), max_loras=2))
    (line,) = lines(metrics, "pagoda:lora_requests_info{")
    assert ('max_lora="2",model_name="tiny",replica="r0",running_lora_adapters="a,b",waiting_lora_adapters="c"}'
            in line) and float(line.split()[-1]) > 1e9  # when read, as vLLM's
    metrics.sync_engine_stats(EngineStats(0, 0, 0.0, 64, 0, 0, 0, 0, 0, max_loras=2))
    (line,) = lines(metrics, "pagoda:lora_requests_info{")
    assert 'running_lora_adapters="",waiting_lora_adapters=""' in line


def test_finished_requests_are_counted_by_adapter():
    metrics = ReplicaMetrics("tiny", "r0", use_ray=False)
    metrics.observe_finished("length", 0.1, lora_name="sql")
    metrics.observe_finished("length", 0.1, lora_name="sql")
    metrics.observe_finished("stop", 0.1, lora_name="chat")
    metrics.observe_finished("stop", 0.1)
    assert lines(metrics, "pagoda:lora_request_success_total") == [
        'pagoda:lora_request_success_total{finished_reason="length",lora_name="sql",model_name="tiny",'
        'replica="r0"} 2.0',
        'pagoda:lora_request_success_total{finished_reason="stop",lora_name="chat",model_name="tiny",'
        'replica="r0"} 1.0']
    assert 'pagoda:request_success_total{finished_reason="stop",model_name="tiny",replica="r0"} 2.0' in \
        lines(metrics, "pagoda:request_success_total")


def test_an_adapters_id_is_its_name_and_path_and_the_same_wherever_it_is_named():
    ids = {adapter_id(name, path) for name in ("a", "b", "a/b") for path in ("/p", "/q", "/p/q")}
    assert len(ids) == 9 and all(1 <= i < 2 ** 63 for i in ids)
    assert adapter_id("a", "/p") == adapter_id("a", "/p") != adapter_id("a/", "p")


def test_the_lora_cards_are_vllms_shape():
    from cluster.lora_registry import LoRAModule
    from engine.lora import LoRARequest

    card = LoRAModule("base", LoRARequest("sql", 3, "/adapters/sql")).card()
    assert json.loads(json.dumps(card)) == {"root": "/adapters/sql", "parent": "base"}


def test_a_request_waiting_for_a_slot_is_a_waiting_request_and_names_its_adapter(tiny_model_dir, adapter_dir,
                                                                                  tmp_path):
    """What the metrics and the autoscaling policy read: with one GPU slot, the second adapter's request waits, and
    the engine's stats say which adapters run and which wait."""
    from cluster.autoscaling import autoscaling_stats
    from engine.lora import LoRARequest
    from pagoda import LLM, SamplingParams
    from tests.engine.test_lora import step_until
    from tests.lora_adapters import make_adapter

    other = make_adapter(tiny_model_dir, str(tmp_path / "other"), rank=4, seed=1)
    llm = LLM(model=tiny_model_dir, device="cpu", enable_lora=True, max_loras=1, num_kv_blocks=64)
    try:
        engine = llm.engine
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.add_request("a", "one prompt", params, lora_request=LoRARequest("first", 1, adapter_dir))
        engine.add_request("b", "another prompt", params, lora_request=LoRARequest("second", 2, other))
        engine.add_request("c", "a base prompt", params)
        first = engine.scheduler.requests["a"]
        step_until(engine, lambda: first in engine.scheduler.running)  # once its adapter is read (in the background)
        stats = engine.get_stats()
        assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_loras) == (("first",),
                                                                                               ("second",), 1)
        assert stats.num_running == 2 and autoscaling_stats(stats)["num_waiting"] == 1
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.get_stats().running_lora_adapters == engine.get_stats().waiting_lora_adapters == ()
    finally:
        llm.shutdown()
