"""`pagoda serve` with no model serves the built-in SmolLM2-135M-Instruct as `smollm2-135m-instruct`, and it
answers a factual chat question correctly through the real `openai` client."""

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
