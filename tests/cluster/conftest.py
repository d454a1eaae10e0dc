"""The Serve app for the serve tests: deployed once per session on the session's Ray cluster, on a free port.

    model "tiny"        2 replicas (router and metrics tests), max_model_len 1024, a chat template with tools
    model "tiny-solo"   1 replica, health checked every second (the dead-engine tests kill and restart it)
    model "tiny-queue"  1 replica that takes 1 request at a time and queues 2 more (back pressure: 429)
"""

import pytest

from tests.ports import free_port

API_KEY = "test-key"
MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS = 32  # chats that give no max_tokens (the fuzzer's) stop here, not at the context's end
# The tiny model's template (checkpoints/tiny.py), which renders the same without tools, plus tools and calls in
# Hermes's format: the server reads tool_choice "auto" with the parser this template implies.
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\\nTools:\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}"
    "{% endfor %}{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}"
    "{{ '<tool_call>' }}{{ call['function'] | tojson }}{{ '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def serve_url(ray_cluster):
    from ray import serve
    from ray.serve.context import _get_global_client

    from cluster.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port  # another test module may have started Serve first
    small = {"model": "tiny", "num_kv_blocks": 256, "replica_num_cpus": 0.5, "max_num_seqs": 32}
    app = build_app({
        # "tiny" runs with a host KV tier (every committed block written through to it): the serve tests, the soak
        # with its disconnects included, exercise it and check both tiers' integrity
        "models": [{"served_model_name": "tiny", "num_replicas": 2, "max_model_len": 1024,
                    "chat_template": TOOLS_CHAT_TEMPLATE, **small, "num_host_kv_blocks": 512},
                   {"served_model_name": "tiny-solo", "num_replicas": 1, "health_check_period_s": 1.0, **small},
                   {"served_model_name": "tiny-queue", "num_replicas": 1, "max_ongoing_requests": 1,
                    "max_queued_requests": 2, **small}],
        "api_key": API_KEY, "max_body_bytes": MAX_BODY_BYTES, "accept_timeout_s": 20, "debug": True,
        "default_max_tokens": DEFAULT_MAX_TOKENS})
    serve.run(app, name="pagoda", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("pagoda")


@pytest.fixture(scope="session")
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def client(serve_url):
    import openai

    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(serve_url, auth):
    import httpx

    with httpx.Client(base_url=serve_url, headers=auth, timeout=60) as c:
        yield c
