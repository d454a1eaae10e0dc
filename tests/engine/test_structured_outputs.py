"""Structured outputs end to end on the built-in tiny model (random weights): whatever the model prefers, every
constrained output is complete and valid (jsonschema, re, Python's parser), with preemption, chunked prefill, n > 1,
aborts, streaming, overlapped (deferred sampling) and synchronous steps; bad constraints are errors naming the field.
"""

import json
import random
import re
import threading
import time

import jsonschema
import numpy as np
import pytest

from engine.errors import ParamError
from engine.request_output import RequestError
from engine.structured_outputs import StructuredOutputsParams
from pagoda import LLM, SamplingParams
from tests.engines import llm_engine
from tests.structured_cases import CHOICES, SCHEMAS, cases, check_output
from tests.workloads import run_workload

MAX_TOKENS = 120  # every case ends well before (about 50 tokens at most with these weights)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=512, max_num_seqs=64)
    yield llm
    llm.engine.check_integrity()
    llm.shutdown()


def constrained(case: StructuredOutputsParams, seed: int | None = None, **kwargs) -> SamplingParams:
    """Greedy without a seed, else sampled at temperature 1 with it."""
    return SamplingParams(**{"temperature": 0.0 if seed is None else 1.0, "seed": seed, "max_tokens": MAX_TOKENS,
                             "structured_outputs": case, **kwargs})


def by_index(delta) -> list[tuple[int, list[int]]]:
    return sorted((seq.index, seq.token_ids) for seq in delta.seqs)


def assert_complete_and_valid(case: StructuredOutputsParams, completion) -> None:
    assert completion.finish_reason == "stop", (completion.text, completion.finish_reason)
    check_output(case, completion.text)


def test_every_kind_gives_valid_outputs_sampled_and_greedy(llm):
    params = []
    for case in cases().values():
        for seed in [None, 0, 1, 2]:
            params.append(constrained(case, seed, n=2 if seed == 2 else 1))
    outs = llm.generate(["Hello"] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outs):
        for completion in out.outputs:
            assert_complete_and_valid(p.structured_outputs, completion)
    texts = [c.text for out in outs[4 * list(cases()).index("choice"):][:4] for c in out.outputs]
    assert len(set(texts)) > 1 and set(texts) <= set(CHOICES)
    assert llm.engine.structured.stats.num_compiles <= len(cases())  # one compilation per constraint
    llm.engine.check_integrity()


def test_json_object_and_free_whitespace(llm):
    obj = StructuredOutputsParams(json_object=True)
    outs = llm.generate(["Hello"] * 4, [constrained(obj, seed, max_tokens=400) for seed in range(4)], use_tqdm=False)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished  # unbounded strings: most of these random-weight objects run to the length limit
    for completion in finished:
        assert isinstance(json.loads(completion.text), dict)
    spaced = StructuredOutputsParams(json=SCHEMAS["person"], any_whitespace=True)
    outs = llm.generate(["Hello"] * 6, [constrained(spaced, seed) for seed in range(6)], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["person"])
    assert any(re.search(r"[ \n\t]", re.sub(r'"(?:[^"\\]|\\.)*"', "", t)) for t in texts)  # whitespace allowed


def test_overlapped_steps_sample_what_synchronous_steps_sample(tiny_model_dir, llm):
    """Deferred sampling (the in-process default: the forward runs, the bitmask follows), the bitmask inside the
    step (synchronous steps) and pipelined steps that carry it (an executor that cannot defer) give the same
    tokens; unconstrained requests in the same batch get the tokens they get alone."""
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [constrained(case, seed) for case in cases().values() for seed in (None, 5)] + [plain] * 2
    prompts = ["Hello", "The quick brown fox"] * (len(params) // 2)
    assert llm.engine.executor.supports_deferred_sampling
    overlapped = llm.generate(prompts, params, use_tqdm=False)
    alone = llm.generate(prompts[-2:], plain, use_tqdm=False)
    sync = LLM(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=512, max_num_seqs=64)
    sync.engine.executor.supports_overlap = False
    synchronous = sync.generate(prompts, params, use_tqdm=False)
    # An executor that launches without waiting but cannot defer sampling: the constrained steps run pipelined
    # (the step in flight read back first, its grammars advanced, the bitmask built and sent with the next step,
    # then the deltas of the one read back)
    piped = LLM(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=512, max_num_seqs=64)
    piped.engine.executor.supports_deferred_sampling = False
    pipelined = piped.generate(prompts, params, use_tqdm=False)
    for a, b, c in zip(overlapped, synchronous, pipelined):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in overlapped[-2:]] == [o.outputs[0].token_ids for o in alone]
    for engine in (sync.engine, piped.engine):
        assert engine.structured.stats.num_fills > 0
        engine.check_integrity()
    sync.shutdown()
    piped.shutdown()


def test_length_limit_ignore_eos_and_stop_strings(llm):
    person = StructuredOutputsParams(json=SCHEMAS["person"])
    cut = llm.generate(["Hello"], constrained(person, 0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4  # a truncated JSON, as OpenAI reports it
    with pytest.raises(ValueError):
        json.loads(cut.text)
    # The grammar ends the request even when eos may not (nothing but a stop token could follow).
    full = llm.generate(["Hello"], constrained(person, 0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert_complete_and_valid(person, full)
    assert full.token_ids[-1] not in llm.engine.eos_token_ids
    with_eos = llm.generate(["Hello"], constrained(person, 0), use_tqdm=False)[0].outputs[0]
    assert with_eos.text == full.text
    stopped = llm.generate(["Hello"], constrained(person, 0, stop=['"age"']), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == '"age"'
    assert full.text.startswith(stopped.text) and len(stopped.text) < len(full.text)
    llm.engine.check_integrity()  # every matcher released (length, stop, stop string)


def test_a_stop_token_id_the_grammar_needs_stops_the_request_there(llm):
    """stop_token_ids that are not EOS are plain tokens to the grammar: where the grammar needs one, it is
    sampled and ends the request (like a stop string). They used to be masked as EOS is, which left an empty
    mask where one was the only token allowed, and the request failed ("the grammar rejected token 0")."""
    person = StructuredOutputsParams(json=SCHEMAS["person"])
    full = llm.generate(["Hello"], constrained(person), use_tqdm=False)[0].outputs[0]
    assert_complete_and_valid(person, full)
    for position in (1, len(full.token_ids) // 2):
        token = full.token_ids[position]
        first = full.token_ids.index(token)
        stopped = llm.generate(["Hello"], constrained(person, stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
        assert (stopped.finish_reason, stopped.stop_reason) == ("stop", token), stopped
        assert stopped.token_ids == full.token_ids[:first + 1]
    llm.engine.check_integrity()


def test_streamed_deltas_add_up_to_valid_outputs(tiny_model_dir):
    engine = llm_engine(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=512)
    texts: dict[str, list[str]] = {}
    finals = {}
    all_cases = cases()
    for name, case in all_cases.items():
        engine.add_request(name, "Hello", constrained(case, 3, n=2))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for seq in delta.seqs:
                texts.setdefault(f"{delta.request_id}/{seq.index}", []).append(seq.text)
                finals[f"{delta.request_id}/{seq.index}"] = seq.finish_reason
    assert len(texts) == 2 * len(all_cases)
    assert max(len(parts) for parts in texts.values()) > 5  # streamed: many deltas per sequence
    for key, parts in texts.items():
        assert finals[key] == "stop"
        check_output(all_cases[key.split("/")[0]], "".join(parts))
    engine.check_integrity()
    engine.shutdown()


def test_preemption_chunked_prefill_n_and_aborts_keep_the_guarantees(tiny_model_dir):
    """A pool too small for the batch (preemption, recompute), 6-token steps (chunked prefill), n > 1, aborts, new
    requests while others run: every finished output is valid, each seeded one is what the request gets alone, and
    no matcher outlives its request."""
    all_cases = list(cases().items())
    rng = random.Random(0)
    work = []
    for i in range(24):
        name, case = rng.choice(all_cases)
        prompt = " ".join(rng.choices("the quick brown fox jumps over a lazy dog".split(), k=rng.randint(1, 12)))
        work.append((f"r{i}-{name}", prompt, constrained(case, i, n=rng.choice([1, 1, 2])), rng.random() < 0.15))
    engine = llm_engine(model=tiny_model_dir, device="cpu", block_size=4, num_kv_blocks=24,
                                 max_num_batched_tokens=6, max_num_seqs=8)
    for name, case in all_cases:  # compiled before the workload: when requests start no longer depends on timing
        engine.add_request(f"warm-{name}", "Hello", constrained(case, 0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    finished, aborted = run_workload(engine, work, rng, abort_probability=0.2, check=engine.check_integrity)
    assert engine.scheduler.num_preemptions > 0
    assert set(finished) | aborted == {w[0] for w in work}
    roomy = llm_engine(model=tiny_model_dir, device="cpu", block_size=16, num_kv_blocks=512)
    for req_id, prompt, params, _ in work:
        if req_id in aborted:
            continue
        for seq in finished[req_id].seqs:
            assert_complete_and_valid(params.structured_outputs, seq)
        roomy.add_request(req_id, prompt, params, stream=False)
        while roomy.has_unfinished_requests():
            for delta in roomy.step():
                if delta.finished:  # not streamed: the one delta holds each sequence's whole output
                    assert by_index(delta) == by_index(finished[req_id])
    engine.shutdown()
    roomy.shutdown()


def test_tokens_past_the_tokenizer_are_never_allowed(tmp_path):
    from checkpoints.tiny import make_tiny_model

    model_dir = make_tiny_model(str(tmp_path / "wide"), config_overrides={"vocab_size": 1100})  # tokenizer: 1000
    engine = llm_engine(model=model_dir, device="cpu", num_kv_blocks=64)
    tokenizer_size = len(engine.tokenizer)
    assert engine.vocab_size == 1100 > tokenizer_size
    case = StructuredOutputsParams(json_object=True)
    engine.add_request("a", "Hello", constrained(case, 0, max_tokens=30))
    engine.structured.poll()
    engine.structured.wait_for_compile(timeout_s=60)
    engine.structured.poll()
    bitmask = engine.structured.fill_bitmask(["a"], engine.scheduler.requests).bitmask
    assert bitmask.shape == (1, -(-tokenizer_size // 32))  # the tokenizer's width: the kernel disallows the rest
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    assert bits.any() and not bits[tokenizer_size:].any()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert all(t < tokenizer_size for seq in delta.seqs for t in seq.token_ids)
    engine.check_integrity()
    engine.shutdown()


NESTED_33 = {"type": "integer"}
for _ in range(32):
    NESTED_33 = {"type": "array", "items": NESTED_33}


@pytest.mark.parametrize("value, message", [
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1, 2]), "structured_outputs.json must be a JSON schema object"),
    (dict(json={"type": "strin"}), "structured_outputs.json is invalid: Unsupported type"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 3}), "structured_outputs.json is invalid"),
    (dict(json={"allOf": [{"type": "integer"}]}), "structured_outputs.json uses the keyword 'allOf', which is not"),
    (dict(json={"type": "object", "properties": {"s": {"type": "string", "pattern": "a+", "maxLength": 3}}}),
     "structured_outputs.json has a string with both pattern"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}),
     "structured_outputs.json has the $ref 'http://example.com/a.json': only references into the schema itself"),
    (dict(json={"type": "array", "items": {"$ref": "file:///etc/passwd"}}), "structured_outputs.json has the $ref"),
    (dict(json={"$defs": {"A": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}),
     "structured_outputs.json has the $ref '#/$defs/B', which points at nothing in the schema"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/required"}}, "required": ["a"]}),
     "structured_outputs.json has the $ref '#/required', which points at no schema"),
    (dict(json={"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(100_000)]}}}),
     "structured_outputs.json is 888,937 characters long; at most 262,144 are allowed"),  # 198 s of CPU it took
    (dict(json={"anyOf": [{"enum": list(range(600))}, {"enum": list(range(400))}, {"const": 1}]}),
     "structured_outputs.json has more than 1,000 enum and const values"),
    (dict(json=NESTED_33), "structured_outputs.json nests subschemas more than 32 deep"),
    (dict(choice=[f"c{i}" for i in range(1001)]), "structured_outputs.choice has 1,001 choices; at most 1,000"),
    (dict(choice=["x" * 200] * 1000), "structured_outputs.choice becomes a grammar of 207,009 characters; at most"),
    (dict(regex="a" * 300_000), "structured_outputs.regex is 300,000 characters long"),
    (dict(regex="a(b"), "structured_outputs.regex is invalid: Regex parsing error"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
    (dict(grammar="root ::= foo"), "structured_outputs.grammar is invalid: EBNF parser error"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice=["a", ""]), "structured_outputs.choice must be a non-empty list of non-empty strings"),
    (dict(json_object=True, regex="a"), "structured_outputs must set exactly one of"),
    (dict(), "structured_outputs must set exactly one of"),
    (dict(regex="a", any_whitespace=True), "structured_outputs.any_whitespace applies to json"),
    (dict(jsn={}), "structured_outputs has unknown fields"),
])
def test_bad_constraints_are_errors_naming_the_field(value, message):
    with pytest.raises(ParamError) as e:
        SamplingParams(structured_outputs=value)
    assert str(e.value).startswith(message), str(e.value)
    assert message.startswith(e.value.param)  # the field the HTTP edge reports


def test_threads_that_ask_for_one_new_constraint_at_once_build_it_once(monkeypatch):
    """The ingress validates each request on a thread of its own: 16 threads with one new schema build its grammar
    once (each built it: on an H200's host a burst's first tokens came 0.55 s late); another schema builds beside
    them, and a refused one is refused to every thread that asked."""
    import engine.structured_outputs as so

    built, release = [], threading.Event()
    real_build = so._build_grammar

    def slow_build(kind, text, any_whitespace):
        built.append(text)
        release.wait(timeout=30)  # every thread has started before the first build may finish
        return real_build(kind, text, any_whitespace)

    monkeypatch.setattr(so, "_build_grammar", slow_build)
    schema = {"type": "object", "properties": {"threads": {"type": "integer", "minimum": 16}}}
    results, errors = [], []

    def ask(value):
        try:
            results.append(StructuredOutputsParams(**value))
        except ParamError as e:
            errors.append(e)

    values = [dict(json=schema)] * 16 + [dict(regex="[0-9]{2,3}")] + [dict(regex="(unclosed")] * 3
    threads = [threading.Thread(target=ask, args=(v,)) for v in values]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(set(built)) < 3:  # the three builds run together: none waits for another constraint's
        assert time.monotonic() < deadline, built
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 17 and len(errors) == 3
    assert sum("threads" in text for text in built) == 1, built
    assert len({id(so.grammar_for(r)) for r in results if r.kind == "json"}) == 1
    assert so._building == {}  # nothing left behind

def test_the_real_model_answers_in_the_schema(real_llm):
    """SmolLM2-135M-Instruct, greedy: the constraint keeps it to compact JSON of the schema, and it still knows."""
    schema = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30},
                                               "capital": {"type": "string", "maxLength": 30}},
              "required": ["country", "capital"]}
    question = [{"role": "user", "content": "What is the capital of France? Reply with a JSON object with the keys "
                                            "country and capital."}]
    out = real_llm.chat(question, constrained(StructuredOutputsParams(json=schema), max_tokens=60),
                        use_tqdm=False)[0].outputs[0]
    assert_complete_and_valid(StructuredOutputsParams(json=schema), out)
    assert json.loads(out.text)["capital"] == "Paris"
    real_llm.engine.check_integrity()


def test_a_bad_request_leaves_the_engine_serving(llm):
    with pytest.raises(ValueError, match="^structured_outputs.regex"):
        llm.generate(["Hello"], SamplingParams(structured_outputs={"regex": "(("}), use_tqdm=False)
    case = StructuredOutputsParams(choice=CHOICES)
    assert llm.generate(["Hello"], constrained(case), use_tqdm=False)[0].outputs[0].text in CHOICES


def test_min_tokens_yields_to_a_grammar_that_allows_only_stop_tokens(llm):
    """min_tokens blocks the stop tokens; the choice "x" allows only its token, a stop token here: the request
    ends there ("stop", the choice, fewer than min_tokens tokens), neither sampling from an empty mask nor
    failing."""
    x = llm.engine.tokenizer.encode("x", add_special_tokens=False)
    assert len(x) == 1
    for seed in (None, 0):
        params = constrained(StructuredOutputsParams(choice=["x"]), seed, min_tokens=5, stop_token_ids=x)
        completion = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
        assert completion.finish_reason == "stop" and list(completion.token_ids) == x, completion
    llm.engine.check_integrity()


class _RefusingCompiler:
    """Stands in for xgrammar's compiler refusing a grammar: nothing that passes the edge's checks fails the real
    one (tried: empty, self-recursive, left-recursive and lookahead grammars, huge repeats), so its error is made
    here, as xgrammar raises one (a RuntimeError with its time and C++ location in front)."""

    def compile_grammar(self, grammar):
        raise RuntimeError("[12:00:00] /project/cpp/grammar_compiler.cc:1: the grammar is refused")


@pytest.mark.parametrize("fault, kind, param, message", [
    ("tokenizer", RequestError.INTERNAL, None, "structured_outputs: the grammar did not compile: "),
    ("compiler", RequestError.INVALID, "structured_outputs.regex",
     "structured_outputs.regex did not compile: the grammar is refused"),
])
def test_a_grammar_that_fails_to_compile_fails_its_request_alone(tiny_model_dir, fault, kind, param, message):
    """The failed request's last delta says why, as a kind the HTTP edge maps to a status: a grammar the compiler
    refuses is the request's fault (a 400 naming the field), a compiler that cannot be built the engine's (500)."""
    engine = llm_engine(model=tiny_model_dir, device="cpu", num_kv_blocks=64)
    if fault == "tokenizer":  # fault injection: a tokenizer xgrammar cannot read fails the compiler's construction
        engine.structured.tokenizer = object()
    else:
        engine.structured._compiler = _RefusingCompiler()
    engine.add_request("bad", "Hello", constrained(StructuredOutputsParams(regex="[ab]+")))
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=5))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({delta.request_id: delta for delta in engine.step() if delta.finished})
    error = finals["bad"].error
    assert (error.kind, error.param) == (kind, param) and error.message.startswith(message), error
    assert finals["bad"].seqs[0].finish_reason == "error"
    assert finals["plain"].error is None and finals["plain"].seqs[0].finish_reason == "length"
    engine.check_integrity()
    engine.shutdown()


def test_a_grammar_not_compiled_in_time_fails_its_request_alone(tiny_model_dir):
    """Compilations that hold every compile thread (stand-ins: jobs on the engine's real queue that wait for the
    test) keep a constrained request's from starting; past the compile timeout (time moved by hand) it fails with
    the reason, its queued compilation is cancelled, and a plain request beside it is served."""
    from engine.grammar import MAX_SLOW_COMPILES, NUM_COMPILE_THREADS, SLOW_COMPILE_S

    engine = llm_engine(model=tiny_model_dir, device="cpu", num_kv_blocks=64)
    structured, gate, now = engine.structured, threading.Event(), [0.0]
    structured.clock = structured.compiles.clock = lambda: now[0]
    held = [structured.compiles.submit(gate.wait) for _ in range(NUM_COMPILE_THREADS)]
    now[0] += SLOW_COMPILE_S
    structured.compiles.dispatch()
    held += [structured.compiles.submit(gate.wait) for _ in range(MAX_SLOW_COMPILES)]
    engine.add_request("late", "Hello", constrained(StructuredOutputsParams(regex="[ab]+")))
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=5))
    now[0] += structured.compile_timeout_s + 1
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({delta.request_id: delta for delta in engine.step() if delta.finished})
    timeout = f"structured_outputs: the grammar did not compile within {structured.compile_timeout_s:g} s"
    assert finals["late"].error.message.startswith(timeout)
    assert finals["late"].error.kind == RequestError.UNAVAILABLE  # a 503: the same request may pass later
    assert finals["plain"].error is None and finals["plain"].seqs[0].finish_reason == "length"
    assert structured.stats.num_compile_timeouts == 1 and structured.stats.num_compiles_cancelled == 1
    assert structured.compiles.num_pending == 0 and not any(f.done() for f in held)
    gate.set()
    engine.check_integrity()
    engine.shutdown()
