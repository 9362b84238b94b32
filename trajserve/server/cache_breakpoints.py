"""Anthropic's prompt-cache breakpoints, as usage counts them.

A `cache_control` mark on a tool, a system block or a message's block asks
Anthropic's API to cache the prompt up to it (for 5 minutes, or an hour
with `ttl: "1h"`). Here every computed block is cached anyway (the radix
cache); a mark changes how usage is reported, as Anthropic defines it, and
the eviction order (below). With marks,

    cache_read_input_tokens       the prompt's tokens served from the cache, up to the last mark
    cache_creation_input_tokens   the tokens up to the last mark that were computed (written) now,
                                  split in cache_creation.ephemeral_1h_input_tokens (up to the
                                  last 1h mark) and ephemeral_5m_input_tokens (the rest)
    input_tokens                  the rest: every token past the last mark

and without marks, today's automatic count (every token served from the
cache is a read). A mark's token position is where the conversation up to
its message renders to (a mark on a tool or a system block: after the
system message). The prompt up to each mark is also retained for the mark's
ttl (ServerState.retain, kv/retention.py): every tier evicts it last.
"""
from __future__ import annotations

from collections.abc import Callable

from trajserve.server.prefix_break import common_prefix


def positions(marks: list[tuple[int, str]], render: Callable[[int], list[int]], prompt: list[int]
              ) -> list[tuple[int, str]]:
    """(token position, ttl) of each mark: marks as (messages through it,
    ttl); render(n): the ids the first n messages render to, as history."""
    out = []
    for n, ttl in marks:
        out.append((common_prefix(render(n), prompt) if n else 0, ttl))
    return out


def usage(prompt_tokens: int, cached: int, marks: list[tuple[int, str]], output_tokens: int) -> dict:
    """Anthropic's usage fields for a reply (marks: positions() of its marks)."""
    if not marks:
        return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output_tokens,
                "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}}
    last = max(p for p, _ in marks)
    last_1h = max((p for p, ttl in marks if ttl == "1h"), default=0)
    read = min(cached, last)
    written = max(0, last - cached)
    written_1h = min(written, max(0, last_1h - cached))
    return {"input_tokens": prompt_tokens - read - written, "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read, "output_tokens": output_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": written - written_1h,
                               "ephemeral_1h_input_tokens": written_1h}}
