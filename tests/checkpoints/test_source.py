"""Model names as users type them: the built-in names, paths, Hugging Face repo ids resolved in a local cache laid
out as huggingface_hub lays it out; generation_config.json defaults; a chat template that replaces the model's."""

import json
import os
import shutil

import pytest

from checkpoints.source import default_served_model_name, resolve_model
from engine.config import EngineArgs
from engine.sampling_params import default_sampling_overrides
from pagoda import LLM, SamplingParams

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hf_cache(root, repo_id: str, model_dir: str) -> str:
    """hub/models--org--name/{blobs, refs/main, snapshots/<commit>/...} with the snapshot's files linking to blobs,
    as huggingface_hub writes a download."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot, blobs = repo / "snapshots" / COMMIT, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, name in enumerate(sorted(os.listdir(model_dir))):
        shutil.copy(os.path.join(model_dir, name), blobs / f"blob{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snapshot / name)
    return str(snapshot)


def test_repo_ids_resolve_to_the_local_snapshot(tmp_path, monkeypatch, tiny_model_dir):
    snapshot = fake_hf_cache(tmp_path / "home" / "hub", "Org/Tiny-Instruct", tiny_model_dir)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model("Org/Tiny-Instruct") == snapshot
    assert default_served_model_name("Org/Tiny-Instruct") == "Org/Tiny-Instruct"
    llm = LLM(model="Org/Tiny-Instruct", device="cpu", num_kv_blocks=32)
    assert llm.engine.config.model.model == snapshot
    assert llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE wins over HF_HOME
    with pytest.raises(ValueError, match="no local snapshot in the Hugging Face cache .*elsewhere"):
        resolve_model("Org/Tiny-Instruct")


def test_unknown_names_say_where_they_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"models--Org--Missing.*downloads nothing"):
        EngineArgs(model="Org/Missing").create_engine_config()
    with pytest.raises(ValueError, match="no such .gguf file"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="not a checkpoint directory, a .gguf file, 'tiny' or a Hugging Face"):
        resolve_model("no/such/path")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json and no .gguf file"):
        resolve_model(str(tmp_path / "empty"))


def test_built_in_names():
    assert default_served_model_name(None) == "smollm2-135m-instruct"
    assert default_served_model_name("tiny") == "pagoda-tiny"
    # A path is served under the name it was given, as vLLM does.
    assert default_served_model_name("/models/llama-3-8b/") == "/models/llama-3-8b/"
    assert default_served_model_name("/models/SmolLM2.Q4_1.gguf") == "/models/SmolLM2.Q4_1.gguf"
    assert resolve_model("tiny").endswith("tiny-llama-v1")


@pytest.fixture
def tiny_copy(tmp_path, tiny_model_dir):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    return path


def _set_generation_config(path, **fields) -> None:
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, **fields}))


def test_generation_config_defaults_apply_where_a_request_sets_none(tiny_copy):
    _set_generation_config(tiny_copy, temperature=0.0, top_k=5, top_p=0.5, repetition_penalty=1.3, do_sample=True)
    llm = LLM(model=str(tiny_copy), device="cpu", num_kv_blocks=32)
    overrides = default_sampling_overrides(llm.engine.config.model)
    assert overrides == {"temperature": 0.0, "top_k": 5, "top_p": 0.5, "repetition_penalty": 1.3}
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty) == (0.0, 5, 0.5, 1.3)
    explicit = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, repetition_penalty=1.3)
    prompts = ["The quick brown fox", "Once upon a time"]
    by_default = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]  # greedy, penalized
    assert by_default == [o.outputs[0].token_ids for o in llm.generate(prompts, explicit, use_tqdm=False)]
    plain = SamplingParams(temperature=0.0)
    assert by_default != [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    llm.shutdown()


def test_a_bad_generation_config_fails_at_load(tiny_copy):
    _set_generation_config(tiny_copy, top_p=0.0)
    with pytest.raises(ValueError, match="generation_config.json of .*: top_p must be in"):
        EngineArgs(model=str(tiny_copy)).create_engine_config()


def test_chat_template_override_from_a_file_or_text(tmp_path, tiny_model_dir):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}=>"
    (tmp_path / "t.jinja").write_text(template)
    conversation = [{"role": "user", "content": "Hi"}]
    for value in (str(tmp_path / "t.jinja"), template):
        llm = LLM(model="tiny", device="cpu", num_kv_blocks=16, chat_template=value)
        assert llm.engine.config.model.chat_template == template
        out = llm.chat(conversation, SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt == "[user] Hi\n=>"
        llm.shutdown()
    with pytest.raises(ValueError, match="^chat_template 'nope.jinja' is neither a file nor a Jinja template"):
        EngineArgs(model="tiny", chat_template="nope.jinja").create_engine_config()
