"""`SamplingParams`: how to pick each next token and when to stop. Mirrors vLLM's names and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import ParamError, quoted
from engine.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 1024
MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 64
# Positive logits are divided by the repetition penalty and negative ones multiplied: within this range the result
# stays finite in float32 at any temperature (1e-40 made every penalized logit inf, and the row sampled token 0).
REPETITION_PENALTY_RANGE = (1e-4, 1e4)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a string or None is taken too: __post_init__ makes a list
    stop_token_ids: list[int] = field(default_factory=list)  # None is taken too
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output token (the sampled token's is always returned)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (and the prompt token's own)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled (vLLM's); None: any
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as fit); None: all
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a JSON schema, regex, choice or grammar to follow
    # Filled by the engine, never by users: every token id that ends the request (eos unless ignore_eos, plus
    # stop_token_ids). The worker needs them to enforce min_tokens.
    all_stop_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        try:
            self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        except (TypeError, ValueError):
            raise ParamError("stop_token_ids", f"must be integers, got {quoted(self.stop_token_ids)}") from None
        if self.allowed_token_ids is not None:
            try:
                self.allowed_token_ids = sorted({int(t) for t in self.allowed_token_ids})
            except (TypeError, ValueError):
                raise ParamError("allowed_token_ids", "must be token ids") from None
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ParamError("logit_bias", "keys must be token ids and values numbers") from None
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raises ParamError naming the first invalid field. Every number is range-checked, so that no value that
        passes can overflow the sampler (one bad request must not fail the batch it runs in)."""
        _check_int(self.n, "n", 1, MAX_N)
        _check_float(self.temperature, "temperature", 0.0, 1e4)
        _check(0.0 < _finite(self.top_p, "top_p") <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int(self.top_k, "top_k", 0, 2**31 - 1, "must be -1 (disable), 0 (disable) or at least 1")
        _check_float(self.min_p, "min_p", 0.0, 1.0)
        _check_float(self.repetition_penalty, "repetition_penalty", *REPETITION_PENALTY_RANGE)
        _check_float(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check_float(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", 1, 2**31 - 1)
        _check_int(self.min_tokens, "min_tokens", 0, 2**31 - 1)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"takes at most {MAX_STOP_STRINGS} strings")
        if self.prompt_logprobs is not None:
            _check_int(self.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        for token_id in self.stop_token_ids:
            _check_int(token_id, "stop_token_ids", 0, 2**31 - 1, "must be non-negative token ids")
        if self.seed is not None:
            _check_int(self.seed, "seed", -MAX_SEED, MAX_SEED)
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias", f"token id {token_id} is negative")
            _check(-100.0 <= _finite(bias, "logit_bias") <= 100.0, "logit_bias",
                   f"bias {bias} for token {token_id} not in [-100, 100]")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty")
            _check(self.allowed_token_ids[0] >= 0, "allowed_token_ids", "must be non-negative token ids")
        if self.truncate_prompt_tokens is not None:
            _check_int(self.truncate_prompt_tokens, "truncate_prompt_tokens", -1, 2**31 - 1)
            _check(self.truncate_prompt_tokens != 0, "truncate_prompt_tokens",
                   "must be -1 (as many as the context holds) or at least 1, got 0")
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   "must be a StructuredOutputsParams")
            _check(self.allowed_token_ids is None, "allowed_token_ids", "cannot be combined with a structured-output "
                   "constraint: the grammar chooses the tokens (where none of them is allowed, nothing could follow)")
            self.structured_outputs.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must lie in the vocabulary."""
        for token_id in self.logit_bias or {}:
            _check(token_id < vocab_size, "logit_bias", f"token id {token_id} is out of the vocabulary "
                                                        f"(size {vocab_size})")
        for token_id in self.stop_token_ids:
            _check(token_id < vocab_size, "stop_token_ids", f"token id {token_id} is out of the vocabulary "
                                                            f"(size {vocab_size})")
        if self.allowed_token_ids:
            _check(self.allowed_token_ids[-1] < vocab_size, "allowed_token_ids",
                   f"token id {self.allowed_token_ids[-1]} is out of the vocabulary (size {vocab_size})")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ParamError(name, message)


def _finite(value, name: str) -> float:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
           f"must be a finite number, got {quoted(value)}")
    return float(value)


def _check_float(value, name: str, low: float, high: float) -> None:
    _check(low <= _finite(value, name) <= high, name, f"must be in [{low:g}, {high:g}], got {value}")


def _check_int(value, name: str, low: int, high: int, what: str | None = None) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {quoted(value)}")
    _check(low <= value <= high, name, f"{what or f'must be in [{low}, {high}]'}, got {value}")


# generation_config.json fields that become sampling defaults (vLLM's set, less max_new_tokens).
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling_overrides(model_config) -> dict:
    """The model's sampling defaults from its generation_config.json, field -> value, for the fields a request does
    not set (as vLLM applies them; `do_sample` is ignored, as vLLM does). `LLM.generate(sampling_params=None)` uses
    them; the HTTP layer overlays the request's own fields on them. Raises ParamError for a value SamplingParams
    rejects."""
    generation_config = getattr(model_config, "generation_config", None) or {}
    overrides = {name: generation_config[name] for name in GENERATION_CONFIG_FIELDS
                 if generation_config.get(name) is not None}
    try:
        SamplingParams(**overrides)
    except ParamError as e:
        raise ParamError("model", f"generation_config.json of {model_config.model!r}: {e}") from None
    return overrides
