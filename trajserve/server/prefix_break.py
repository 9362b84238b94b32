"""Why a conversation's turn missed the prefix cache: prefix-break diagnosis.

Spec: kv-cache-management section 3 (what breaks prefix hits: volatile
leading fields, a tool list that changes mid-trajectory, non-deterministic
serialization, compaction) and eq. 2 (H_prefix, per trajectory here). A
turn's prompt should begin with the previous turn's context (its prompt and
reply): where it first differs, every later token is prefilled again. For
each turn of a session (explicit or inferred, server/conversations.py) the
server compares the two and names the break:

    turn             the turn's index in its session, from 0
    position         the first token where the prompt leaves the previous context
    lost_tokens      the tokens past it that the cache held and must be computed again
    cause            volatile_field   a date, time, id or hash early in the prompt changed
                     tools_changed    the tool list changed (added, removed, edited)
                     reserialized     the same tools or content in another order or spelling
                     compaction       the history was shortened (summarised or truncated)
                     system_prompt    the system prompt changed otherwise
                     other
    excerpts         a few tokens each side of the break, from both prompts

A prompt that keeps the previous prompt whole but re-encodes the reply
differently (a reply's tokens need not be its text's canonical encoding)
is not a break. Excerpts hold client text: they go to that client (its
reply's `prefix_break`, its session's record) and to no log.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

CAUSES = ("volatile_field", "tools_changed", "reserialized", "compaction", "system_prompt", "other")
EXCERPT_TOKENS = 12  # each side of the break
EXCERPT_CHARS = 120
_WINDOW = 64  # tokens compared as a multiset to tell a reordering from an edit
# What changes between two requests without the content changing: dates,
# clock times, UUIDs, hex digests, long numbers (timestamps, request ids).
_VOLATILE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-|"
                       r"\b[0-9a-fA-F]{8,}\b|\d{5,}")


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


@dataclass(frozen=True)
class TurnShape:
    """What a turn's prompt was made of (digests and counts, no text):
    enough to name the cause of the next turn's break."""
    prompt_tokens: int
    messages: int
    system: str           # digest of the first system message's text
    tools_as_sent: str    # digest of the tools in the client's own key order
    tools: str            # digest of the tools with keys sorted: what they mean

    @classmethod
    def of(cls, prompt_tokens: int, messages: Sequence, tools: list[dict] | None) -> TurnShape:
        """messages: dicts, or the request's ChatMessages (only the first is read)."""
        first = messages[0] if messages else {}
        if not isinstance(first, dict):
            first = first.model_dump(exclude_none=True)
        system = first.get("content") if first.get("role") in ("system", "developer") else ""
        return cls(prompt_tokens, len(messages), _digest(json.dumps(system, sort_keys=True)),
                   _digest(json.dumps(tools or [])), _digest(json.dumps(tools or [], sort_keys=True)))


@dataclass(frozen=True)
class PrefixBreak:
    turn: int
    position: int
    lost_tokens: int
    cause: str
    previous: str  # the previous context around the break
    now: str       # this prompt around the break

    def as_dict(self) -> dict:
        return asdict(self)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def diagnose(turn: int, context: list[int], before: TurnShape, prompt: list[int], now: TurnShape,
             decode: Callable[[list[int]], str]) -> PrefixBreak | None:
    """The break of this turn's prompt against the previous turn's context
    (its prompt, before.prompt_tokens long, then its reply), or None."""
    p = common_prefix(context, prompt)
    if p >= min(before.prompt_tokens, len(prompt)):
        return None  # the previous prompt kept whole (or this prompt is all of what it shares)
    lost = min(len(context), len(prompt)) - p
    cause = _cause(context, prompt, p, before, now, decode)

    def excerpt(ids: list[int]) -> str:
        return decode(ids[max(0, p - EXCERPT_TOKENS):p + EXCERPT_TOKENS])[:EXCERPT_CHARS]
    return PrefixBreak(turn, p, lost, cause, excerpt(context), excerpt(prompt))


def _cause(context: list[int], prompt: list[int], p: int, before: TurnShape, now: TurnShape,
           decode: Callable[[list[int]], str]) -> str:
    if now.messages < before.messages:
        return "compaction"
    if now.tools != before.tools:
        return "tools_changed"
    if now.tools_as_sent != before.tools_as_sent:
        return "reserialized"
    # A field that changes on its own (a date in the system prompt): both
    # sides of the break hold one where they part.
    a, b = decode(context[max(0, p - 4):p + 8]), decode(prompt[max(0, p - 4):p + 8])
    if _VOLATILE.search(a) and _VOLATILE.search(b):
        return "volatile_field"
    if now.system != before.system:
        return "system_prompt"
    if sorted(context[p:p + _WINDOW]) == sorted(prompt[p:p + _WINDOW]):
        return "reserialized"
    return "other"
