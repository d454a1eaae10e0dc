"""LoRA adapters through `pagoda serve` on the session's Ray cluster, with the real `openai` client: adapters
written by peft on the tiny model, served with `--enable-lora --lora-modules` on 2 replicas with 1 GPU slot each
(so requests of two adapters wait for each other's slot); their answers equal the offline `LLM.generate` with the
same `LoRARequest` (greedy). Also: /v1/models, runtime loading and unloading (on, off, the API key, bad adapters),
routing by adapter, and the lora metrics. The GCS store that ingress replicas share is tested directly too."""

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import pytest

from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams
from engine.tokenizer import apply_chat_template
from tests.ports import free_port

APP, OFF_APP = "pagoda-lora", "pagoda-lora-off"
KEY = "lora-key"
MAX_TOKENS = 8
PROMPTS = ["The quick brown fox jumps over", "def fibonacci(n):", "Once upon a time"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """name -> path: two served from the start, one loaded at run time, one of rank 32 (over --max-lora-rank)."""
    from tests.lora_adapters import make_adapter

    root = tmp_path_factory.mktemp("serve-lora")
    specs = {"qv": (8, ["q_proj", "v_proj"]), "all": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]),
             "mlp": (8, ["up_proj", "down_proj"]), "wide": (32, ["q_proj"])}
    return {name: make_adapter(tiny_model_dir, str(root / name), rank, 2.0 * rank, targets, seed=i)
            for i, (name, (rank, targets)) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def serve_base(ray_cluster):
    """Serve's HTTP address on the session's cluster (started here if no other module started it)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    return f"http://127.0.0.1:{_get_global_client().http_config.port}"


def deploy(serve_base: str, name: str, flags: list[str], router: dict | None = None) -> str:
    from ray import serve

    from cluster.app import build_app
    from deploy.cli import build_parser, serve_app_args

    app_args = serve_app_args(build_parser().parse_args(["serve", *flags]))
    if router is not None:
        app_args["models"][0]["router"] = router
    serve.run(build_app(app_args), name=name, route_prefix=f"/{name}")
    return f"{serve_base}/{name}"


@pytest.fixture(scope="module")
def lora_url(serve_base, tiny_model_dir, adapters):
    from ray import serve

    flags = ["--model", tiny_model_dir, "--dtype", "float32", "--served-model-name", "base", "--enable-lora",
             "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "16", "--lora-modules",
             f"qv={adapters['qv']}", f'{{"name": "all", "path": "{adapters["all"]}"}}', "--num-replicas", "2",
             "--replica-num-cpus", "0.5", "--num-kv-blocks", "256", "--api-key", KEY, "--allow-runtime-lora-updating"]
    yield deploy(serve_base, APP, flags)
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(lora_url):
    return openai.OpenAI(base_url=f"{lora_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(lora_url):
    with httpx.Client(base_url=lora_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    from pagoda import LLM

    llm = LLM(model=tiny_model_dir, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16)
    yield llm
    llm.shutdown()


def expected(offline, adapters, prompt, adapter: str | None) -> str:
    """The offline engine's greedy text of the prompt (a text, or a dict prompt) with the adapter."""
    lora = None if adapter is None else LoRARequest(adapter, list(adapters).index(adapter) + 1, adapters[adapter])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return offline.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def complete(client, model: str, prompt: str) -> str:
    out = client.completions.create(model=model, prompt=prompt, **GREEDY)
    assert out.model == model and out.choices[0].finish_reason == "length"
    return out.choices[0].text


def test_models_list_the_adapters_with_their_parent(client, adapters):
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {"base", "qv", "all"}
    assert cards["base"]["parent"] is None
    for name in ("qv", "all"):
        assert (cards[name]["parent"], cards[name]["root"], cards[name]["owned_by"]) == ("base", adapters[name],
                                                                                         "pagoda")
    assert client.models.retrieve("qv").model_dump()["parent"] == "base"


def test_the_openapi_document_names_the_adapters_as_models(http):
    document = http.get("/openapi.json").json()
    assert set(document["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"]) >= \
        {"base", "qv", "all"}
    assert "/v1/load_lora_adapter" not in document["paths"]  # an operator's endpoint, as /metrics


def test_completions_and_chats_with_an_adapter_equal_offline_generate(client, offline, adapters):
    for prompt in PROMPTS:
        texts = {model: complete(client, model, prompt) for model in ("base", "qv", "all")}
        for model, text in texts.items():
            assert text == expected(offline, adapters, prompt, None if model == "base" else model), (model, prompt)
    assert any(complete(client, "qv", p) != complete(client, "base", p) for p in PROMPTS)  # the adapter applies
    rendered = {"prompt": apply_chat_template(offline.get_tokenizer(), MESSAGES, True, None),
                "add_special_tokens": False}
    for model in ("all", "base"):
        chat = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
        assert chat.model == model
        assert chat.choices[0].message.content == expected(offline, adapters, rendered,
                                                           None if model == "base" else model)


def test_base_and_adapter_requests_interleaved_each_equal_their_own_run(client, offline, adapters):
    """12 requests at once over the base and two adapters, on replicas with one GPU slot each: the adapters'
    requests wait for the slot (none fails), and each answer is its own offline run's."""
    jobs = [(model, prompt) for prompt in PROMPTS for model in ("qv", "base", "all")]
    jobs += [("all", PROMPTS[0]), ("qv", PROMPTS[1]), ("base", PROMPTS[2])]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: complete(client, *job), jobs))
    for (model, prompt), text in zip(jobs, texts):
        assert text == expected(offline, adapters, prompt, None if model == "base" else model), (model, prompt)


def test_tokenizer_endpoints_take_an_adapters_name_as_its_bases(http):
    def tokens(model):
        r = http.post("/tokenize", json={"model": model, "prompt": PROMPTS[0]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert tokens("qv") == tokens("base") and tokens("qv")
    r = http.post("/detokenize", json={"model": "all", "tokens": tokens("base")})
    assert r.status_code == 200 and r.json()["prompt"].endswith(PROMPTS[0])


def test_an_unknown_model_is_the_usual_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=1)
    assert info.value.code == "model_not_found" and "qv" in info.value.message


def test_requests_for_an_adapter_stay_on_the_replica_that_has_it(http):
    replicas = {}
    for model in ("qv", "all", "qv", "all"):
        for i in range(3):
            r = http.post("/v1/completions", json={"model": model, "prompt": f"{i} short {model}", "max_tokens": 2})
            assert r.status_code == 200, r.text
            replicas.setdefault(model, set()).add(r.headers["x-pagoda-replica"])
    assert all(len(seen) == 1 for seen in replicas.values()), replicas


def test_runtime_load_serves_the_adapter_and_unload_stops_it(client, http, offline, adapters):
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": adapters["mlp"]})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'mlp' added successfully."
    cards = {m.id: m for m in client.models.list().data}
    assert cards["mlp"].model_dump()["parent"] == "base" and cards["mlp"].model_dump()["root"] == adapters["mlp"]
    want = expected(offline, adapters, PROMPTS[0], "mlp")
    assert [complete(client, "mlp", PROMPTS[0]) for _ in range(4)] == [want] * 4
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": adapters["mlp"]})
    assert again.status_code == 400 and "'mlp'" in again.json()["error"]["message"]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": adapters["mlp"]}
                     ).status_code == 400  # the base model's name
    unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'mlp' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt="x", max_tokens=1)
    assert "mlp" not in {m.id for m in client.models.list().data}
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    static = http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
    assert static.status_code == 400 and "lora_modules" in static.json()["error"]["message"]


@pytest.mark.parametrize(("adapter", "says"), [
    ("missing", "has no adapter_config.json"),
    ("wide", "r = 32 is larger than max_lora_rank (16)"),
])
def test_a_bad_adapter_is_a_400_naming_it_and_the_server_keeps_serving(client, http, adapters, tmp_path, adapter,
                                                                       says):
    path = str(tmp_path / "nothing") if adapter == "missing" else adapters[adapter]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{adapter}", "lora_path": path})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and f"adapter 'bad-{adapter}'" in error["message"]
    assert says in error["message"] and error["param"] == "lora_path"
    assert f"bad-{adapter}" not in {m.id for m in client.models.list().data}
    assert complete(client, "qv", PROMPTS[0]) and complete(client, "base", PROMPTS[0])


def test_runtime_loading_needs_the_api_key(lora_url, adapters):
    r = httpx.post(f"{lora_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["mlp"]})
    assert r.status_code == 401
    r = httpx.post(f"{lora_url}/v1/unload_lora_adapter", json={"lora_name": "qv"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_unloading_lets_running_requests_finish(client, http, adapters):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "mlp2", "lora_path": adapters["mlp"]}
                     ).status_code == 200
    stream = client.completions.create(model="mlp2", prompt=PROMPTS[1], max_tokens=48, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]  # it runs
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp2"}).status_code == 200
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp2", prompt="x", max_tokens=1)


def test_lora_metrics_are_exported(http):
    assert http.post("/v1/completions", json={"model": "qv", "prompt": "x", "max_tokens": 1}).status_code == 200
    text = http.get("/metrics").text
    assert 'lora_name="qv"' in text and "pagoda:lora_request_success_total{" in text
    info = [line for line in text.splitlines() if line.startswith("pagoda:lora_requests_info{")]
    assert len(info) == 2 and all('max_lora="1"' in line for line in info)  # one series a replica


@pytest.mark.slow  # deploys a second app (20+ s on 2 cores)
def test_runtime_updating_off_is_a_404_saying_how_to_turn_it_on(serve_base, tiny_model_dir, adapters, monkeypatch):
    from ray import serve

    monkeypatch.delenv("PAGODA_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    url = deploy(serve_base, OFF_APP, ["--model", tiny_model_dir, "--enable-lora", "--num-kv-blocks", "64",
                                       "--replica-num-cpus", "0.5", "--engine-in-replica"])
    try:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["mlp"]})
        assert r.status_code == 404 and "PAGODA_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 404
    finally:
        serve.delete(OFF_APP)


def test_ingress_replicas_share_runtime_adapters_through_the_gcs(ray_cluster):
    """Two registries with one store key stand for two ingress replicas: what one loads the other serves, one
    name is never given twice, even to loads at the same moment, and unloading shows at both."""
    import asyncio

    from cluster import errors
    from cluster.lora_registry import LoRAConfig, LoRARegistry, adapter_id

    config = LoRAConfig(modules=[{"name": "static", "id": 1, "path": "/s", "base_model_name": "base"}],
                        models=["base"], allow_runtime_updating=True, store_key=uuid.uuid4().hex)
    first, second = LoRARegistry(config), LoRARegistry(config)
    checked = []

    async def check(module):
        checked.append(module.request)

    async def scenario():
        added = await first.add("a", "/a", "base", check)
        assert (await second.get("a")) == added and added.request == LoRARequest("a", adapter_id("a", "/a"), "/a")
        results = await asyncio.gather(*(r.add("b", f"/b{i}", "base", check) for i, r in enumerate((first, second))),
                                       return_exceptions=True)
        assert sum(isinstance(r, errors.InvalidRequestError) for r in results) == 1  # one name, once
        with pytest.raises(errors.InvalidRequestError):
            await second.add("static", "/x", "base", check)
        await second.add("c", "/c", "base", check)
        assert sorted(m.name for m in await first.list()) == ["a", "b", "c", "static"]
        assert [m.request.path for m in await first.list() if m.name == "b"] in (["/b0"], ["/b1"])
        await second.remove("a")
        assert await first.get("a") is None
        with pytest.raises(errors.NotFoundError):
            await first.remove("a")

    asyncio.run(scenario())
    assert [lora.name for lora in checked] == ["a", "b", "b", "c"]  # each load checked before it was published


@pytest.mark.slow
def test_a_hot_adapter_spreads_when_its_replica_is_busy(serve_base, tiny_model_dir, adapters):
    """With the router's imbalance threshold at 1, one adapter's requests go to the replica that holds it while it
    runs at most 1 more than the other; the next goes to the other, which serves the adapter too. The requests are
    streams held open (each read to its first token, so it runs on its replica when the next is routed; 2,000 tokens
    each, so none ends before the test closes it), not a burst whose overlap depends on the machine's speed."""
    from ray import serve

    flags = ["--model", tiny_model_dir, "--served-model-name", "hot-base", "--enable-lora", "--lora-modules",
             f"hot={adapters['qv']}", "--num-replicas", "2", "--replica-num-cpus", "0.5", "--num-kv-blocks", "512"]
    url = deploy(serve_base, "pagoda-lora-hot", flags, router={"imbalance_threshold": 1})
    body = {"model": "hot", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=120) as http, ExitStack() as streams:
            replicas, lines = [], []
            for i in range(3):
                response = streams.enter_context(
                    http.stream("POST", f"{url}/v1/completions", json={**body, "prompt": f"{i} hot"}))
                assert response.status_code == 200
                lines.append(response.iter_lines())  # kept: a closed line iterator closes the stream (an abort)
                first = next(line for line in lines[-1] if line.startswith("data: "))
                assert json.loads(first[len("data: "):])["choices"][0]["text"] is not None
                replicas.append(response.headers["x-pagoda-replica"])
            assert replicas[1] == replicas[0]  # the adapter's holder: it runs 1, the other none
            assert replicas[2] != replicas[0]  # its holder runs 2, more than 0 + 1: the hot adapter spreads
    finally:
        serve.delete("pagoda-lora-hot")


@pytest.mark.slow
def test_an_app_whose_adapter_is_bad_does_not_start(serve_base, tiny_model_dir, adapters, tmp_path):
    """A Serve config (no CLI check before it): each replica reads its lora_modules as it starts, so a bad one fails
    the deployment (no replica of the model runs), and Serve's status names the adapter."""
    from ray import serve

    from cluster.app import build_app

    app = build_app({"models": [{"model": tiny_model_dir, "served_model_name": "broken", "enable_lora": True,
                                 "num_kv_blocks": 64, "replica_num_cpus": 0.5, "engine_process": False,
                                 "lora_modules": [{"name": "fine", "path": adapters["qv"]},
                                                  {"name": "broken-adapter", "path": str(tmp_path / "none")}]}]})
    try:
        with pytest.raises(RuntimeError, match="LLMServer_broken"):
            serve.run(app, name="pagoda-lora-broken", route_prefix="/pagoda-lora-broken")
        status = serve.status().applications["pagoda-lora-broken"]  # what `serve status` and a RayService show
        message = status.deployments["LLMServer_broken"].message
        assert "lora_modules: adapter 'broken-adapter'" in message and "has no adapter_config.json" in message
        assert status.status == "DEPLOY_FAILED" and status.deployments["LLMServer_broken"].status == "DEPLOY_FAILED"
    finally:
        serve.delete("pagoda-lora-broken")
