"""Structured output: sampling held to a JSON schema, any JSON object, a
regex, a list of choices or a grammar.

llguidance (the constraint engine vLLM, SGLang and llama.cpp use) compiles
the constraint against the tokenizer and, before each token, says which
tokens keep the output inside it; the sampler sets every other logit to
-inf before choosing (greedy or random alike) and then advances the matcher
with the token chosen. When the constraint is complete, only end-of-text is
allowed, so the reply ends there (or, with ignore_eos, the request stops).

`StructuredOutput` is the request's side (it imports nothing heavy:
`trajserve plan` imports SamplingParams); `GrammarCompiler` is the engine's,
made once per engine (~0.5 s to index a 49k-token vocabulary, on first
use); the mask is applied in model/sampler.py.
"""
from __future__ import annotations

import json as _json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Exactly one of: a JSON schema (dict or its JSON text), any JSON object,
    a regex, a list of choices, or a Lark grammar (llguidance's dialect,
    which can embed JSON schemas with %json)."""
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured output takes exactly one of json_schema, json_object, regex, choice, "
                             f"grammar; got {', '.join(kinds) or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c
                                                               for c in self.choice)):
            raise ValueError("structured output choice must be a non-empty list of non-empty strings")
        if isinstance(self.json_schema, str):
            try:
                _json.loads(self.json_schema)
            except _json.JSONDecodeError as e:
                raise ValueError(f"structured output json_schema is not valid JSON: {e}") from None

    def to_grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        from llguidance import LLMatcher

        if self.json_schema is not None:
            schema = _json.loads(self.json_schema) if isinstance(self.json_schema, str) else self.json_schema
            return LLMatcher.grammar_from_json_schema(closed_objects(schema))
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # Lark string literals take JSON's quoting
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


# Keywords whose value maps names to schemas, and keywords whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema):
    """The schema with `additionalProperties: false` on every object schema
    that lists its properties and says nothing about others: what xgrammar's
    strict mode (vLLM's default backend) enforces. By JSON Schema's default
    a small model fills a reply or a tool call's arguments with invented
    keys until max_tokens (SmolLM2: "unit_description_type_name", ...). A
    schema that opens its objects (`additionalProperties: true` or a schema)
    keeps them open; allOf branches are left as written (closing each would
    leave no object that fits them all)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: closed_objects(s) for name, s in v.items()}
        elif k in _DATA or k == "allOf":
            out[k] = v
        else:
            out[k] = closed_objects(v)
    if isinstance(schema.get("properties"), dict) and not any(k in schema for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


class GrammarCompiler:
    """Compiles constraints into matchers for one tokenizer and vocabulary.

    Compiled grammars are kept (LRU, by grammar text): an agent sends the same
    schema turn after turn, and a new request then gets a copy of the compiled
    matcher instead of a compile (milliseconds to a second for a large
    schema). Thread-safe, so the server can compile off the engine thread
    (`LLMEngine.prepare_structured`) and the engine thread only copies."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64) -> None:
        self._tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._lltok = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = self.cache_hits = 0

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher (llguidance.LLMatcher) at the start of the output;
        ValueError naming the problem for a constraint that does not compile."""
        return self.compile(spec).deep_copy()

    def compile(self, spec: StructuredOutput) -> Any:
        """The kept, compiled matcher for spec (compiled now if it is not
        kept): copy it, never advance it."""
        import llguidance

        grammar = spec.to_grammar()
        with self._lock:
            if self._lltok is None:  # indexes the vocabulary once (~0.5 s for 49k tokens)
                self._lltok = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=sorted(self._tokenizer.eos_token_ids))
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                self.cache_hits += 1
                return cached
        m = llguidance.LLMatcher(self._lltok, grammar, log_level=0)  # outside the lock: it may take a while
        if m.is_error():
            raise ValueError(f"structured output does not compile: {m.get_error()}")
        with self._lock:
            self.compiled += 1
            self._cache[grammar] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m
