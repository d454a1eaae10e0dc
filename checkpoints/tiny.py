"""A tiny, deterministic Hugging Face checkpoint for first runs and tests: random weights, a real tokenizer.

`make_tiny_model(path, arch)` writes `config.json`, `model.safetensors`, `generation_config.json`,
`tokenizer.json` and `tokenizer_config.json` (with a ChatML-style chat template). The weights come from a fixed
seed and the byte-level BPE tokenizer is trained on the short corpus below, which ships inside this file so the
checkpoint is the same on every machine and Python version. `default_tiny_model_path()` builds the Llama one once
into a cache directory and returns its path.
"""

from __future__ import annotations

import json
import os

import torch

from checkpoints.source import build_once, cache_root

TINY_MODEL_NAME = "tiny-llama-v1"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
BOS, EOS, IM_START, IM_END, PAD = SPECIAL_TOKENS
TARGET_VOCAB_SIZE = 1000

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads a prompt and writes one token at a time.
Each new token depends on every token before it, so the model keeps the keys and values of past tokens in a cache.
The cache is split into blocks of a fixed size; a block table maps the positions of a sequence to its blocks.
When memory runs out, the newest request is preempted, its blocks are freed, and it is computed again later.
A scheduler fills every step with decode tokens first and then with chunks of waiting prompts.
Tensor parallelism splits each weight matrix across several devices; an all-reduce sums the partial results.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Once upon a time there was a small model that wanted to learn. It read books about the sea, the stars and the
mountains. It counted numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
The months are January, February, March, April, May, June, July, August, September, October, November, December.
Colors: red, orange, yellow, green, blue, indigo, violet, black, white, gray, brown and pink.
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.
Complex is better than complicated. Flat is better than nested. Sparse is better than dense.
Readability counts. Special cases are not special enough to break the rules. Although practicality beats purity.
Errors should never pass silently, unless explicitly silenced. In the face of ambiguity, refuse the temptation
to guess. There should be one, and preferably only one, obvious way to do it. Now is better than never.
If the implementation is hard to explain, it is a bad idea. If it is easy to explain, it may be a good idea.
Namespaces are one honking great idea, let us do more of those!
The user asked a question and the assistant answered it politely, clearly and with care.
Please summarize the following text in one sentence. Translate this sentence into French.
Write a short poem about the ocean. The waves rise and fall under the silver light of the moon.
Water boils at one hundred degrees Celsius at sea level. The earth goes around the sun once a year.
Music, science, history, mathematics, physics, chemistry, biology, geography, literature and art.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


class Request:
    def __init__(self, request_id: str, prompt: str, max_tokens: int = 16):
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output_tokens = []

    def is_finished(self) -> bool:
        return len(self.output_tokens) >= self.max_tokens


for index, value in enumerate(range(10)):
    if value % 2 == 0:
        print(f"{index}: {value} is even")
    else:
        print(f"{index}: {value} is odd")

import json, os, sys
with open(os.path.join("data", "config.json")) as file:
    config = json.load(file)
{"model": "tiny", "temperature": 0.7, "top_p": 0.9, "max_tokens": 128, "stream": true, "messages": []}
0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 2.71828 -1 +1 = == != <= >= ( ) [ ] { } < > ; : , . ! ?
"""


def train_tokenizer():
    """A byte-level BPE trained on `_CORPUS`: deterministic (same corpus and settings, same merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TARGET_VOCAB_SIZE, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tokenizer


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


_TINY_HEAD_DIM = 16  # hidden 64 over 4 heads (Qwen3's configs default to 128)
_SHORT_FACTORS = [1.0 + 0.1 * i for i in range(_TINY_HEAD_DIM // 2)]
_LONG_FACTORS = [1.0 + 0.7 * i for i in range(_TINY_HEAD_DIM // 2)]

# arch -> (transformers config class name, architecture, fields beyond the common ones). Small: a few experts of
# 32-128 rows, one dense layer where the family has them.
TINY_ARCHES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": _TINY_HEAD_DIM}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        # longrope over the whole trained length: the short factors, as transformers takes them up to 2048 tokens
        "original_max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "longrope", "short_factor": _SHORT_FACTORS, "long_factor": _LONG_FACTORS,
                            "rope_theta": 10000.0}}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": _TINY_HEAD_DIM, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": [0]}),
    # MLA with a q LoRA (DeepSeek-V2's; V2-Lite has none), a dense first layer, then 8 experts in 4 groups, the best
    # 2 groups' 4 experts competing for 3 a token, plus 2 shared experts; num_key_value_heads = the heads, as in
    # DeepSeek's configs (transformers' attention would repeat the expanded K/V otherwise)
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 2,
        "moe_intermediate_size": 32, "num_experts_per_tok": 3, "topk_method": "group_limited_greedy", "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 1.5, "first_k_dense_replace": 1}),
}


def _hf_config(arch: str, vocab_size: int, special_ids: dict[str, int], overrides: dict):
    import transformers

    if arch not in TINY_ARCHES:
        raise ValueError(f"arch must be one of {sorted(TINY_ARCHES)}, got {arch!r}")
    config_class, architecture, fields = TINY_ARCHES[arch]
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=2048, vocab_size=vocab_size,
                  initializer_range=0.3, rms_norm_eps=1e-6, bos_token_id=special_ids[BOS],
                  eos_token_id=[special_ids[EOS], special_ids[IM_END]], pad_token_id=special_ids[PAD],
                  dtype="float32")
    return getattr(transformers, config_class)(**{**common, "architectures": [architecture], **fields, **overrides})


@torch.no_grad()
def _fill_random(model, std: float, seed: int) -> None:
    """Every tensor from one seeded generator, in sorted-name order (independent of transformers' own init)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)  # near 1, but not 1: a wrongly loaded norm would show
        else:
            param.copy_(std * noise)


def make_tiny_model(path: str, arch: str = "llama", seed: int = 0, config_overrides: dict | None = None,
                    max_shard_size: str | None = None) -> str:
    """Writes a tiny checkpoint of `arch` (a TINY_ARCHES key; hidden 64, 2 layers, 4 heads, 2 KV heads) into
    `path`; returns it.

    `config_overrides` change config fields (e.g. `rope_parameters`); `max_shard_size` (e.g. "20KB") writes a
    sharded checkpoint with an index."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    tokenizer = train_tokenizer()
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = _hf_config(arch, tokenizer.get_vocab_size(), special_ids, dict(config_overrides or {}))
    torch_state = torch.random.get_rng_state()
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(torch_state)  # transformers' init draws from the global generator
    _fill_random(model, config.initializer_range, seed)
    _save_quietly(model, path, max_shard_size)

    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(_tokenizer_config(), f, indent=2, sort_keys=True)
    # Loading check: a real PreTrainedTokenizerFast must accept what was written.
    PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
    return path


def _save_quietly(model, path: str, max_shard_size: str | None) -> None:
    from transformers.utils import logging as hf_logging

    had_progress_bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    finally:
        if had_progress_bar:
            hf_logging.enable_progress_bar()


def default_tiny_model_path() -> str:
    """Builds the tiny Llama checkpoint once into `$PAGODA_CACHE/tiny-llama-v1` (default `~/.cache/pagoda`);
    safe when several processes race (`checkpoints.source.build_once`)."""
    return build_once(os.path.join(cache_root(), TINY_MODEL_NAME), lambda tmp: make_tiny_model(tmp, "llama", seed=0))
