"""A tensor_parallel_size=2 replica behind Serve (CPU, gloo): the replica's placement group comes from
cluster/placement.py, the engine's RayExecutor fills it with its ranks, it answers like the tp=1 model, and
deleting the app drains a request in flight before the replica and its group go away."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cluster.conftest import API_KEY

PROMPTS = ["Hello, my name is", "def fibonacci(n):"]


def serve_placement_groups(name: str) -> list[dict]:
    import ray

    return [pg for pg in ray.util.placement_group_table().values()
            if name in (pg.get("name") or "") and pg["state"] != "REMOVED"]


def stream_usage(url: str, max_tokens: int, started: threading.Event) -> tuple[str, int, float]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    finish, usage = None, None
    for chunk in client.completions.create(model="tiny-tp2", prompt="Once upon a time", max_tokens=max_tokens,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        started.set()
        finish = chunk.choices[0].finish_reason if chunk.choices else finish
        usage = chunk.usage or usage
    return finish, usage.completion_tokens, time.monotonic()


@pytest.mark.slow  # deploys a tp 2 app: ~25 s
def test_tp2_replica_uses_its_placement_group_and_matches_tp1(serve_url):
    from ray import serve

    from cluster.app import build_app

    app = build_app({"models": [{"model": "tiny", "served_model_name": "tiny-tp2", "tensor_parallel_size": 2,
                                 "num_kv_blocks": 256, "max_model_len": 512, "max_num_seqs": 32}]})
    serve.run(app, name="pagoda-tp", route_prefix="/tp")
    try:
        groups = serve_placement_groups("LLMServer_tiny-tp2")
        assert len(groups) == 1
        assert list(groups[0]["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
        assert groups[0]["strategy"] == "STRICT_PACK"
        with httpx.Client(timeout=60) as http:
            for prompt in PROMPTS:
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                tp2 = http.post(f"{serve_url}/tp/v1/completions", json=body)
                tp1 = http.post(f"{serve_url}/v1/completions", json={**body, "model": "tiny"},
                                headers={"Authorization": f"Bearer {API_KEY}"})
                assert tp2.status_code == tp1.status_code == 200, tp2.text
                assert tp2.json()["choices"][0]["text"] == tp1.json()["choices"][0]["text"]
            assert http.get(f"{serve_url}/tp/debug/integrity").status_code == 404  # debug endpoints are off
            server = serve.get_deployment_handle("LLMServer_tiny-tp2", app_name="pagoda-tp")
            assert server.check_integrity.remote().result(timeout_s=60)["ok"]
            assert http.get(f"{serve_url}/tp/health").json() == {"status": "ok", "models": {
                "tiny-tp2": {"replicas": 1, "healthy": 1}}}
        with ThreadPoolExecutor(1) as pool:  # a request in flight while the app goes away is drained, not cut
            started = threading.Event()
            streaming = pool.submit(stream_usage, f"{serve_url}/tp", 200, started)
            assert started.wait(60), "the stream never started"
            deleting_at = time.monotonic()
            serve.delete("pagoda-tp")
            finish, num_tokens, finished_at = streaming.result(timeout=120)
            assert (finish, num_tokens) == ("length", 200) and finished_at > deleting_at
    finally:
        serve.delete("pagoda-tp")
    deadline = time.monotonic() + 30  # the replica's shutdown released its workers and the group
    while serve_placement_groups("LLMServer_tiny-tp2"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
