"""The OpenAI API of the running Serve app, through the official `openai` client (real Ray cluster, real HTTP)."""

import pytest

from engine.tokenizer import apply_chat_template

PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
NO_EOS = {"ignore_eos": True}


def test_models_list(client):
    models = client.models.list()
    assert {m.id for m in models.data} == {"tiny", "tiny-solo", "tiny-queue"}
    assert all(m.object == "model" and m.owned_by == "pagoda" for m in models.data)


def test_models_retrieve(client):
    import openai

    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "pagoda")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/no-such-model")
    assert info.value.code == "model_not_found" and info.value.status_code == 404


def test_the_openai_clients_request_id_is_pagodas(client):
    """x-request-id (the client's `_request_id`) is Pagoda's request id: the body's and X-Pagoda-Request-Id's, and
    the suffix of the completion's id; a client's own X-Request-Id is adopted, as vLLM does."""
    import openai

    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2)
    out = raw.parse()
    assert raw.headers.get_list("x-request-id") == [out._request_id]
    assert out.id == f"cmpl-{out._request_id}" and raw.headers["x-pagoda-request-id"] == out._request_id
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                          extra_headers={"X-Request-Id": "trace-42"})
    assert (chat._request_id, chat.id) == ("trace-42", "chatcmpl-trace-42")
    twice = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,  # one id, two requests: both run
                                       extra_headers={"X-Request-Id": "same"}) for _ in range(2)]
    assert [c.id for c in twice] == ["cmpl-same", "cmpl-same"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    response = info.value.response
    assert info.value.request_id == response.headers["x-pagoda-request-id"] == response.json()["request_id"]


def test_completion_usage_equals_tokenizer_counts(client, tiny_tokenizer):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, temperature=0, extra_body=NO_EOS)
    assert out.object == "text_completion" and out.model == "tiny" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(tiny_tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert out.choices[0].finish_reason == "length" and out.choices[0].text


def test_streamed_completion_equals_non_streamed(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=NO_EOS)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])



@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(client, chat):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens sent up to it."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    args = dict(model="tiny", max_tokens=9, temperature=0, stream=True, stream_options=options, extra_body=NO_EOS)
    if chat:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **args))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **args))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 9 and (counts[0] == 0 or not chat)  # chat: the role first
    assert len({c.usage.prompt_tokens for c in chunks}) == 1 and chunks[-1].choices == []
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)

def test_chat_usage_counts_the_chat_template(client, tiny_tokenizer):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                         extra_body=NO_EOS)
    prompt = apply_chat_template(tiny_tokenizer, MESSAGES)
    assert out.usage.prompt_tokens == len(tiny_tokenizer.encode(prompt, add_special_tokens=False))
    assert out.usage.completion_tokens == 6
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    streamed = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                                   stream=True, extra_body=NO_EOS))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == out.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "length"


def test_n_and_batched_prompts_index_choices(client):
    out = client.completions.create(model="tiny", prompt=["one", "two"], n=2, max_tokens=3, temperature=1.0,
                                    seed=5, extra_body=NO_EOS)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=4, extra_body=NO_EOS)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    chunks = list(client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3,
                                            stream=True, extra_body=NO_EOS))
    assert {c.choices[0].index for c in chunks} == {0, 1, 2, 3}


def test_completion_logprobs_legacy_shape(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body=NO_EOS)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the sampled token is the best


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    streamed = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True, extra_body=NO_EOS))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_stop_strings_cut_the_text_streamed_or_not(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body=NO_EOS).choices[0].text
    candidates = (full[i:i + 3] for i in range(4, len(full) - 3))  # a plain 3-character piece from the middle
    stop = next(c for c in candidates if c.strip() and c.isprintable() and "\ufffd" not in c)
    cut = full[:full.index(stop)]
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body=NO_EOS)
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                              stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body=NO_EOS).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(1234), sample(1), sample(2)}) > 1


def test_echo_and_token_prompts(client, tiny_tokenizer):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                    extra_body=NO_EOS)
    assert out.choices[0].text.startswith(PROMPT)
    ids = tiny_tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, extra_body=NO_EOS)
    assert PROMPT + by_ids.choices[0].text == out.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client, tiny_model_dir):
    """lm-eval's loglikelihood request: the echoed prompt's tokens with their logprobs (the first None), then the
    completion's; streamed, the same tokens and logprobs."""
    from pagoda import LLM, SamplingParams

    llm = LLM(model=tiny_model_dir, device="cpu", num_kv_blocks=64)
    (ref,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1,
                                                   prompt_logprobs=1), use_tqdm=False)
    llm.shutdown()
    body = dict(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1, extra_body=NO_EOS)
    out = client.completions.create(**body)
    lp = out.choices[0].logprobs
    ids = ref.prompt_token_ids + ref.outputs[0].token_ids
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [entry[t] for entry, t in zip(ref.prompt_logprobs[1:], ref.prompt_token_ids[1:])]
    expected += [entry[t] for entry, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1:], expected))
    assert lp.text_offset[0] == 0 and out.choices[0].text.startswith(PROMPT)
    streamed = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == lp.tokens and values[0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(values[1:], lp.token_logprobs[1:]))
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    prompt_lps = scored.choices[0].model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ref.prompt_token_ids)
    first = prompt_lps[1][str(ref.prompt_token_ids[1])]
    assert abs(first["logprob"] - ref.prompt_logprobs[1][ref.prompt_token_ids[1]]) < 1e-4


def test_http_matches_offline_llm_greedy_tokens(client, ray_cluster, serve_url):
    from pagoda import LLM, SamplingParams

    prompts = ["Hello, my name is", "def fibonacci(n):"]
    llm = LLM(model="tiny", num_kv_blocks=256, max_model_len=512, max_num_seqs=32)
    try:
        offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    finally:
        llm.shutdown()
    for prompt, expected in zip(prompts, offline):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
                                        extra_body=NO_EOS)
        choice = out.choices[0]
        assert choice.text == expected.outputs[0].text
        expected_tokens = [tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(t)])
                           for t in expected.outputs[0].token_ids]
        assert choice.logprobs.tokens == expected_tokens


def test_tokenize_and_detokenize(http, tiny_tokenizer):
    r = http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tiny_tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024
    chat = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()
    assert chat["count"] == len(tiny_tokenizer.encode(apply_chat_template(tiny_tokenizer, MESSAGES),
                                                      add_special_tokens=False))
    back = http.post("/detokenize", json={"model": "tiny", "tokens": body["tokens"]}).json()
    assert back["prompt"].endswith(PROMPT)


def test_tokenize_takes_a_prompt_or_messages_never_both(http):
    both = http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT, "messages": MESSAGES})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt", both.text
    neither = http.post("/tokenize", json={"model": "tiny"})
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt", neither.text
    chat_field = http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT, "add_generation_prompt": False})
    assert chat_field.status_code == 400 and chat_field.json()["error"]["param"] == "add_generation_prompt"


def test_tokenize_as_vllm_tools_token_strings_and_a_continued_message(http, tiny_tokenizer):
    """vLLM's /tokenize extras: the chat's `tools` rendered by its template, `return_token_strs`, and
    `continue_final_message` (the last message left open, no generation prompt)."""
    from tests.cluster.conftest import TOOLS_CHAT_TEMPLATE

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    r = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "tools": tools, "return_token_strs": True})
    assert r.status_code == 200, r.text
    text = apply_chat_template(tiny_tokenizer, MESSAGES, chat_template=TOOLS_CHAT_TEMPLATE, tools=tools)
    assert "get_time" in text
    expected = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    assert r.json()["token_strs"] == tiny_tokenizer.convert_ids_to_tokens(expected)
    assert http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()["token_strs"] is None
    prefill = [*MESSAGES, {"role": "assistant", "content": "Well, the"}]
    r = http.post("/tokenize", json={"model": "tiny", "messages": prefill, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert tiny_tokenizer.decode(r.json()["tokens"]).endswith("<|im_start|>assistant\nWell, the")
    both = http.post("/tokenize", json={"model": "tiny", "messages": prefill, "continue_final_message": True,
                                        "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_health_and_metrics_text(http, client):
    health = http.get("/health").json()
    assert health["status"] in ("ok", "degraded")  # degraded: a replica another test killed is being replaced
    assert set(health["models"]) == {"tiny", "tiny-solo", "tiny-queue"}
    assert health["models"]["tiny"] == {"replicas": 2, "healthy": 2}
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, extra_body=NO_EOS)
    text = http.get("/metrics").text
    for name in ("pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc",
                 "pagoda:prefix_cache_queries_total", "pagoda:prefix_cache_hits_total", "pagoda:num_preemptions_total",
                 "pagoda:prompt_tokens_total", "pagoda:generation_tokens_total",
                 "pagoda:time_to_first_token_seconds_bucket", "pagoda:inter_token_latency_seconds_bucket",
                 "pagoda:e2e_request_latency_seconds_bucket", "pagoda:request_success_total"):
        assert name in text, name
    assert 'model_name="tiny-solo"' in text


# ---- vLLM's request extensions, as clients written for vLLM send them --------------------------------------------
def test_return_token_ids_whole_and_streamed(client, tiny_tokenizer):
    """RL frameworks read prompt_token_ids and token_ids (vLLM's return_token_ids): the prompt's ids, the choice's
    ids (a stream: each chunk's new ones, the prompt's in a choice's first chunk; a chat's beside the choices)."""
    body = {"return_token_ids": True, **NO_EOS}
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=body)
    choice = out.choices[0].model_dump()
    assert choice["prompt_token_ids"] == tiny_tokenizer.encode(PROMPT)
    assert len(choice["token_ids"]) == out.usage.completion_tokens == 6
    assert tiny_tokenizer.decode(choice["token_ids"]) == out.choices[0].text
    chunks = [c.model_dump() for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                                                  temperature=0, stream=True, extra_body=body)]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                          extra_body=body).model_dump()
    rendered = apply_chat_template(tiny_tokenizer, MESSAGES)
    assert chat["prompt_token_ids"] == tiny_tokenizer.encode(rendered, add_special_tokens=False)
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    stream = [c.model_dump() for c in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                                                       temperature=0, stream=True, extra_body=body)]
    assert stream[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in stream[1:] for t in c["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]


def test_prompt_logprobs_is_null_unless_asked_for(http):
    completion = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).json()
    assert "prompt_logprobs" in completion["choices"][0] and completion["choices"][0]["prompt_logprobs"] is None
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}).json()
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, tiny_tokenizer):
    long_prompt = "word " * 1500  # past the context (1024 tokens): refused without truncation
    out = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=3,
                                    extra_body={"truncate_prompt_tokens": 100, "return_token_ids": True, **NO_EOS})
    assert out.usage.prompt_tokens == 100
    ids = tiny_tokenizer.encode(long_prompt)
    assert out.choices[0].model_dump()["prompt_token_ids"] == [ids[0], *ids[-99:]]  # its BOS, then the end
    fits = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=24,
                                     extra_body={"truncate_prompt_tokens": -1, **NO_EOS})
    assert fits.usage.prompt_tokens == 1024 - 24
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_prompt}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 50})
    assert chat.usage.prompt_tokens == 50


def test_chat_continue_final_message_and_echo(client, tiny_tokenizer):
    """A prefilled answer: the model continues the last (assistant) message; with echo the answer starts with it,
    whole and streamed, as vLLM answers."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "Well, the"}]
    body = {"continue_final_message": True, "add_generation_prompt": False, "echo": True, **NO_EOS}
    out = client.chat.completions.create(model="tiny", messages=prefill, max_tokens=4, temperature=0,
                                         extra_body=body)
    rendered = apply_chat_template(tiny_tokenizer, prefill, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("assistant\nWell, the")
    assert out.usage.prompt_tokens == len(tiny_tokenizer.encode(rendered, add_special_tokens=False))
    assert out.choices[0].message.content.startswith("Well, the") and len(out.choices[0].message.content) > 9
    stream = client.chat.completions.create(model="tiny", messages=prefill, max_tokens=4, temperature=0,
                                            stream=True, extra_body=body)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == out.choices[0].message.content
    plain = client.chat.completions.create(model="tiny", messages=prefill, max_tokens=4, temperature=0,
                                           extra_body={"continue_final_message": True, **NO_EOS})
    assert "Well, the" + plain.choices[0].message.content == out.choices[0].message.content


def test_allowed_token_ids_on_both_endpoints(client):
    allowed = [300, 301, 302]
    body = {"allowed_token_ids": allowed, "return_token_ids": True, **NO_EOS}
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body=body)
    assert set(out.choices[0].model_dump()["token_ids"]) <= set(allowed)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True,
                                          extra_body=body)
    ids = [t for c in chat for choice in c.choices for t in choice.model_dump().get("token_ids") or []]
    assert ids and set(ids) <= set(allowed)


def test_tokenizer_info_for_lm_evals_remote_tokenizer(http, tiny_tokenizer):
    from tests.cluster.conftest import TOOLS_CHAT_TEMPLATE

    info = http.get("/tokenizer_info", params={"model": "tiny"})
    assert info.status_code == 200, info.text
    info = info.json()
    assert info["eos_token"] == tiny_tokenizer.eos_token and info["bos_token"] == tiny_tokenizer.bos_token
    assert info["chat_template"] == TOOLS_CHAT_TEMPLATE and info["tokenizer_class"]
    assert not any(key.endswith("_file") or key == "name_or_path" for key in info)  # no paths of the server's
    several = http.get("/tokenizer_info")  # three models served: which one?
    assert several.status_code == 400 and several.json()["error"]["param"] == "model"


def test_what_pagoda_does_not_do_is_a_400_that_says_so(http):
    beam = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "use_beam_search": True, "n": 2})
    assert beam.status_code == 400 and "beam search is not supported" in beam.json()["error"]["message"]
    lark = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                   "structured_outputs": {"grammar": 'start: "yes" | "no"'}})
    assert lark.status_code == 400 and "Lark grammar" in lark.json()["error"]["message"], lark.text
