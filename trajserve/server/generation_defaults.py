"""Server-wide sampling defaults: `serve --override-generation-config JSON`.

As vLLM's option of that name: temperature, top_p, top_k and
repetition_penalty are what a request gets when it names none (a request's
own value always wins), and max_new_tokens caps every reply's length, a
request's larger max_tokens included (vLLM reads a generation config's
max_new_tokens as that server-wide cap; llama-server's --n-predict is the
same). Harnesses send no temperature (Claude Code, Codex), so the API's
default of 1.0 samples their replies; {"temperature": 0} makes them greedy
and repeatable, and {"max_new_tokens": 512} bounds a small model that would
otherwise write to the end of its context."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from trajserve.sampling import SamplingParams

FLAG = "--override-generation-config"


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> GenerationDefaults:
        """The flag's JSON object; ValueError naming the key and its limit."""
        if text is None or not text.strip():
            return cls()
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{FLAG} must be a JSON object: {e}") from None
        if not isinstance(given, dict):
            raise ValueError(f"{FLAG} must be a JSON object, got {type(given).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{FLAG}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
        cap = given.get("max_new_tokens")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"{FLAG}: max_new_tokens must be an integer >= 1, got {cap!r}")
        sampling = {k: v for k, v in given.items() if k != "max_new_tokens" and v is not None}
        try:  # the ranges a request's own values are held to
            SamplingParams(**sampling)
        except ValueError as e:
            raise ValueError(f"{FLAG}: {e}") from None
        return cls(**given)

    def value(self, name: str, requested, fallback):
        """A sampling field's value: the request's, else this default, else the API's."""
        if requested is not None:
            return requested
        mine = getattr(self, name)
        return fallback if mine is None else mine

    def cap(self, max_tokens: int) -> int:
        """max_tokens held to max_new_tokens."""
        return max_tokens if self.max_new_tokens is None else min(max_tokens, self.max_new_tokens)

    def describe(self) -> str | None:
        """The start-up line's words, or None when nothing is set."""
        set_ = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return ", ".join(f"{k}={v}" for k, v in set_.items()) or None


NONE = GenerationDefaults()
