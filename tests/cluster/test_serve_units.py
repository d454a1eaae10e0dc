"""The serving layer's pure parts, without a Ray cluster: the routing policy, the error mapping, request
validation, the delta stream (stop-string holdback), metrics merging, app args and the CLI's flags."""

import random

import pytest
from pydantic import ValidationError

from cluster import errors
from cluster.app import ModelArgs, parse_args
from cluster.metrics import MetricFamily, merge_families
from cluster.protocol import ChatCompletionRequest, ChoiceDelta, CompletionRequest, completion_logprobs
from cluster.router import PrefixAffinity
from cluster.server import _ChoiceStream, replica_options
from engine.request_output import CompletionOutput

SHARED = "You are a helpful assistant. Always answer in one short sentence, politely. " * 3


# ---- router ----------------------------------------------------------------------------------------------------
def test_chunk_hashes_cover_full_chunks_and_depend_on_everything_before():
    policy = PrefixAffinity(chunk_chars=8)
    a, b = policy.chunk_hashes("abcdefgh12345678xyz"), policy.chunk_hashes("Xbcdefgh12345678")
    assert len(a) == 2 and len(b) == 2  # the partial tail "xyz" is not hashed
    assert a[0] != b[0] and a[1] != b[1]  # chunk 1 is equal, but its prefix is not
    assert policy.chunk_hashes("short") == []


def test_shared_prefix_goes_to_the_replica_that_holds_it():
    policy = PrefixAffinity(chunk_chars=16, rng=random.Random(0))
    replicas = ["r0", "r1", "r2"]
    policy.record(policy.chunk_hashes(SHARED + "first question"), "r2")
    ranks = policy.choose(SHARED + "another question entirely", replicas, {"r0": 0, "r1": 0, "r2": 0})
    assert ranks[0] == ["r2"]  # affinity first, then the power-of-two fallback
    assert len(ranks[1]) == 2


def test_longest_prefix_wins_and_dead_replicas_are_skipped():
    policy = PrefixAffinity(chunk_chars=16)
    policy.record(policy.chunk_hashes(SHARED + "and a long follow-up paragraph here"), "r1")
    policy.record(policy.chunk_hashes(SHARED), "r0")  # the shared chunks now point at r0, the rest still at r1
    assert policy.lookup(policy.chunk_hashes(SHARED + "and a long follow-up paragraph here!"), {"r0", "r1"})[0] == "r1"
    assert policy.lookup(policy.chunk_hashes(SHARED + "and a long follow-up paragraph here!"), {"r0"})[0] == "r0"
    policy.forget("r0")
    assert policy.lookup(policy.chunk_hashes(SHARED), {"r0", "r1"}) == (None, 0)


def test_unbalanced_load_falls_back_to_two_choices():
    policy = PrefixAffinity(chunk_chars=16, imbalance_threshold=4, rng=random.Random(0))
    policy.record(policy.chunk_hashes(SHARED), "r0")
    assert policy.choose(SHARED + "q", ["r0", "r1"], {"r0": 4, "r1": 0})[0] == ["r0"]  # within the threshold
    ranks = policy.choose(SHARED + "q", ["r0", "r1"], {"r0": 5, "r1": 0})
    assert ranks == [["r0", "r1"]]  # Serve picks the shorter queue of the two


def test_no_prefix_spreads_by_two_choices():
    policy = PrefixAffinity(rng=random.Random(1))
    seen = {tuple(sorted(policy.choose(f"{i} unrelated", ["a", "b", "c", "d"], {})[0])) for i in range(50)}
    assert len(seen) > 3


def test_table_is_bounded():
    policy = PrefixAffinity(chunk_chars=4, max_entries=10)
    for i in range(20):
        policy.record(policy.chunk_hashes(f"{i:04d}" * 3), f"r{i}")
    assert len(policy._owner) == 10


# ---- errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc, status, param", [
    (ValueError("temperature must be non-negative, got -1"), 400, "temperature"),
    (ValueError("prompt is 600 tokens, but this model's maximum context length is 512"), 400, "prompt"),
    (ValueError("prompt_token_ids must be integers in [0, 1000)"), 400, "prompt"),
    (ValueError("something else entirely"), 400, None),
    (errors.ModelNotFoundError("x", ["tiny"]), 404, "model"),
    (errors.AuthenticationError("no"), 401, None),
    (errors.PayloadTooLargeError("big"), 413, None),
    (TimeoutError(), 503, None),
    (RuntimeError("boom"), 500, None),
])
def test_one_function_maps_exceptions(exc, status, param):
    error = errors.to_http_error(exc)
    assert (error.status_code, error.param) == (status, param)
    body = errors.error_body(error, "req-1")
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["request_id"] == "req-1"


def test_serve_and_engine_failures_are_503():
    from ray.serve.exceptions import BackPressureError

    from engine.async_engine import EngineDeadError

    assert errors.to_http_error(BackPressureError(10, 10)).status_code == 503
    assert errors.to_http_error(EngineDeadError("worker died")).status_code == 503


def test_pydantic_errors_name_the_field():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "n": "many"})
    error = errors.to_http_error(info.value)
    assert (error.status_code, error.param) == (400, "n")
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(b"{not json")
    assert errors.to_http_error(info.value).status_code == 400


# ---- protocol --------------------------------------------------------------------------------------------------
def test_completion_prompts_and_params():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    params = CompletionRequest(prompt="a", temperature=0, max_tokens=5, stop="x", logprobs=2, seed=3,
                               logit_bias={"7": 5.0}).to_sampling_params()
    assert (params.temperature, params.max_tokens, params.stop, params.logprobs, params.seed) == (0, 5, ["x"], 2, 3)
    assert params.logit_bias == {7: 5.0}
    with pytest.raises(errors.InvalidRequestError) as info:
        CompletionRequest(prompt="a", top_p=2.0).to_sampling_params()
    assert info.value.param == "top_p"
    with pytest.raises(errors.InvalidRequestError) as info:
        CompletionRequest(prompt="a", logit_bias={"x": 1.0}).to_sampling_params()
    assert info.value.param == "logit_bias"


def test_chat_params_and_messages():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                      {"type": "text", "text": "there"}]}],
                                max_completion_tokens=7, logprobs=True, top_logprobs=3)
    params = req.to_sampling_params()
    assert (params.max_tokens, params.logprobs) == (7, 3)
    assert req.message_dicts() == [{"role": "user", "content": "hi there"}]
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling_params().max_tokens is None
    with pytest.raises(errors.InvalidRequestError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2).to_sampling_params()
    assert info.value.param == "top_logprobs"


def test_legacy_logprobs_shape():
    from cluster.protocol import TokenLogprob

    out = completion_logprobs([TokenLogprob("ab", -0.5, [("ab", -0.5), ("c", -1.0)]), TokenLogprob("d", -2.0, [])], 3)
    assert out == {"tokens": ["ab", "d"], "token_logprobs": [-0.5, -2.0],
                   "top_logprobs": [{"ab": -0.5, "c": -1.0}, {"d": -2.0}], "text_offset": [3, 5]}


# ---- deltas ----------------------------------------------------------------------------------------------------
def test_choice_stream_holds_back_what_a_stop_string_may_cut():
    from engine.detokenizer import IncrementalDetokenizer

    # The engine's stable text with stop="END": the last 2 characters wait while the request runs.
    det = IncrementalDetokenizer(None, [], stop=["END"], use_stream=False)
    shown = []
    for text, finished in (("Hello E", False), ("Hello EN", False), ("Hello ", True)):
        det.text = text
        shown.append(det.stable_text(finished))
    assert shown == ["Hello", "Hello ", "Hello "]
    stream = _ChoiceStream(0, num_logprobs=None)
    outs = [CompletionOutput(0, shown[0], [1, 2], None), CompletionOutput(0, shown[1], [1, 2, 3], None),
            CompletionOutput(0, shown[2], [1, 2, 3, 4], None, "stop", "END")]
    deltas = [stream.advance(o, str) for o in outs]
    assert deltas[0].text == "Hello" and deltas[0].num_tokens == 2
    assert deltas[1].text == " " and deltas[1].num_tokens == 1
    assert deltas[2].text == "" and deltas[2].finish_reason == "stop" and deltas[2].num_tokens == 1
    assert "".join(d.text for d in deltas) == "Hello "
    assert stream.advance(outs[-1], str) is None


def test_choice_deltas_merge():
    merged = ChoiceDelta(0)
    merged.merge(ChoiceDelta(0, "a", 1, None))
    merged.merge(ChoiceDelta(0, "b", 2, None, "length"))
    assert (merged.text, merged.num_tokens, merged.finish_reason) == ("ab", 3, "length")


# ---- metrics ---------------------------------------------------------------------------------------------------
def test_metrics_merge_across_replicas():
    from cluster.metrics import ReplicaMetrics
    from engine.llm_engine import EngineStats

    snapshots = []
    for replica, hits in (("r0", 32), ("r1", 0)):
        metrics = ReplicaMetrics("tiny", replica, use_ray=False)
        metrics.sync_engine_stats(EngineStats(1, 0, 0.25, 64, 48, hits, 0, 48, 10))
        metrics.sync_engine_stats(EngineStats(0, 0, 0.0, 64, 64, hits + 16, 0, 64, 12))
        metrics.observe_first_token(0.01)
        metrics.observe_finished("length", 0.2)
        snapshots.append(metrics.snapshot())
    text = merge_families(snapshots).decode()
    assert 'pagoda:prefix_cache_hits_total{model_name="tiny",replica="r0"} 48.0' in text
    assert 'pagoda:prefix_cache_hits_total{model_name="tiny",replica="r1"} 16.0' in text
    assert 'pagoda:kv_cache_usage_perc{model_name="tiny",replica="r0"} 0.0' in text
    assert 'pagoda:request_success_total{finished_reason="length",model_name="tiny",replica="r1"} 1.0' in text
    assert text.count("# TYPE pagoda:time_to_first_token_seconds histogram") == 1
    assert merge_families([[MetricFamily("x", "gauge", "d", [("x", {"a": "b"}, 1.0)])]]).decode().count("x{") == 1


# ---- app args and placement ------------------------------------------------------------------------------------
def test_app_args_are_validated_with_clear_errors():
    assert parse_args({}).models[0].served_model_name == "smollm2-135m-instruct"
    assert ModelArgs(model="tiny").served_model_name == "pagoda-tiny"
    assert ModelArgs(model="Qwen/Qwen2.5-7B-Instruct").served_model_name == "Qwen/Qwen2.5-7B-Instruct"
    assert ModelArgs(model="/models/llama-3-8b/").served_model_name == "llama-3-8b"
    for bad, where in [({"models": [{"num_replica": 2}]}, "models.0.num_replica"),
                       ({"models": [{"num_replicas": 1, "autoscaling_config": {}}]}, "not both"),
                       ({"models": [{"served_model_name": "a"}, {"served_model_name": "a"}]}, "unique"),
                       ({"models": [{"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}]}, "min_replicas"),
                       ({"models": []}, "models")]:
        with pytest.raises(ValueError, match=where):
            parse_args(bad)


def test_deploy_serve_yaml_args_are_valid():
    import pathlib

    import yaml

    for path in pathlib.Path("deploy").glob("serve*.yaml"):
        for app in yaml.safe_load(path.read_text())["applications"]:
            parse_args(app["args"])


def test_replica_placement_is_derived_from_the_parallel_config():
    assert replica_options(1, "cpu", 0.5) == {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0}}
    # The engine actor takes the GPU that the replica reserves in its placement group.
    one_gpu = replica_options(1, "cuda", 1)
    assert one_gpu["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    assert one_gpu["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}]
    # With the engine in the replica's process, the replica holds the GPU itself.
    assert replica_options(1, "cuda", 1, engine_process=False) == {"ray_actor_options": {"num_cpus": 1,
                                                                                         "num_gpus": 1}}
    tp4 = replica_options(4, "cuda", 1)
    assert tp4["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
    assert tp4["placement_group_strategy"] == "STRICT_PACK"
    assert tp4["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}


def test_cli_flags_become_app_args():
    from deploy.cli import GPU_INGRESS_REPLICAS, build_parser, serve_app_args

    args = build_parser().parse_args(["serve", "--served-model-name", "m", "--min-replicas", "1",
                                      "--max-replicas", "3", "--target-ongoing-requests", "8", "--api-key", "k"])
    app_args = serve_app_args(args)
    assert app_args["models"][0]["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3,
                                                            "target_ongoing_requests": 8.0}
    assert app_args["api_key"] == "k"
    assert app_args["ingress_replicas"] == 1  # no GPU here
    parse_args(app_args)
    on_gpu = serve_app_args(build_parser().parse_args(["serve", "--device", "cuda"]))
    assert on_gpu["ingress_replicas"] == GPU_INGRESS_REPLICAS
    chosen = serve_app_args(build_parser().parse_args(["serve", "--device", "cuda", "--ingress-replicas", "2"]))
    assert chosen["ingress_replicas"] == 2
    args = build_parser().parse_args(["serve", "--num-replicas", "2", "--max-replicas", "3"])
    with pytest.raises(ValueError, match="not both"):
        serve_app_args(args)


def test_ingress_modes_are_environments_for_the_cluster(monkeypatch):
    import socket

    import deploy.cli as cli

    for name in [*cli.HAPROXY_PORT_ENV, cli.DRAINING_PERIOD_ENV[0]]:  # the session cluster's may be set
        monkeypatch.delenv(name, raising=False)
    assert cli.ingress_env("proxy") == {name: "0" for name in cli.DIRECT_INGRESS_ENV}
    with pytest.raises(ValueError, match="direct' or 'proxy"):
        cli.ingress_env("fast")
    with socket.socket() as taken:  # a port in use (another cluster's HAProxy) is swapped for a free one
        taken.bind(("0.0.0.0", 0))
        port = taken.getsockname()[1]
        monkeypatch.setitem(cli.HAPROXY_PORT_ENV, "RAY_SERVE_HAPROXY_STATS_PORT", port)
        env = cli.ingress_env("direct")
    assert {k: env[k] for k in cli.DIRECT_INGRESS_ENV} == cli.DIRECT_INGRESS_ENV
    assert int(env["RAY_SERVE_HAPROXY_STATS_PORT"]) not in (port, 0)
    assert env["RAY_SERVE_HAPROXY_METRICS_PORT"].isdigit()
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"  # a stop takes seconds, not 35
    monkeypatch.setenv("RAY_SERVE_HAPROXY_METRICS_PORT", "19101")  # the caller's choice is kept
    assert cli.ingress_env("direct")["RAY_SERVE_HAPROXY_METRICS_PORT"] == "19101"
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)  # no HAProxy: the Python proxy
    assert cli.ingress_env("direct") == cli.ingress_env("proxy")
