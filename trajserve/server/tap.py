"""What the APIs translated from the chat path (/v1/messages,
/v1/responses) share: Tap, and their server-sent event lines.

They build their events from the chat stream's chunks, but also need what
the chunks do not carry: the prompt, the tokens the prefix cache served and
why the reply stopped. Tap keeps the latest engine output for that."""
from __future__ import annotations

import json
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


def sse_event(name: str, data: dict) -> str:
    """One named server-sent event; data carries `type: name` first, as both APIs send it."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"
