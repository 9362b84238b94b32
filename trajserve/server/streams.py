"""A request's outputs on their way to the client: the last one, several
requests' merged as they arrive, and the server-sent event streams (an error
after the headers went out is an event too)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from trajserve.outputs import RequestOutput
from trajserve.server.async_engine import EngineDead, StepFailed


async def last(outs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    final = None
    async for out in outs:
        final = out
    return final if final is not None and final.finished else None


def event_stream(events: AsyncIterator[str], error_event) -> StreamingResponse:
    """Server-sent events; a request that fails after the headers went out
    (its step raised, the engine stopped) ends with error_event(message)."""
    async def body():
        try:
            async for event in events:
                yield event
        except (StepFailed, EngineDead) as e:
            yield error_event(str(e))
    return StreamingResponse(body(), media_type="text/event-stream")


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """OpenAI's stream: data lines, [DONE]; an error is a data line too (as vLLM)."""
    async def lines():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def error(message: str) -> str:
        body = {"message": message, "type": "server_error", "param": None, "code": None}
        return f"data: {json.dumps({'error': body})}\n\ndata: [DONE]\n\n"
    return event_stream(lines(), error)


class Outputs:
    """A request's outputs, the first of which start() has awaited (None: the
    client left before it). aclose() aborts the request if it still runs."""

    def __init__(self, first: RequestOutput | None, gen: AsyncIterator[RequestOutput]) -> None:
        self._first, self._gen, self._done = first, gen, first is None

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
            return out
        if self._done:
            raise StopAsyncIteration
        return await anext(self._gen)

    async def aclose(self) -> None:
        self._done, self._first = True, None
        await self._gen.aclose()


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(i, output) from several requests' outputs as they arrive. Leaving
    early (the client went) cancels the readers, which aborts what still runs."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, outs) -> None:
        try:
            async for out in outs:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - the stream's reader raises it
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, outs)) for i, outs in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
