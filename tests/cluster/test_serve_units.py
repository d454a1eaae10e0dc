"""The serving layer's pure parts, without a Ray cluster: the routing policy, the error mapping, request
validation, metrics merging, app args, placement and the CLI's flags."""

import json
import random

import pytest
from pydantic import ValidationError

from cluster import errors
from cluster.app import ModelArgs, parse_args
from cluster.errors import ErrorInfo
from cluster.metrics import MetricFamily, merge_families
from cluster.placement import ReplicaPlacement
from cluster.protocol import ChatCompletionRequest, CompletionRequest
from cluster.responses import completion_logprobs
from cluster.router import CHARS_PER_TOKEN, PrefixAffinity, cached_tokens, routing_stats
from engine.errors import EngineDeadError, ParamError
from engine.request_output import TokenLogprob

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


def test_a_replica_whose_queue_length_is_unknown_counts_as_idle():
    """Serve forgets a queue length after 10 s: a replica no request went to lately is unknown. Counted as idle, the
    busy owner of a hot prefix yields to two choices (Serve probes both), instead of keeping every request."""
    policy = PrefixAffinity(chunk_chars=16, imbalance_threshold=4, rng=random.Random(0))
    policy.record(policy.chunk_hashes(SHARED), "r0")
    assert policy.choose(SHARED + "q", ["r0", "r1"], {"r0": 4, "r1": None})[0] == ["r0"]  # within the threshold
    assert policy.choose(SHARED + "q", ["r0", "r1"], {"r0": 5, "r1": None}) == [["r0", "r1"]]
    assert policy.choose(SHARED + "q", ["r0", "r1"], {"r0": None, "r1": 0})[0] == ["r0"]  # unknown: not busy


def test_no_prefix_spreads_by_two_choices():
    policy = PrefixAffinity(rng=random.Random(1))
    seen = {tuple(sorted(policy.choose(f"{i} unrelated", ["a", "b", "c", "d"], {})[0])) for i in range(50)}
    assert len(seen) > 3


def test_table_is_bounded():
    policy = PrefixAffinity(chunk_chars=4, max_entries=10)
    for i in range(20):
        policy.record(policy.chunk_hashes(f"{i:04d}" * 3), f"r{i}")
    assert len(policy._owner) == 10


def test_each_replica_keeps_as_many_chunks_as_its_caches_hold():
    """A replica whose caches (device pool + host tier) hold 2 chunks' worth of tokens keeps its 2 most recently
    routed prefixes' chunks; one with a host tier 10x larger keeps them all."""
    policy = PrefixAffinity(chunk_chars=16)
    tokens_per_chunk = 16 // CHARS_PER_TOKEN
    policy.set_capacity("small", 2 * tokens_per_chunk)
    policy.set_capacity("large", 20 * tokens_per_chunk)
    prompts = [f"{i:03d} conversation.." for i in range(6)]  # 19 chars: one chunk each, all different

    def held(replica):
        return [p for p in prompts if policy.lookup(policy.chunk_hashes(replica + p), {replica})[0] == replica]

    for prompt in prompts:
        for replica in ("small", "large"):
            policy.record(policy.chunk_hashes(replica + prompt), replica)
    assert (held("small"), held("large")) == (prompts[-2:], prompts)
    policy.set_capacity("large", tokens_per_chunk)  # a smaller report trims at once
    assert held("large") == prompts[-1:]
    policy.forget("small")
    assert policy.capacity("small") is None and held("small") == []


def test_a_prefix_routed_elsewhere_leaves_its_old_replica_s_count():
    policy = PrefixAffinity(chunk_chars=16)
    policy.set_capacity("r0", 2 * 16 // CHARS_PER_TOKEN)
    policy.record(policy.chunk_hashes(SHARED), "r0")  # more chunks than r0 holds: its last two stay
    assert len(policy._held["r0"]) == 2
    policy.record(policy.chunk_hashes(SHARED), "r1")  # r1 now owns them all; r0 holds none in the table
    assert not policy._held["r0"] and policy.lookup(policy.chunk_hashes(SHARED), {"r0", "r1"})[0] == "r1"


def test_routing_stats_report_both_tiers_in_tokens():
    from engine.llm_engine import EngineStats

    stats = EngineStats(0, 0, 0.0, 64, 0, 0, 0, 0, 0, num_host_kv_blocks=512)
    reported = routing_stats(stats, block_size=16)
    assert reported == {"kv_cache_tokens": 1024, "host_kv_cache_tokens": 8192}
    assert cached_tokens(reported) == 9216 and cached_tokens({}) is None


# ---- errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc, status, param", [
    (ParamError("temperature", "must be non-negative, got -1"), 400, "temperature"),
    (ParamError("prompt", "is 600 tokens, but this model's maximum context length is 512"), 400, "prompt"),
    (ParamError(None, "something else entirely"), 400, None),
    (errors.ModelNotFoundError("x", ["tiny"]), 404, "model"),
    (errors.AuthenticationError("no"), 401, None),
    (errors.PayloadTooLargeError("big"), 413, None),
    (TimeoutError(), 503, None),
    (RuntimeError("boom"), 500, None),
    (ValueError("an engine bug, not the client's input"), 500, None),
])
def test_one_function_maps_exceptions(exc, status, param):
    error = errors.to_http_error(exc)
    assert (error.status_code, error.param) == (status, param)
    body = errors.error_body(error, "req-1")
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["request_id"] == "req-1"


def test_param_errors_keep_their_field_across_processes():
    import pickle

    error = pickle.loads(pickle.dumps(ParamError("top_k", "must be an integer, got 'x'")))
    assert error.param == "top_k" and str(error) == "top_k must be an integer, got 'x'"


def test_back_pressure_is_429_and_dead_engines_are_503_with_plain_messages():
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import BackPressureError

    assert errors.to_http_error(BackPressureError(num_queued_requests=10, max_queued_requests=10)).status_code == 429
    dead = errors.to_http_error(EngineDeadError("worker failed: ActorDiedError pid=1234 ip=10.0.0.7"))
    assert dead.status_code == 503 and "1234" not in dead.message and "10.0.0.7" not in dead.message
    gone = errors.to_http_error(ActorDiedError())
    assert gone.status_code == 503 and "actor" not in gone.message.lower()


def test_pydantic_errors_name_the_field():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "n": "many"})
    error = errors.to_http_error(info.value)
    assert (error.status_code, error.param) == (400, "n")
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(b"{not json")
    assert errors.to_http_error(info.value).status_code == 400


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "echo": 0}, "echo"),  # no coercion: 0 is not a boolean
    ({"prompt": [1, True]}, "prompt"),  # nor true a token id
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "best_of": 3, "use_beam_search": True, "length_penalty": 0.5}, "length_penalty"),
    ({"prompt": "x", "length_penalty": 1.0}, "length_penalty"),
    ({"prompt": "x", "priority": 1}, "priority"),
])
def test_requests_are_validated_strictly_and_completely(body, param):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body)
    assert errors.to_http_error(info.value).param == param


def validation_error(model, body) -> errors.PagodaHTTPError:
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(body if isinstance(body, str) else json.dumps(body))
    return errors.to_http_error(info.value)


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "x", "stop": ["s"] * 1000}, "stop", "stop: List should have at most 64 items"),
    ({"prompt": [-1]}, "prompt", "prompt[0]: token ids must be integers >= 0"),
    ({"prompt": [[1, 2], [3, -4]]}, "prompt", "prompt[1][1]: token ids must be integers >= 0"),
    ({"prompt": ["a", "b", 3]}, "prompt", "prompt[2]: Input should be a valid string"),
    ({"prompt": 5}, "prompt", "prompt: Input should be one of: str, list[int], list[str], list[list[int]]"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature", "temperature: Input should be a finite number"),
    ({"prompt": "x", "top_p": float("inf")}, "top_p", "top_p: Input should be a finite number"),
    ({"prompt": "x", "frequency_penalty": float("-inf")}, "frequency_penalty", "a finite number"),
    ({"prompt": "x", "stop_token_ids": [1, -2]}, "stop_token_ids", "stop_token_ids[1]: token ids must be"),
    ({"prompt": "x", "early_stopping": True}, "early_stopping", "unknown field"),
])
def test_a_validation_error_names_the_check_that_failed(body, param, says):
    """A union's error is its member's that the input's JSON type matched (a list of 1,000 strings is too long, not
    "not a string"); NaN and infinities are not finite numbers (not "less than or equal to 10000")."""
    error = validation_error(CompletionRequest, body)
    assert (error.status_code, error.param) == (400, param)
    assert says in error.message, error.message


def test_a_named_tool_choice_without_a_name_is_invalid_by_the_document_too():
    """CI's fuzz run found {"function": {"name": ""}} valid by the document and refused by the server: the document
    now says what the server checks (a name of at least one character)."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    error = validation_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                     "tool_choice": {"type": "function", "function": {"name": ""}}})
    assert (error.status_code, error.param) == (400, "tool_choice"), (error.param, error.message)
    assert "at least 1 character" in error.message, error.message
    schema = ChatCompletionRequest.model_json_schema()["$defs"]["NamedFunction"]["properties"]["name"]
    assert schema["minLength"] == 1


def test_what_pagoda_does_not_do_is_refused_saying_so():
    """vLLM's beam search and its Lark grammars: a 400 that says Pagoda does not do them, not one about a field."""
    error = edge_error(CompletionRequest, {"prompt": "x", "use_beam_search": True})
    assert error.param == "use_beam_search" and "beam search is not supported" in error.message
    CompletionRequest(prompt="x", use_beam_search=False).to_sampling_params()  # false, as clients send it: fine
    lark = 'start: "yes" | "no"'
    for body, param in (({"guided_grammar": lark}, "guided_grammar"),
                        ({"structured_outputs": {"grammar": lark}}, "structured_outputs.grammar")):
        error = edge_error(CompletionRequest, {"prompt": "x", **body})
        assert error.param == param and "Lark grammar" in error.message, error.message


def test_vllms_extensions_become_sampling_params():
    params = CompletionRequest(prompt="x", allowed_token_ids=[5, 3], truncate_prompt_tokens=-1).to_sampling_params()
    assert (params.allowed_token_ids, params.truncate_prompt_tokens) == ([3, 5], -1)
    for body, param in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"allowed_token_ids": []}, "allowed_token_ids")):
        error = validation_error(CompletionRequest, {"prompt": "x", **body})
        assert error.param == param, error.message
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Yes"}],
                                 continue_final_message=True, echo=True)
    assert chat.echo_text == "Yes"
    after_user = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], echo=True)
    assert after_user.echo_text == ""  # the answer is the assistant's: nothing of the user's is echoed
    no_prompt = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], echo=True,
                                      add_generation_prompt=False)
    assert no_prompt.echo_text == "hi"  # as vLLM: without a generation prompt the answer continues the last message


def test_a_named_literal_beats_the_object_member_of_its_union():
    error = validation_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                     "tools": [], "tool_choice": "sometimes"})
    assert error.param == "tool_choice"
    assert error.message == "tool_choice: Input should be 'none', 'auto' or 'required'"


def test_json_nested_too_deep_is_a_400_naming_its_field():
    body = '{"prompt": "x",\n "logit_bias": ' + "[" * 300 + "]" * 300 + "}"
    error = validation_error(CompletionRequest, body)
    assert (error.status_code, error.param) == (400, "logit_bias")
    assert error.message == "logit_bias nests arrays and objects more than 200 levels deep"
    error = validation_error(CompletionRequest, "[" * 300 + "]" * 300)
    assert error.param is None
    assert error.message == "the request body nests arrays and objects more than 200 levels deep"


def test_error_messages_quote_at_most_a_short_piece_of_the_input():
    huge = "m" * 1_000_000
    body = errors.error_body(errors.ModelNotFoundError(huge, ["tiny"]), "req-1")
    assert len(body["error"]["message"]) < 300 and "(1000002 characters)" in body["error"]["message"]
    error = validation_error(CompletionRequest, {"prompt": "x", huge: 1})  # an unknown field's name, its param
    body = errors.error_body(error, "req-1")
    assert len(body["error"]["message"]) < 400 and len(body["error"]["param"]) < 150
    for value in ({"prompt": "x", "logit_bias": {huge: 1.0}}, {"prompt": [[huge]]}, {"prompt": "x", "n": huge}):
        try:
            CompletionRequest.model_validate(value).to_sampling_params()
            raise AssertionError(f"accepted: {str(value)[:50]}")
        except Exception as e:  # noqa: BLE001 - mapped as the ingress maps it
            assert len(json.dumps(errors.error_body(errors.to_http_error(e), "r"))) < 2000
    assert len(errors.error_body(errors.InvalidRequestError("x" * 10**6), None)["error"]["message"]) < 1100


def test_error_codes_are_strings_or_null_as_openais():
    """OpenAI's (and the openai client's) `code` is a string or null: never the status as an integer."""
    cases = [errors.InvalidRequestError("bad", "n"), errors.ModelNotFoundError("x", ["tiny"]),
             errors.AuthenticationError("no key"), errors.TooManyRequestsError("full"),
             errors.ServiceUnavailableError("down"), errors.InternalServerError("bug"),
             errors.http_status_error(405, "GET /v1/completions: Method Not Allowed"),
             ErrorInfo(400, "max_tokens is too large", "max_tokens").to_exception()]
    codes = [errors.error_body(e, None)["error"]["code"] for e in cases]
    assert codes == [None, "model_not_found", "invalid_api_key", "rate_limit_exceeded", None, None, None, None]


def test_an_engine_error_is_renamed_to_the_field_the_client_sent():
    error = ErrorInfo(400, "max_tokens is too large: this model's maximum context length is 1024 tokens",
                      "max_tokens").to_exception()
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=5000)
    error = error.renamed(req.param_name(error.param))
    assert error.param == "max_completion_tokens"
    assert error.message.startswith("max_completion_tokens is too large: ")


def test_chat_roles_are_openais_and_no_op_fields_are_accepted():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "hi"}]})
    assert errors.to_http_error(info.value).param == "messages"
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "developer", "content": "be brief"}],
                                                "user": "u-1", "metadata": {"k": "v"}})
    assert req.user == "u-1"


# ---- protocol --------------------------------------------------------------------------------------------------
def edge_error(model, body: dict) -> errors.PagodaHTTPError:
    """The error the edge answers for `body`: from validation or from building its SamplingParams."""
    try:
        model.model_validate(body).to_sampling_params()
    except Exception as e:  # noqa: BLE001 - mapped as the ingress maps it
        return errors.to_http_error(e)
    raise AssertionError(f"{body} was accepted")


def test_completion_prompts_and_params():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    params = CompletionRequest(prompt="a", temperature=0, max_tokens=5, stop="x", logprobs=2, seed=3,
                               logit_bias={"7": 5.0}).to_sampling_params()
    assert (params.temperature, params.max_tokens, params.stop, params.logprobs, params.seed) == (0, 5, ["x"], 2, 3)
    assert params.logit_bias == {7: 5.0}
    assert CompletionRequest(prompt="a").to_sampling_params().temperature == 1.0  # unset: SamplingParams' default
    for body, param in (({"top_p": 2.0}, "top_p"), ({"logit_bias": {"x": 1.0}}, "logit_bias"),
                        ({"top_k": 2**63}, "top_k"), ({"seed": 2**70}, "seed"), ({"n": 10**6}, "n"),
                        ({"stream_options": {"include_usage": True}}, "stream_options")):
        assert edge_error(CompletionRequest, {"prompt": "a", **body}).param == param


def test_chat_params_and_messages():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                      {"type": "text", "text": "there"}]}],
                                max_completion_tokens=7, logprobs=True, top_logprobs=3)
    params = req.to_sampling_params()
    assert (params.max_tokens, params.logprobs) == (7, 3)
    assert req.message_dicts() == [{"role": "user", "content": "hi there"}]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert chat.to_sampling_params().max_tokens is None  # the rest of the context, as OpenAI
    assert chat.to_sampling_params(default_max_tokens=64).max_tokens == 64  # unless the server sets a default
    messages = [{"role": "user", "content": "x"}]
    assert edge_error(ChatCompletionRequest, {"messages": messages, "top_logprobs": 2}).param == "top_logprobs"
    assert edge_error(ChatCompletionRequest, {"messages": messages, "max_completion_tokens": 0}).param == \
        "max_completion_tokens"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),  # prompt was silently ignored
    ({}, "prompt"),
    ({"model": "tiny"}, "prompt"),
    ({"prompt": "x", "tools": []}, "tools"),
    ({"prompt": "x", "continue_final_message": False}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
])
def test_tokenize_takes_one_input_and_only_its_own_fields(body, param):
    from cluster.protocol import TokenizeRequest

    with pytest.raises(errors.InvalidRequestError) as info:
        TokenizeRequest.model_validate(body).to_input()
    assert info.value.param == param


def test_tokenize_inputs_as_vllm_reads_them():
    from cluster.protocol import TokenizeRequest

    prompt = TokenizeRequest.model_validate({"prompt": "x", "return_token_strs": True}).to_input()
    assert (prompt.prompt, prompt.add_special_tokens, prompt.return_token_strs) == ("x", True, True)
    chat = TokenizeRequest.model_validate({"messages": [{"role": "assistant", "content": "Sure"}],
                                           "continue_final_message": True}).to_input()
    assert (chat.add_special_tokens, chat.add_generation_prompt, chat.continue_final_message) == (False, False, True)


def test_legacy_logprobs_shape():
    out = completion_logprobs([TokenLogprob(5, "ab", -0.5, [(5, "ab", -0.5), (6, "c", -1.0)]),
                               TokenLogprob(7, "d", -2.0, [])], 3)
    assert out == {"tokens": ["ab", "d"], "token_logprobs": [-0.5, -2.0],
                   "top_logprobs": [{"ab": -0.5, "c": -1.0}, {"d": -2.0}], "text_offset": [3, 5]}


# ---- a request's replica streams (cluster/request_run.py) ------------------------------------------------------
class FakeStream:
    """Stands in for a Serve handle's stream (a mock: a real replica loss cannot be timed to land after several
    prompts of one batch were accepted and before any of them produced a token). Yields its batches, or raises
    `error` before any."""

    def __init__(self, prompt: int, error: BaseException | None = None):
        from engine.request_output import RequestDelta, SequenceDelta

        self.error, self.cancelled = error, False
        self.batches = [[RequestDelta(f"r-{prompt}", [SequenceDelta(0, f"p{prompt}", [prompt], "length")], True)]]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.error is not None:
            raise self.error
        if not self.batches:
            raise StopAsyncIteration
        return self.batches.pop(0)

    def cancel(self):
        self.cancelled = True


def test_a_replica_lost_under_a_batch_restarts_each_unstarted_prompt_once():
    """A completion batch of 4 whose replica is lost before any output: every prompt is sent again (it retried
    the first and failed the others); a prompt whose retry is lost too fails the request."""
    import asyncio

    from ray.exceptions import ActorDiedError

    from cluster.protocol import Accepted
    from cluster.request_run import RequestRun

    def run_with(restart_error=None):
        restarts = []

        async def restart(i):
            restarts.append(i)
            return FakeStream(i, restart_error if i == 2 else None)

        gens = [FakeStream(i, ActorDiedError()) for i in range(4)]
        return RequestRun(gens, [Accepted("lost", 3)] * 4, 1, "cmpl-x", restart), restarts

    run, restarts = run_with()
    out = asyncio.run(run.outputs())
    assert sorted(restarts) == [0, 1, 2, 3]
    assert [out.choices[p].text for p in range(4)] == ["p0", "p1", "p2", "p3"]
    run, restarts = run_with(restart_error=ActorDiedError())  # prompt 2's retry is lost as well: no second retry
    with pytest.raises(ActorDiedError):
        asyncio.run(run.outputs())
    assert restarts.count(2) == 1


def test_admission_is_exact_and_a_forgotten_run_gives_its_slots_back():
    import gc

    from cluster.protocol import Accepted
    from cluster.request_run import Admission, RequestRun

    admission = Admission(3)
    release = admission.admit(2)
    with pytest.raises(errors.TooManyRequestsError):
        admission.admit(2)
    release()
    release()  # a second release gives nothing back twice
    assert admission.num_in_flight == 0
    run = RequestRun([FakeStream(0)], [Accepted("r", 1)], 1, "x", None, admission.admit(3))
    run.cancel()
    assert admission.num_in_flight == 0
    run = RequestRun([FakeStream(0)], [Accepted("r", 1)], 1, "x", None, admission.admit(3))
    del run  # a path that never cancelled its run: its slots come back when it is collected
    gc.collect()
    assert admission.num_in_flight == 0 and Admission(None).admit(10**6) is not None


# ---- the OpenAPI document says what the edge accepts -------------------------------------------------------------
TINY_FACTS = {"vocab_size": 512, "max_model_len": 1024, "max_num_seqs": 32, "max_prompt_chars": 20000,
              "tool_call_parser": "hermes"}
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def schema_accepts(component: str, body: dict, model_names=("tiny",), facts=None) -> bool:
    import jsonschema
    from fastapi.openapi.utils import get_openapi

    from cluster.ingress import app
    from cluster.openapi import openapi_schema
    from cluster.schema_rules import ModelFacts

    facts = facts or {name: ModelFacts.from_info(TINY_FACTS, None) for name in model_names}
    document = openapi_schema(get_openapi(title="t", version="1", routes=app.routes), list(model_names), facts)
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{component}",
                                                 "components": document["components"]})
    return validator.is_valid(body)


def edge_accepts(component: str, body: dict) -> bool:
    """What the ingress decides before a replica sees the request (the model's bounds aside)."""
    from cluster import protocol

    try:
        req = getattr(protocol, component).model_validate_json(json.dumps(body))
        req.to_input() if component == "TokenizeRequest" else req.to_sampling_params()
    except Exception:  # noqa: BLE001 - any refusal
        return False
    return True


@pytest.mark.parametrize("component, body", [
    ("CompletionRequest", {"prompt": "x", "best_of": 2, "n": 2}),  # Pagoda ranks no samples
    ("CompletionRequest", {"prompt": "x", "best_of": 1, "n": 2}),
    ("CompletionRequest", {"prompt": "x", "suffix": "tail"}),
    ("CompletionRequest", {"prompt": "x", "stream_options": {"include_usage": True}}),
    ("CompletionRequest", {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}),
    ("CompletionRequest", {"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"}),
    ("CompletionRequest", {"prompt": "x", "response_format": {"type": "json_schema"}}),
    ("CompletionRequest", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ("CompletionRequest", {"prompt": "x", "structured_outputs": {"regex": "a", "any_whitespace": True}}),
    ("CompletionRequest", {"prompt": "x", "structured_outputs": {"json_object": False}}),
    ("CompletionRequest", {"prompt": "x", "logit_bias": {"+7": 1.0}}),
    ("CompletionRequest", {"prompt": "x", "logit_bias": {"07": 1.0}}),
    ("CompletionRequest", {"prompt": "x", "use_beam_search": True}),
    ("CompletionRequest", {"prompt": "x", "stop": [""]}),
    ("CompletionRequest", {"prompt": [[1], []]}),
    ("CompletionRequest", {"prompt": "x", "truncate_prompt_tokens": 0}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "tool_choice": "none"}),  # tool_choice without tools
    ("ChatCompletionRequest", {"messages": MESSAGES, "tool_choice": "required", "tools": []}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "top_logprobs": 2}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": False}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
                               "parallel_tool_calls": False}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                               "guided_choice": ["a"]}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "allowed_token_ids": [5], "guided_regex": "0"}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "allowed_token_ids": [5], "tools": TOOLS,
                               "tool_choice": "required"}),
    ("TokenizeRequest", {}),  # neither prompt nor messages
    ("TokenizeRequest", {"prompt": "x", "messages": MESSAGES}),
    ("TokenizeRequest", {"prompt": "x", "add_generation_prompt": True}),
])
def test_what_the_edge_refuses_the_schema_refuses(component, body):
    """Schemathesis's complaint: requests valid by /openapi.json that the server refused (tokenize with neither
    field, tool_choice without tools, best_of other than n, ...). Each is now invalid by the document too."""
    assert not edge_accepts(component, body)
    assert not schema_accepts(component, body)


@pytest.mark.parametrize("component, body", [
    ("CompletionRequest", {"prompt": "x", "best_of": 1}),
    ("CompletionRequest", {"prompt": [1.0, 2], "n": 2.0, "max_tokens": 3.0}),  # JSON's 2.0 is the integer 2
    ("CompletionRequest", {"prompt": [[1, 2], [511]], "logit_bias": {"0": 1.0, "511": -1.0}, "stop": ["s"]}),
    ("CompletionRequest", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}),
    ("CompletionRequest", {"prompt": "x", "response_format": {"type": "text"}, "guided_choice": ["a"]}),
    ("CompletionRequest", {"prompt": "x", "structured_outputs": {"json_object": True, "any_whitespace": True}}),
    ("CompletionRequest", {"prompt": "x", "truncate_prompt_tokens": -1, "suffix": ""}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                               "parallel_tool_calls": False}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "parallel_tool_calls": False}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}),
    ("ChatCompletionRequest", {"messages": MESSAGES, "continue_final_message": True}),
    ("TokenizeRequest", {"prompt": "x", "return_token_strs": True}),
    ("TokenizeRequest", {"messages": MESSAGES, "tools": TOOLS, "continue_final_message": True,
                         "add_generation_prompt": False}),
])
def test_what_the_edge_accepts_the_schema_accepts(component, body):
    assert edge_accepts(component, body)
    assert schema_accepts(component, body)


def test_the_schema_holds_each_models_bounds():
    """Token ids below the vocabulary, n up to max_num_seqs, a named model where several are served."""
    assert schema_accepts("DetokenizeRequest", {"tokens": [511]})
    assert not schema_accepts("DetokenizeRequest", {"tokens": [512]})  # the replica answers 400 for it
    assert not schema_accepts("CompletionRequest", {"prompt": [5, 512]})
    assert not schema_accepts("CompletionRequest", {"prompt": "x", "logit_bias": {"512": 1.0}})
    assert not schema_accepts("CompletionRequest", {"prompt": "x", "n": 33})
    assert schema_accepts("CompletionRequest", {"prompt": "x"})
    assert not schema_accepts("CompletionRequest", {"prompt": "x"}, model_names=("tiny", "other"))
    assert schema_accepts("CompletionRequest", {"model": "other", "prompt": "x"}, model_names=("tiny", "other"))
    no_parser = {"tiny": ModelFactsFor(tool_call_parser=None)}
    assert not schema_accepts("ChatCompletionRequest", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"},
                              facts=no_parser)
    two = {"tiny": ModelFactsFor(), "solo": ModelFactsFor(tool_call_parser=None, max_num_seqs=4)}
    auto = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"}
    assert schema_accepts("ChatCompletionRequest", {"model": "tiny", **auto}, ("tiny", "solo"), two)
    assert not schema_accepts("ChatCompletionRequest", {"model": "solo", **auto}, ("tiny", "solo"), two)
    assert schema_accepts("CompletionRequest", {"model": "tiny", "prompt": "x", "n": 8}, ("tiny", "solo"), two)
    assert not schema_accepts("CompletionRequest", {"model": "solo", "prompt": "x", "n": 8}, ("tiny", "solo"), two)


def ModelFactsFor(**overrides):  # reads as the type it makes
    from cluster.schema_rules import ModelFacts

    return ModelFacts.from_info(TINY_FACTS | overrides, None)


def test_integers_below_is_exactly_the_token_ids():
    import re

    from cluster.schema_rules import integers_below

    for n in (1, 9, 10, 11, 100, 512, 1234, 128256):
        pattern = re.compile(integers_below(n))
        assert all(bool(pattern.match(str(i))) == (i < n) for i in range(n + 1500))
        assert not any(pattern.match(s) for s in ("00", "01", "-1", "+1", " 1", "1 "))


# ---- metrics ---------------------------------------------------------------------------------------------------
def test_metrics_merge_across_replicas():
    from cluster.metrics import ReplicaMetrics
    from engine.llm_engine import EngineStats
    from engine.request_output import RequestMetrics

    snapshots = []
    for replica, hits in (("r0", 32), ("r1", 0)):
        metrics = ReplicaMetrics("tiny", replica, use_ray=False)
        metrics.sync_engine_stats(EngineStats(1, 0, 0.25, 64, 48, hits, 0, 48, 10))
        metrics.sync_engine_stats(EngineStats(0, 0, 0.0, 64, 64, hits + 16, 0, 64, 12))
        metrics.observe_first_token(0.01)
        metrics.observe_finished("length", 0.2, RequestMetrics(100.0, 100.5, 101.0, 103.0, 7, 21))
        metrics.observe_steps([16, 300])
        snapshots.append(metrics.snapshot())
    text = merge_families(snapshots).decode()
    assert 'pagoda:prefix_cache_hits_total{model_name="tiny",replica="r0"} 48.0' in text
    assert 'pagoda:prefix_cache_hits_total{model_name="tiny",replica="r1"} 16.0' in text
    assert 'pagoda:kv_cache_usage_perc{model_name="tiny",replica="r0"} 0.0' in text
    assert 'pagoda:request_success_total{finished_reason="length",model_name="tiny",replica="r1"} 1.0' in text
    assert text.count("# TYPE pagoda:time_to_first_token_seconds histogram") == 1
    assert 'pagoda:request_queue_time_seconds_sum{model_name="tiny",replica="r0"} 0.5' in text
    assert 'pagoda:request_decode_time_seconds_sum{model_name="tiny",replica="r0"} 2.0' in text
    assert 'pagoda:request_time_per_output_token_seconds_sum{model_name="tiny",replica="r0"} 0.1' in text
    assert 'pagoda:request_generation_tokens_sum{model_name="tiny",replica="r1"} 21.0' in text
    assert 'pagoda:iteration_tokens_total_count{model_name="tiny",replica="r1"} 2.0' in text
    assert merge_families([[MetricFamily("x", "gauge", "d", [("x", {"a": "b"}, 1.0)])]]).decode().count("x{") == 1


def test_inter_token_latency_of_a_batch_counts_each_token_as_one_observation_would():
    from cluster.metrics import ReplicaMetrics

    def itl_lines(metrics):
        text = merge_families([metrics.snapshot()]).decode()
        return sorted(line for line in text.splitlines() if line.startswith("pagoda:inter_token_latency_seconds"))

    batched, one_by_one = ReplicaMetrics("tiny", "r0", use_ray=False), ReplicaMetrics("tiny", "r0", use_ray=False)
    for itl_s, n in ((0.02, 7), (0.1, 3), (0.1, 1), (0.3, 2), (90.0, 2)):  # on a bound, between bounds, past them
        batched.observe_inter_token(itl_s, n)
        for _ in range(n):
            one_by_one.observe_inter_token(itl_s)
    lines = itl_lines(batched)
    assert lines == itl_lines(one_by_one)
    assert 'pagoda:inter_token_latency_seconds_count{model_name="tiny",replica="r0"} 15.0' in lines
    assert 'pagoda:inter_token_latency_seconds_bucket{le="0.1",model_name="tiny",replica="r0"} 11.0' in lines


# ---- app args and placement ------------------------------------------------------------------------------------
def test_app_args_are_validated_with_clear_errors():
    assert parse_args({}).models[0].served_model_name == "smollm2-135m-instruct"
    assert ModelArgs(model="tiny").served_model_name == "pagoda-tiny"
    assert ModelArgs(model="Qwen/Qwen2.5-7B-Instruct").served_model_name == "Qwen/Qwen2.5-7B-Instruct"
    assert ModelArgs(model="/models/llama-3-8b/").served_model_name == "/models/llama-3-8b/"  # as vLLM names it
    assert parse_args({"models": [{"served_model_name": ["a", "b"]}]}).models[0].names == ["a", "b"]
    args = parse_args({"models": [{"block_size": 32, "num_replicas": 2}]}).models[0]
    assert args.engine.block_size == 32 and args.engine.stream_interval_s == 0.1 and args.num_replicas == 2
    for bad, where in [({"models": [{"num_replica": 2}]}, "models.0.num_replica"),
                       ({"models": [{"block_size": 0}]}, "block_size"),
                       ({"models": [{"dtype": "int3"}]}, "dtype"),
                       ({"models": [{"num_replicas": 1, "autoscaling_config": {}}]}, "not both"),
                       ({"models": [{"served_model_name": "a"}, {"served_model_name": ["b", "a"]}]}, "unique"),
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


def test_replica_placement_is_derived_in_one_place():
    assert ReplicaPlacement(1, "cpu", 0.5).replica_options() == {"ray_actor_options": {"num_cpus": 0.5,
                                                                                       "num_gpus": 0}}
    # The engine actor takes the GPU that the replica reserves in its placement group.
    one_gpu = ReplicaPlacement(1, "cuda", 1).replica_options()
    assert one_gpu["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    assert one_gpu["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}]
    # With the engine in the replica's process, the replica holds the GPU itself.
    assert ReplicaPlacement(1, "cuda", 1, engine_process=False).replica_options() == {
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 1}}
    tp4 = ReplicaPlacement(4, "cuda", 2, accelerator_type="H200", resources={"gpu_slot": 1}).replica_options()
    assert tp4["placement_group_bundles"] == [{"CPU": 2, "GPU": 1, "gpu_slot": 1, "accelerator_type:H200": 0.001},
                                              {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
    assert tp4["placement_group_strategy"] == "STRICT_PACK"
    assert tp4["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0}
    cpu = ReplicaPlacement(1, "cpu", 1, resources={"model_slot": 1}, label_selector={"pool": "a"}).replica_options()
    assert cpu == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0, "resources": {"model_slot": 1},
                                         "label_selector": {"pool": "a"}}}
    cpu_tp2 = ReplicaPlacement(2, "cpu", 0.5).replica_options()  # a core per rank; the replica's CPUs beside rank 0
    assert cpu_tp2["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1}]


# ---- the CLI ---------------------------------------------------------------------------------------------------
def test_cli_flags_become_app_args(capsys):
    from deploy.cli import GPU_INGRESS_REPLICAS, build_parser, main, serve_app_args

    args = build_parser().parse_args(["serve", "/models/x", "--served-model-name", "m", "m2", "--min-replicas", "1",
                                      "--max-replicas", "3", "--target-ongoing-requests", "8", "--api-key", "k",
                                      "--dtype", "half", "--no-enable-prefix-caching", "--disable-log-requests"])
    app_args = serve_app_args(args)
    model = app_args["models"][0]
    assert model["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8.0}
    assert (model["model"], model["dtype"], model["enable_prefix_caching"]) == ("/models/x", "float16", False)
    assert model["served_model_name"] == ["m", "m2"] and app_args["api_key"] == "k"
    assert app_args["ingress_replicas"] == 1  # no GPU here
    parse_args(app_args)
    on_gpu = serve_app_args(build_parser().parse_args(["serve", "--device", "cuda"]))
    assert on_gpu["ingress_replicas"] == GPU_INGRESS_REPLICAS
    chosen = serve_app_args(build_parser().parse_args(["serve", "--device", "cuda", "--ingress-replicas", "2"]))
    assert chosen["ingress_replicas"] == 2
    args = build_parser().parse_args(["serve", "--num-replicas", "2", "--max-replicas", "3"])
    with pytest.raises(ValueError, match="not both"):
        serve_app_args(args)
    with pytest.raises(ValueError, match="trust-remote-code"):
        serve_app_args(build_parser().parse_args(["serve", "--trust-remote-code"]))
    with pytest.raises(SystemExit):  # an unknown flag: the subcommand's usage, not the top level's
        main(["serve", "--no-such-flag"])
    assert "usage: pagoda serve" in capsys.readouterr().err


def test_ingress_modes_are_environments_for_the_cluster(monkeypatch, tmp_path):
    import os
    import shutil
    import socket

    import deploy.serve_env as serve_env

    for name in [*serve_env.HAPROXY_PORT_VARS, *serve_env.HAPROXY_FILE_VARS, serve_env.DRAINING_PERIOD[0],
                 serve_env.HAPROXY_TIMEOUT_CLIENT[0], serve_env.GRPC_MESSAGE[0]]:  # the session cluster's may be set
        monkeypatch.delenv(name, raising=False)
    proxy = serve_env.ingress_env("proxy")
    assert {k: proxy[k] for k in serve_env.DIRECT_INGRESS_ENV} == {k: "0" for k in serve_env.DIRECT_INGRESS_ENV}
    assert int(proxy[serve_env.GRPC_MESSAGE[0]]) > 10 * 1024 * 1024  # a whole request body fits a gRPC message
    with pytest.raises(ValueError, match="direct' or 'proxy"):
        serve_env.ingress_env("fast")
    env = serve_env.ingress_env("direct", str(tmp_path))
    assert {k: env[k] for k in serve_env.DIRECT_INGRESS_ENV} == serve_env.DIRECT_INGRESS_ENV
    for name in serve_env.HAPROXY_PORT_VARS:
        with socket.socket() as s:  # free when chosen
            s.bind(("0.0.0.0", int(env[name])))
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"] == str(tmp_path / "admin.sock")
    assert os.stat(tmp_path).st_mode & 0o077 == 0  # nobody else may reach the admin socket
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"  # a stop takes seconds, not 35
    assert int(env["RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"]) <= 120
    made = serve_env.ingress_env("direct")
    assert serve_env.haproxy_dir(made) and os.path.isdir(serve_env.haproxy_dir(made))
    shutil.rmtree(serve_env.haproxy_dir(made))
    monkeypatch.setenv("RAY_SERVE_HAPROXY_METRICS_PORT", "19101")  # the caller's choice is kept
    assert serve_env.ingress_env("direct", str(tmp_path))["RAY_SERVE_HAPROXY_METRICS_PORT"] == "19101"
    monkeypatch.setattr(serve_env.importlib.util, "find_spec", lambda name: None)  # no HAProxy: the Python proxy
    assert serve_env.ingress_env("direct") == serve_env.ingress_env("proxy")


# ---- autoscaling ---------------------------------------------------------------------------------------------
def _context(replicas: int, ongoing: float, kv: list[float], waiting: list[float], target_ongoing: float = 16):
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    ids = [f"r{i}" for i in range(replicas)]
    return AutoscalingContext(
        deployment_id=None, deployment_name="LLMServer_x", app_name="pagoda", current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=ongoing, total_queued_requests=0,
        aggregated_metrics={"kv_cache_usage": dict(zip(ids, kv)), "num_waiting": dict(zip(ids, waiting))},
        raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target_ongoing))


def test_the_pagoda_policy_scales_on_kv_usage_and_waiting_requests():
    import math

    from cluster.autoscaling import PagodaAutoscalingPolicy

    policy = PagodaAutoscalingPolicy(target_kv_cache_usage=0.75)
    decide = lambda ctx: math.ceil(policy(ctx)[0])  # noqa: E731 - Serve rounds up
    assert decide(_context(2, 16, [0.2, 0.2], [0, 0])) == 1  # little load: one replica would do
    assert decide(_context(2, 64, [0.2, 0.2], [0, 0])) == 4  # Serve's signal: 64 ongoing at 16 per replica
    # Few requests, but long ones: the caches fill (1.7 of 2 replicas' worth) before anything queues.
    assert decide(_context(2, 8, [0.85, 0.85], [0, 0])) == 3
    assert decide(_context(2, 8, [0.3, 0.3], [5, 0])) == 3  # requests wait already: one more now
    assert decide(_context(3, 20, [0.5, 0.4, 0.1], [0, 0, 0])) == 2  # it all fits in two at the targets


def test_autoscaling_args_pick_the_policy():
    from cluster.autoscaling import POLICY_PATH

    pagoda = parse_args({"models": [{"autoscaling_config": {"max_replicas": 4, "target_kv_cache_usage": 0.6}}]})
    config = pagoda.models[0].autoscaling_config.serve_config()
    assert config["policy"] == {"policy_function": POLICY_PATH, "policy_kwargs": {"target_kv_cache_usage": 0.6,
                                                                                   "target_waiting_requests": 0.0}}
    assert "target_kv_cache_usage" not in config and config["max_replicas"] == 4
    serve_own = parse_args({"models": [{"autoscaling_config": {"policy": "ongoing_requests"}}]})
    assert "policy" not in serve_own.models[0].autoscaling_config.serve_config()
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**config)  # Serve accepts what Pagoda builds


def test_a_model_admits_its_replicas_slots_and_its_queue_at_once():
    def admits(**kwargs):
        return ModelArgs(model="tiny", **kwargs).max_prompts_at_once

    assert admits(max_ongoing_requests=1, max_queued_requests=2) == 3  # one replica by default
    assert admits(num_replicas=3, max_ongoing_requests=4, max_queued_requests=5) == 17
    assert admits(autoscaling_config={"min_replicas": 1, "max_replicas": 4}, max_ongoing_requests=2,
                  max_queued_requests=0) == 8  # at the most replicas the autoscaler may start
    assert admits(max_queued_requests=-1) is None  # no queue limit: no batch limit
    assert admits(max_num_seqs=4, max_queued_requests=4) == 260  # max_ongoing_requests: 256 unless given


def test_max_ongoing_requests_is_a_serve_flag_and_follows_max_num_seqs():
    from cluster.app import _server_options
    from deploy.cli import build_parser, serve_app_args

    def model(*flags):
        return parse_args(serve_app_args(build_parser().parse_args(["serve", "--model", "tiny", *flags]))).models[0]

    assert model().max_ongoing_requests == 512  # the default max_num_seqs
    assert model("--max-num-seqs", "4").max_ongoing_requests == 256  # room for control calls beside a small batch
    assert model("--max-num-seqs", "512").max_ongoing_requests == 512  # never fewer than a step can batch
    m = model("--max-num-seqs", "4", "--max-ongoing-requests", "6", "--max-queued-requests", "4")
    assert (m.max_ongoing_requests, m.max_queued_requests, m.max_prompts_at_once) == (6, 4, 10)
    # Serve's own queue check stays off (it counts requests it is still routing): the ingress admits exactly
    options = _server_options(m, m.placement("cpu"))
    assert (options["max_ongoing_requests"], options["max_queued_requests"]) == (6, -1)
