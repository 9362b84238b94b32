"""Tap: a request's outputs passed through, the latest kept.

The APIs translated from the chat path (/v1/messages, /v1/responses) build
their events from the chat stream's chunks, but also need what the chunks
do not carry: the prompt, the tokens the prefix cache served and why the
reply stopped."""
from __future__ import annotations

from collections.abc import AsyncIterator

from trajserve.outputs import RequestOutput


class Tap:
    """Iterates over `outs`; `last` is the latest output seen."""
    def __init__(self, outs: AsyncIterator[RequestOutput]) -> None:
        self.outs, self.last = outs, None

    async def __aiter__(self):
        async for out in self.outs:
            self.last = out
            yield out
