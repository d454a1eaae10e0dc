"""`pagoda serve` with no model serves the built-in SmolLM2-135M-Instruct as `smollm2-135m-instruct`, and it
answers a factual chat question correctly through the real `openai` client."""

import json

import openai
import pytest

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real_url(serve_url, real_model_dir):
    """The app as `pagoda serve` builds it with no --model (prepared beforehand: the replica finds it cached)."""
    from ray import serve

    from cluster.app import build_app

    app = build_app({"models": [{"device": "cpu", "num_kv_blocks": 64, "max_num_seqs": 4, "replica_num_cpus": 0.5}]})
    serve.run(app, name="pagoda-real", route_prefix="/real")
    yield f"{serve_url}/real"
    serve.delete("pagoda-real")


def test_default_model_answers_through_the_openai_client(real_url):
    client = openai.OpenAI(base_url=f"{real_url}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.slow  # lm-eval twice: ~15 s
@pytest.mark.timeout(900)
def test_lm_eval_through_pagoda_serve_gives_the_hf_backends_results(real_url, real_model_dir, tmp_path):
    """lm-eval's `local-completions` model against the server (loglikelihoods: echo + logprobs; generations: stop
    strings), on a small local task file, and lm-eval's own `hf` backend on the same checkpoint: the same scores,
    item by item."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from tests.lm_eval_tasks import evaluate, write_tasks

    write_tasks(tmp_path)
    served = LocalCompletionsAPI(model=MODEL, base_url=f"{real_url}/v1/completions", tokenizer_backend="huggingface",
                                 tokenizer=real_model_dir, batch_size=16, max_length=1024, num_concurrent=1)
    pagoda = evaluate(served, tmp_path)
    hf = evaluate(HFLM(pretrained=real_model_dir, device="cpu", dtype="float32", batch_size=16), tmp_path)
    accuracy = pagoda["results"]["pagoda_mc"]["acc,none"]
    assert accuracy == hf["results"]["pagoda_mc"]["acc,none"] and 0.5 < accuracy < 1.0
    match = pagoda["results"]["pagoda_gen"]["exact_match,none"]
    assert match == hf["results"]["pagoda_gen"]["exact_match,none"] and match >= 0.5
    for ours, theirs in zip(pagoda["samples"]["pagoda_mc"], hf["samples"]["pagoda_mc"]):
        for (ll, greedy), (hf_ll, hf_greedy) in zip((r[0] for r in ours["resps"]), (r[0] for r in theirs["resps"])):
            assert abs(ll - hf_ll) < 1e-3 and greedy == hf_greedy
    for ours, theirs in zip(pagoda["samples"]["pagoda_gen"], hf["samples"]["pagoda_gen"]):
        assert ours["filtered_resps"] == theirs["filtered_resps"]


def test_structured_answers_of_the_real_model(real_url):
    """The openai client's parse() and a required tool call, on SmolLM2: the constraint gives the shape, the model
    the facts."""
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        capital: str

    client = openai.OpenAI(base_url=f"{real_url}/v1", api_key="none", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    reply = client.chat.completions.parse(model=MODEL, messages=question, response_format=Capital, temperature=0,
                                          max_tokens=40)
    assert reply.choices[0].message.parsed.capital == "Paris"
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"]}}}
    call = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Berlin today?"}],
        tools=[weather], tool_choice="required", temperature=0, max_tokens=40)
    calls = call.choices[0].message.tool_calls
    assert call.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    assert "Berlin" in json.loads(calls[0].function.arguments)["city"]
