"""Every family on a CUDA GPU with the Triton kernels (the fused MoE, windowed attention, Qwen3's head norms):
greedy tokens equal transformers' on the same GPU, eager and with CUDA graphs, in float32."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from checkpoints.tiny import TINY_ARCHES, make_tiny_model  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. A language model reads a prompt",
           "def fibonacci(n: int) -> list[int]:", "Once upon a time there was a small model that wanted to learn."]
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    """The families, and Mistral with an 8-token window (every prompt and generation runs past it)."""
    windowed = make_tiny_model(str(tmp_path_factory.mktemp("windowed")), "mistral", seed=9,
                               config_overrides={"sliding_window": 8})
    return {**tiny_checkpoints, "mistral_window_8": windowed}


def hf_greedy(path: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)], device="cuda")
        seq = model.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("arch", [*TINY_ARCHES, "mistral_window_8"])
def test_gpu_family_greedy_parity(checkpoints, arch):
    torch.backends.cuda.matmul.allow_tf32 = False
    expected = hf_greedy(checkpoints[arch])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    for enforce_eager in (True, False):
        llm = LLM(model=checkpoints[arch], dtype="float32", device="cuda", block_size=16, num_kv_blocks=256,
                  enforce_eager=enforce_eager)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.engine.check_integrity()
        llm.shutdown()
        assert got == expected, f"enforce_eager={enforce_eager}"
