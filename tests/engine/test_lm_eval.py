"""lm-eval on the real default model: a loglikelihood task and a generation task (local task files, written here)
give the same results through Pagoda as through lm-eval's own `hf` backend on the same checkpoint.

Pagoda is reached through lm-eval's `local-completions` model (its payloads, its parsing of the answers): only the
HTTP transport is replaced, by `OfflineCompletions.model_call`, which answers each OpenAI completions payload
(`echo` + `logprobs` for loglikelihoods, `stop` and `max_tokens` for generations) with the offline engine, as
`pagoda serve` is to answer it over HTTP.
"""

import copy
import json

import pytest
import yaml

from engine import SamplingParams

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
            ("Russia", "Moscow"), ("Egypt", "Cairo"), ("China", "Beijing"), ("Greece", "Athens"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Norway", "Oslo"), ("Ireland", "Dublin"),
            ("Poland", "Warsaw"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
            ("Cuba", "Havana"), ("Hungary", "Budapest"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
            ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"), ("Belgium", "Brussels")]
FACTS = [("The color of the clear daytime sky is", ["blue", "green", "red", "black"], 0),
         ("The number of legs a spider has is", ["six", "eight", "four", "ten"], 1),
         ("The opposite of hot is", ["warm", "big", "cold", "fast"], 2),
         ("Ice is frozen", ["sand", "metal", "air", "water"], 3),
         ("The animal that barks is the", ["dog", "cat", "cow", "fish"], 0),
         ("The planet we live on is", ["Mars", "Earth", "Venus", "Jupiter"], 1)]


def write_tasks(root) -> None:
    """Two tasks: 20 four-way multiple choices (80 loglikelihoods) and 12 capital cities (greedy generation)."""
    cities = [city for _, city in CAPITALS]
    choice_docs = [{"question": f"The capital of {country} is", "choices": [city] + [c for c in cities if c != city][
        i % 5:i % 5 + 3], "label": 0} for i, (country, city) in enumerate(CAPITALS[:14])]
    choice_docs += [{"question": q, "choices": c, "label": label} for q, c, label in FACTS]
    for doc in choice_docs[::2]:  # not always the first choice
        doc["choices"] = doc["choices"][::-1]
        doc["label"] = len(doc["choices"]) - 1 - doc["label"]
    gen_docs = [{"question": f"Question: What is the capital of {country}?\nAnswer: The capital of {country} is",
                 "answer": city} for country, city in CAPITALS[12:]]
    common = {"dataset_path": "json", "test_split": "test", "output_type": None}
    tasks = {
        "pagoda_mc": (choice_docs, {**common, "output_type": "multiple_choice", "doc_to_text": "{{question}}",
                                    "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
                                    "target_delimiter": " ", "metric_list": [{"metric": "acc"}]}),
        "pagoda_gen": (gen_docs, {**common, "output_type": "generate_until", "doc_to_text": "{{question}}",
                                  "doc_to_target": "{{answer}}",
                                  "generation_kwargs": {"until": ["\n", ".", ","], "max_gen_toks": 8,
                                                        "do_sample": False, "temperature": 0.0},
                                  "metric_list": [{"metric": "exact_match", "ignore_case": True,
                                                   "regexes_to_ignore": [" "]}]}),
    }
    for name, (docs, config) in tasks.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        config = {**config, "task": name, "dataset_kwargs": {"data_files": {"test": str(data)},
                                                             "cache_dir": str(root / "datasets")}}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config))


def completions_answer(llm, payload: dict) -> dict:
    """An OpenAI /v1/completions answer to `payload` from the offline engine (the fields lm-eval sends and
    reads). With echo and logprobs, the prompt's tokens come first: token_logprobs[0] is None, then the prompt
    logprobs, then the completion's."""
    tokenizer = llm.get_tokenizer()
    prompts = payload["prompt"] if isinstance(payload["prompt"][0], (list, str)) else [payload["prompt"]]
    k, echo = payload.get("logprobs"), payload.get("echo", False)
    params = SamplingParams(temperature=payload.get("temperature", 1.0), max_tokens=payload["max_tokens"],
                            stop=payload.get("stop"), seed=payload.get("seed"), logprobs=k,
                            prompt_logprobs=k if echo else None)
    outs = llm.generate([{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts], params,
                        use_tqdm=False)
    choices = []
    for index, out in enumerate(outs):
        completion = out.outputs[0]
        token_ids = (out.prompt_token_ids if echo else []) + completion.token_ids
        logprobs = None
        if k is not None:
            entries = (out.prompt_logprobs if echo else []) + completion.logprobs
            top = [None if e is None else dict(sorted(e.items(), key=lambda kv: -kv[1])[:k]) for e in entries]
            logprobs = {"tokens": [tokenizer.decode([t]) for t in token_ids],
                        "token_logprobs": [None if e is None else e[t] for t, e in zip(token_ids, entries)],
                        "top_logprobs": [None if t is None else {tokenizer.decode([i]): v for i, v in t.items()}
                                         for t in top]}
        text = (tokenizer.decode(out.prompt_token_ids) if echo else "") + completion.text
        choices.append({"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": completion.finish_reason})
    return {"object": "text_completion", "choices": choices}


def offline_completions(llm, tokenizer_dir: str):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class OfflineCompletions(LocalCompletionsAPI):
        """lm-eval's local-completions model with the HTTP post replaced by the offline engine."""

        def model_call(self, messages, *, generate=True, gen_kwargs=None, **kwargs):
            payload = self._create_payload(self.create_message(messages), generate=generate,
                                           gen_kwargs=copy.deepcopy(gen_kwargs), seed=self._seed,
                                           eos=self.eos_string, **kwargs)
            return completions_answer(llm, payload)

    return OfflineCompletions(model="smollm2-135m-instruct", base_url="offline", tokenizer_backend="huggingface",
                              tokenizer=tokenizer_dir, batch_size=16, max_length=1024)


def evaluate(model, root) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, tasks=["pagoda_mc", "pagoda_gen"], bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=str(root), include_defaults=False),
                                      log_samples=True)
    return results


@pytest.mark.timeout(900)
def test_pagoda_gives_the_hf_backends_results(real_llm, real_model_dir, tmp_path):
    from lm_eval.models.huggingface import HFLM

    write_tasks(tmp_path)
    pagoda = evaluate(offline_completions(real_llm, real_model_dir), tmp_path)
    hf = evaluate(HFLM(pretrained=real_model_dir, device="cpu", dtype="float32", batch_size=16), tmp_path)
    accuracy = pagoda["results"]["pagoda_mc"]["acc,none"]
    assert accuracy == hf["results"]["pagoda_mc"]["acc,none"]
    assert 0.5 < accuracy < 1.0  # a real model: better than chance, not everything
    match = pagoda["results"]["pagoda_gen"]["exact_match,none"]
    assert match == hf["results"]["pagoda_gen"]["exact_match,none"] and match >= 0.5
    for ours, theirs in zip(pagoda["samples"]["pagoda_mc"], hf["samples"]["pagoda_mc"]):
        for (ll, greedy), (hf_ll, hf_greedy) in zip((r[0] for r in ours["resps"]), (r[0] for r in theirs["resps"])):
            assert abs(ll - hf_ll) < 1e-3 and greedy == hf_greedy
    for ours, theirs in zip(pagoda["samples"]["pagoda_gen"], hf["samples"]["pagoda_gen"]):
        assert ours["filtered_resps"] == theirs["filtered_resps"]
