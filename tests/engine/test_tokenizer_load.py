"""The tokenizer's load in a child process (engine/tokenizer.py TokenizerChild): AutoTokenizer runs there and the
tokenizer comes back pickled, so the engine's process never imports what AutoTokenizer imports to choose a class.
The oracle is AutoTokenizer in this process: the same class, vocabulary, special tokens, token ids and chat
template; the same error for a directory without a tokenizer; a child that cannot start falls back to loading in
process; a GPU engine starts the child before its imports and takes its tokenizer from it."""

import logging
import os
import signal
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

import engine.llm_engine
import engine.tokenizer
from cluster.executors import pick_executor
from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import TokenizerChild, load_tokenizer

TEXT = "<|im_start|>user\nHello, world! The cache is split into blocks.<|im_end|>\n  tabs\tand unicode: é ü 中"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _assert_same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs) > 100
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                                          theirs.pad_token_id)
    ids = theirs(TEXT)["input_ids"]
    assert ours(TEXT)["input_ids"] == ids and len(ids) > 5
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.chat_template == theirs.chat_template is not None
    rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "What is the capital?" in rendered


@pytest.mark.slow  # 11 s: every tokenizer kind through a child; make test keeps the fresh-process cases
def test_tokenizers_come_back_from_the_child_as_autotokenizer_loads_them(tiny_checkpoints, real_model_dir):
    # the tiny checkpoints share one tokenizer: qwen2's is the one whose model type AutoTokenizer maps to a class of
    # its own (Qwen2Tokenizer) other than the generic class its tokenizer_config.json names; SmolLM2's is real
    for path in (tiny_checkpoints["qwen2"], real_model_dir):
        _assert_same(load_tokenizer(path, child=TokenizerChild(path)), AutoTokenizer.from_pretrained(path))


def test_a_directory_without_a_tokenizer_fails_the_same_way_in_the_child(tmp_path):
    empty = str(tmp_path / "no-tokenizer")
    os.mkdir(empty)
    with pytest.raises(ValueError, match=f"tokenizer '{empty}' could not be loaded") as here:
        load_tokenizer(empty)
    with pytest.raises(ValueError) as child:
        load_tokenizer(empty, child=TokenizerChild(empty))
    assert str(child.value) == str(here.value)


def test_a_child_that_cannot_start_leaves_the_load_to_this_process(tiny_model_dir, monkeypatch, caplog):
    # a failure injected where nothing real fails on this machine: an interpreter that is not there
    monkeypatch.setattr(engine.tokenizer.sys, "executable", "/nonexistent/python")
    with caplog.at_level(logging.WARNING, logger="engine.tokenizer"):
        tokenizer = load_tokenizer(tiny_model_dir, chat_template="{{ 'custom' }}",
                                   child=TokenizerChild(tiny_model_dir))
    assert "the child process could not load it" in caplog.text
    assert tokenizer.chat_template == "{{ 'custom' }}"
    assert tokenizer(TEXT)["input_ids"] == AutoTokenizer.from_pretrained(tiny_model_dir)(TEXT)["input_ids"]


def test_a_fresh_process_loads_in_the_child_and_never_imports_autotokenizer(tiny_model_dir):
    """What the child is for, shown by what gets imported (not by timing): in a fresh interpreter, the load from a
    child gives the ids AutoTokenizer gives and leaves AutoTokenizer's module unimported."""
    code = ("import sys, torch; from engine.tokenizer import TokenizerChild, load_tokenizer; "
            f"t = load_tokenizer({tiny_model_dir!r}, child=TokenizerChild({tiny_model_dir!r})); "
            f"print(t({TEXT!r})['input_ids']); print('transformers.models.auto.tokenization_auto' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                          text=True, timeout=300, check=True)
    expected = str(AutoTokenizer.from_pretrained(tiny_model_dir)(TEXT)["input_ids"])
    assert done.stdout.strip().splitlines()[-2:] == [expected, "False"], done.stdout + done.stderr


@pytest.fixture
def children(monkeypatch) -> list[TokenizerChild]:
    """Every TokenizerChild started while the test runs (real ones, recorded)."""
    started, real_init = [], TokenizerChild.__init__

    def init(self, path):
        real_init(self, path)
        started.append(self)

    monkeypatch.setattr(TokenizerChild, "__init__", init)
    return started


def test_a_gpu_engine_takes_its_tokenizer_from_a_child_started_before_its_imports(tiny_model_dir, monkeypatch,
                                                                                  children):
    def executor_class(config):  # the imports phase begins here
        assert children, "the imports began before the tokenizer's child process started"
        return pick_executor(config)

    assert not engine.llm_engine._expects_gpu(EngineArgs(model=tiny_model_dir, device="cpu").create_engine_config())
    # the engine as on a GPU, with the model itself on the CPU (no GPU here)
    monkeypatch.setattr(engine.llm_engine, "_expects_gpu", lambda config: True)
    llm = LLMEngine(EngineArgs(model=tiny_model_dir, device="cpu", num_kv_blocks=32).create_engine_config(),
                    executor_class)
    try:
        assert len(children) == 1 and children[0]._process.returncode == 0  # the child ran to its end
        assert llm.tokenizer(TEXT)["input_ids"] == AutoTokenizer.from_pretrained(tiny_model_dir)(TEXT)["input_ids"]
        llm.add_request("r", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        deltas = []
        while llm.has_unfinished_requests():
            deltas += llm.step()
        assert sum(d.num_new_tokens for d in deltas) == 4 and "".join(s.text for d in deltas for s in d.seqs)
    finally:
        llm.shutdown()


def test_a_start_up_that_fails_in_its_imports_ends_the_child(tiny_model_dir, monkeypatch, children):
    def executor_class(config):
        raise RuntimeError("the kernels failed to import")  # injected: nothing here fails to import for real

    monkeypatch.setattr(engine.llm_engine, "_expects_gpu", lambda config: True)
    with pytest.raises(RuntimeError, match="failed to import"):
        LLMEngine(EngineArgs(model=tiny_model_dir, device="cpu", num_kv_blocks=32).create_engine_config(),
                  executor_class)
    # killed while it was still importing (its imports take seconds), not left blocked on a pipe nobody reads
    assert len(children) == 1 and children[0]._process.returncode == -signal.SIGKILL
