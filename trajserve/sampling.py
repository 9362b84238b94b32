"""SamplingParams: how one request turns logits into tokens, and when it stops."""
from __future__ import annotations

from dataclasses import dataclass, field

from trajserve.structured import StructuredOutput


SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as vLLM)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)
MAX_N = 128  # choices per request (OpenAI's limit): each is a sequence with its own KV tail
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # int64, as vLLM's API takes it


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 (or -1, vLLM's spelling) = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = off; k = chosen token + top-k alternatives
    # Per prompt token (from the second on): its logprob given the tokens
    # before it, + top-k alternatives (vLLM's prompt_logprobs). None = off.
    # Such a prompt is computed whole: cached blocks hold no logits.
    prompt_logprobs: int | None = None
    n: int = 1
    # Penalties on tokens already there (OpenAI and vLLM semantics): presence
    # subtracts once per token that appeared in the output, frequency once per
    # occurrence; repetition divides positive logits and multiplies negative
    # ones for tokens in the prompt or the output (1 = off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    structured: StructuredOutput | None = None  # JSON schema / object, regex, choice, grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        # Below SAMPLING_EPS, logits / temperature overflow float32 (inf - inf
        # = nan in the softmax); the limit of such a temperature is greedy.
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must change this request's logits before choosing."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def validate(self) -> None:
        """Raise ValueError naming the field and its allowed range (or type):
        whatever passes here cannot fail later inside a step, where it would
        stop the batch it runs in."""
        def number(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"{name} must be a number, got {v!r}")

        def integer(name: str, v) -> None:
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")

        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            number(name)
        for name in ("max_tokens", "top_k", "n"):
            integer(name, getattr(self, name))
        if self.seed is not None:
            integer("seed", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, getattr(self, name))
        if not isinstance(self.stop, list):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            integer("stop_token_ids", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {t}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature < float("inf")):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v!r}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        # The seed goes to torch.Generator.manual_seed, which takes 64 bits:
        # checked here, a bigger one would fail inside a step, for everyone.
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise ValueError(f"repetition_penalty must be in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not (-100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
