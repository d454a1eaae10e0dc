"""`SamplingParams`: how to pick each next token and when to stop. Mirrors vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


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
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output token (the sampled token's is always returned)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (and the prompt token's own)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # Filled by the engine, never by users: every token id that ends the request (eos unless ignore_eos, plus
    # stop_token_ids). The worker needs them to enforce min_tokens.
    all_stop_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be greater than zero, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
               f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative token ids")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias", f"token id {token_id} is negative")
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"bias {bias} for token {token_id} not in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must lie in the vocabulary."""
        for token_id in list(self.logit_bias or {}) + list(self.stop_token_ids):
            _check(token_id < vocab_size, "logit_bias" if token_id in (self.logit_bias or {}) else "stop_token_ids",
                   f"token id {token_id} is out of the vocabulary (size {vocab_size})")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


# generation_config.json fields that become sampling defaults (vLLM's set, less max_new_tokens).
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling_overrides(model_config) -> dict:
    """The model's sampling defaults from its generation_config.json, field -> value, for the fields a request does
    not set (as vLLM applies them; `do_sample` is ignored, as vLLM does). `LLM.generate(sampling_params=None)` uses
    them; an HTTP layer overlays the request's own fields on them. Raises ValueError for a value SamplingParams
    rejects."""
    generation_config = getattr(model_config, "generation_config", None) or {}
    overrides = {name: generation_config[name] for name in GENERATION_CONFIG_FIELDS
                 if generation_config.get(name) is not None}
    try:
        SamplingParams(**overrides)
    except ValueError as e:
        raise ValueError(f"generation_config.json of {model_config.model!r}: {e}") from None
    return overrides
