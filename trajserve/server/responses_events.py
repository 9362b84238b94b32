"""The Responses API's stream (server/responses.py): the chat endpoint's
stream chunks as the Responses API's server-sent events."""
from __future__ import annotations

from collections.abc import AsyncIterator

from trajserve.server.responses import Shell, call_item, message_item, reasoning_item, status_of
from trajserve.server.tap import Tap, sse_event


async def events(chunks: AsyncIterator[dict], tap: Tap, shell: Shell, done=None) -> AsyncIterator[str]:
    """The chat stream's chunks (one choice) as the Responses API's events:
    response.created / in_progress, then per output item its added / delta /
    done events (reasoning text and text as they come; a call whole: its
    arguments as one delta), then response.completed or
    response.incomplete. done(response) is called with the final response
    (to store it)."""
    seq = 0

    def event(kind: str, data: dict) -> str:
        nonlocal seq
        seq += 1
        return sse_event(kind, {"sequence_number": seq - 1, **data})

    yield event("response.created", {"response": shell.response("in_progress", [])})
    yield event("response.in_progress", {"response": shell.response("in_progress", [])})
    output: list[dict] = []
    text_item: dict | None = None  # the message item text is streaming into
    thought: dict | None = None  # the reasoning item reasoning text is streaming into

    def close_thought():
        item, idx = thought, output.index(thought)
        item["status"] = "completed"
        return [event("response.reasoning_text.done", {"item_id": item["id"], "output_index": idx,
                                                       "content_index": 0, "text": item["content"][0]["text"]}),
                event("response.output_item.done", {"output_index": idx, "item": item})]

    def close_text():
        item, idx = text_item, len(output) - 1
        text = item["content"][0]["text"]
        part = {"type": "output_text", "text": text, "annotations": []}
        item["status"] = "completed"
        return [event("response.output_text.done", {"item_id": item["id"], "output_index": idx, "content_index": 0,
                                                    "text": text, "logprobs": []}),
                event("response.content_part.done", {"item_id": item["id"], "output_index": idx,
                                                     "content_index": 0, "part": part}),
                event("response.output_item.done", {"output_index": idx, "item": item})]

    async for chunk in chunks:
        if not chunk["choices"]:
            continue
        delta = chunk["choices"][0]["delta"]
        if delta.get("reasoning_content") and (thought is None or thought["status"] != "in_progress"):
            if text_item is not None and text_item["status"] == "in_progress":
                for e in close_text():
                    yield e
            thought = reasoning_item("", "in_progress")
            output.append(thought)
            yield event("response.output_item.added", {"output_index": len(output) - 1,
                                                       "item": {**thought, "content": []}})
        if delta.get("reasoning_content"):
            thought["content"][0]["text"] += delta["reasoning_content"]
            yield event("response.reasoning_text.delta", {"item_id": thought["id"], "output_index": len(output) - 1,
                                                          "content_index": 0, "delta": delta["reasoning_content"]})
        if (delta.get("content") or delta.get("tool_calls")) and thought is not None \
                and thought["status"] == "in_progress":
            for e in close_thought():
                yield e
        if delta.get("content"):
            if text_item is None:
                text_item = message_item("", "in_progress")
                output.append(text_item)
                idx = len(output) - 1
                yield event("response.output_item.added", {"output_index": idx,
                                                           "item": {**text_item, "content": []}})
                yield event("response.content_part.added", {
                    "item_id": text_item["id"], "output_index": idx, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []}})
            text_item["content"][0]["text"] += delta["content"]
            yield event("response.output_text.delta", {"item_id": text_item["id"], "output_index": len(output) - 1,
                                                       "content_index": 0, "delta": delta["content"],
                                                       "logprobs": []})
        for call in delta.get("tool_calls") or []:
            if text_item is not None and text_item["status"] == "in_progress":
                for e in close_text():
                    yield e
            item = call_item(call, "in_progress", shell)
            output.append(item)
            idx = len(output) - 1
            # The call streams whole: its arguments (a custom tool's input) as one delta.
            kind, field = (("function_call_arguments", "arguments") if item["type"] == "function_call"
                           else ("custom_tool_call_input", "input"))
            yield event("response.output_item.added", {"output_index": idx, "item": {**item, field: ""}})
            yield event(f"response.{kind}.delta", {"item_id": item["id"], "output_index": idx,
                                                   "delta": item[field]})
            yield event(f"response.{kind}.done", {"item_id": item["id"], "output_index": idx, field: item[field]})
            if "status" in item:
                item["status"] = "completed"
            yield event("response.output_item.done", {"output_index": idx, "item": item})
    final = tap.last
    if final is None or not final.finished:
        return  # the client went away
    if text_item is not None and text_item["status"] == "in_progress":
        for e in close_text():
            yield e
    if thought is not None and thought["status"] == "in_progress":
        for e in close_thought():
            yield e
    status = status_of(final)
    resp = shell.response(status, output, final)
    if done is not None:
        done(resp)
    yield event("response.completed" if status == "completed" else "response.incomplete", {"response": resp})
