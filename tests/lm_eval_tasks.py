"""Two small lm-eval tasks written as local files (no dataset download) and their evaluation: a loglikelihood task
(multiple choice) and a generation task, for tests/cluster/test_serve_real_model.py, which runs them through
`pagoda serve` and through lm-eval's own `hf` backend."""

import json

import yaml

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


def evaluate(model, root) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, tasks=["pagoda_mc", "pagoda_gen"], bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=str(root), include_defaults=False),
                                      log_samples=True)
    return results
