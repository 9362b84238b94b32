"""What the engine hands back: one RequestOutput per request, with one
CompletionOutput per sampled sequence (n > 1 gives several)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string hit
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    # What this step added (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    ttft: float | None = None
    inter_token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    # Speculative decoding: draft tokens verified for this request, and how
    # many of them the target accepted (each an output token of one step).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token, (its logprob, top-k
    # {token: logprob}, its rank); the first token's is None (nothing precedes it).
    prompt_logprobs: list[tuple[float, dict[int, float], int] | None] | None = None
