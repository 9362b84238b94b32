"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Claude Code and other agents written for Anthropic's API speak this shape,
not OpenAI's. A request is translated into the chat request the server
already serves (same template, tool-call parsing, forced tool_choice,
sessions and prefix cache), and the reply back into a message or its stream
of events:

    system                       -> a system message first (a system message
                                    among the messages stays where it is)
    text blocks                  -> the message's content (joined by "\\n")
    assistant tool_use blocks    -> the assistant message's tool_calls
    user tool_result blocks      -> tool messages, in order
    thinking blocks              -> the assistant message's reasoning_content
                                    (a template that keeps thoughts before a
                                    tool call, gpt-oss's, writes them back)
    a last assistant message     -> a prefill: the reply continues it
    tools (name, input_schema)   -> function tools
    tool_choice auto/any/tool/none, disable_parallel_tool_use
                                 -> auto/required/named/none, parallel_tool_calls
    stop_sequences               -> stop
    output_config.format (a JSON schema)
                                 -> response_format json_schema (the reply is held to it)

    tools of Anthropic's types (server tools: web_search_..., code_execution_...;
    schema-less ones: bash_..., text_editor_...)
                                 -> left out of the prompt, named in the reply's
                                    `ignored_tools` and once in the log
    metadata.user_id             -> Claude Code's session in it names the
                                    conversation (server/conversations.py)
    thinking, cache_control (ephemeral, ttl 5m / 1h),
    anthropic-beta headers       -> accepted and checked; a reasoning model's
                                    thoughts (gpt-oss: server/harmony.py) come
                                    back as unsigned thinking blocks, the
                                    other models served here write none
    context_management edits     -> clear_tool_uses applied before the prompt
                                    renders (server/context_edits.py), said in
                                    the reply's context_management

Usage counts as Anthropic's does (server/cache_breakpoints.py): with
`cache_control` marks, reads and writes up to the last mark (split 5m / 1h)
and input past it; without, `cache_read_input_tokens` is every prompt token
the prefix cache served (every computed block is cached on its own).
Images and documents are refused by name: the models served here read text.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from trajserve.config import PRIORITY_RANGE
from trajserve.server.goodput import DEADLINE_MAX_MS
from trajserve.outputs import CompletionOutput, RequestOutput
from trajserve.server import cache_breakpoints
from trajserve.server.context_edits import ContextEdit
from trajserve.server.conversations import KEY_MAX, claude_code_session
from trajserve.server.protocol import ChatCompletionRequest, PauseTier
from trajserve.server.tap import Tap, sse_event

# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error"}


log = logging.getLogger("trajserve.server")
_said: set[str] = set()  # Anthropic-typed tools left out: said once


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class CacheControl(BaseModel):
    """A prompt-cache breakpoint: the prefix up to this block is cached for ttl."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Block(BaseModel):
    """One content block; which fields count depends on `type`."""
    model_config = ConfigDict(extra="ignore")
    type: str
    cache_control: CacheControl | None = None
    text: str | None = None
    id: str | None = None                         # tool_use
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None                # tool_result
    content: str | list[Block] | None = None
    is_error: StrictBool | None = None
    thinking: str | None = None                   # thinking


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # "system" mid-conversation: Claude Code sends one (beta mid-conversation-system).
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools have their own types
    cache_control: CacheControl | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024)  # Anthropic's minimum


class ContextManagement(BaseModel):
    model_config = ConfigDict(extra="ignore")
    edits: list[ContextEdit] | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")
    user_id: str | None = Field(default=None, max_length=KEY_MAX)


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: OutputFormat | None = None  # `effort` is accepted and has no meaning here


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    metadata: Metadata | None = None
    # trajserve extensions, as on the OpenAI endpoints
    cache_salt: str | None = None
    priority: StrictInt | None = Field(default=None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    deadline_ms: float | None = Field(default=None, gt=0, le=DEADLINE_MAX_MS, allow_inf_nan=False)
    session_id: str | None = None
    tool_wait_s: float | None = Field(default=None, ge=0)
    tool: str | None = None
    tool_decision: PauseTier | None = None

    def to_chat(self, **sampling) -> ChatCompletionRequest:
        """The same request as the chat endpoint reads it (ValueError naming
        the field for what cannot be translated)."""
        msgs = []
        if self.system:
            msgs.append({"role": "system", "content": _text(self.system, "system")})
        for i, m in enumerate(self.messages):
            _check_results_answer_uses(m, self.messages[i - 1] if i else None, f"messages.{i}.content")
            msgs.extend(_chat_messages(m, f"messages.{i}.content"))
        body = {"model": self.model, "messages": msgs, "cache_salt": self.cache_salt, "priority": self.priority,
                "deadline_ms": self.deadline_ms,
                "session_id": self.session_id, "tool_wait_s": self.tool_wait_s, "tool": self.tool,
                "tool_decision": self.tool_decision, **sampling}
        if self.ignored_tools and not _said:  # once; the types are the client's text, kept out of the log
            _said.add("said")
            log.info("messages: tools of Anthropic's own types left out of the prompt (they are not run here; "
                     "the reply names them in ignored_tools)")
        shown = [t for t in self.tools or [] if t.type in (None, "custom")]
        if shown:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description,
                "parameters": t.input_schema or {"type": "object", "properties": {}}}} for t in shown]
        tc = self.tool_choice
        if tc is not None:
            if tc.type == "tool" and not tc.name:
                raise ValueError("tool_choice of type tool needs a name")
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                tc.type, {"type": "function", "function": {"name": tc.name}})
            if tc.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.messages[-1].role == "assistant":  # a prefill: the reply goes on from it
            last = msgs[-1]
            if not last.get("content") and not last.get("tool_calls"):
                msgs.pop()  # an empty final assistant message: a reply from the start, as Anthropic's
            elif (last.get("content") or "") != (last.get("content") or "").rstrip():
                raise ValueError("final assistant content cannot end with trailing whitespace")
            else:
                body["continue_final_message"] = True
        req = ChatCompletionRequest.model_validate(body)
        sid = claude_code_session(self.metadata.user_id if self.metadata is not None else None)
        if sid is not None:
            req.name_conversation("metadata.user_id", sid)
        return req

    def cache_marks(self) -> list[tuple[int, str]]:
        """Its cache_control marks as (chat messages through the mark, ttl):
        a tool's or a system block's mark ends with the system message
        (server/cache_breakpoints.py)."""
        def ttl(blocks) -> str | None:
            found = [b.cache_control.ttl or "5m" for b in blocks if b.cache_control is not None]
            return ("1h" if "1h" in found else "5m") if found else None
        marks, n = [], 1 if self.system else 0
        for t in (ttl(self.tools or []), ttl(self.system if isinstance(self.system, list) else [])):
            if t is not None:
                marks.append((n, t))
        for m in self.messages:
            n += len(_chat_messages(m, ""))
            if not isinstance(m.content, str) and (t := ttl(m.content)) is not None:
                marks.append((n, t))
        return marks

    @property
    def ignored_tools(self) -> list[dict]:
        """Tools of Anthropic's own types, left out: {index, type}."""
        return [{"index": i, "type": t.type} for i, t in enumerate(self.tools or []) if t.type not in (None, "custom")]


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: StrictBool = False
    output_config: OutputConfig | None = None
    seed: int | None = None  # extension

    def to_chat(self) -> ChatCompletionRequest:
        fmt = self.output_config.format if self.output_config is not None else None
        return super().to_chat(max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
                               top_p=self.top_p, top_k=self.top_k, stream=self.stream, seed=self.seed,
                               stream_options={"include_usage": True} if self.stream else None,
                               response_format=None if fmt is None else {
                                   "type": "json_schema", "json_schema": {"schema": fmt.schema_}})


def _text(content: str | list[Block], where: str) -> str:
    """The text of a content field that may hold only text blocks."""
    if isinstance(content, str):
        return content
    parts = []
    for j, b in enumerate(content):
        if b.type != "text":
            raise ValueError(_unsupported(b.type, f"{where}.{j}"))
        parts.append(b.text or "")
    return "\n".join(parts)


def _unsupported(kind: str, where: str) -> str:
    if kind in ("image", "document"):
        return f"{where}: {kind} content is not supported; the models served here read text"
    return f"{where}: content block type {kind!r} is not supported here"


def _check_results_answer_uses(m: Message, prev: Message | None, where: str) -> None:
    """Each tool_result answers a tool_use of the message just before it, as
    Anthropic's API requires (its 400 names the stray id): a result for a
    call the model never made is the client's bug, not a prompt to render."""
    if isinstance(m.content, str):
        return
    used = {b.id for b in prev.content if b.type == "tool_use"} \
        if prev is not None and prev.role == "assistant" and not isinstance(prev.content, str) else set()
    for j, b in enumerate(m.content):
        if b.type == "tool_result" and b.tool_use_id not in used:
            raise ValueError(f"{where}.{j}: unexpected tool_use_id found in tool_result blocks: {b.tool_use_id}. "
                             "Each tool_result block must have a corresponding tool_use block in the previous "
                             "message.")


def _chat_messages(m: Message, where: str) -> list[dict]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "system":  # text only, as the top-level system
        return [{"role": "system", "content": _text(m.content, where)}]
    out, text = [], []
    if m.role == "assistant":
        calls, thoughts = [], []
        for j, b in enumerate(m.content):
            if b.type == "text":
                text.append(b.text or "")
            elif b.type == "thinking":
                thoughts.append(b.thinking or "")
            elif b.type == "tool_use":
                if not b.name:
                    raise ValueError(f"{where}.{j}: a tool_use block needs a name")
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {})}})
            elif b.type != "redacted_thinking":
                raise ValueError(_unsupported(b.type, f"{where}.{j}"))
        return [{"role": "assistant", "content": "\n".join(text) or None, "tool_calls": calls or None,
                 "reasoning_content": "".join(thoughts) or None}]
    for j, b in enumerate(m.content):
        if b.type == "text":
            text.append(b.text or "")
        elif b.type == "tool_result":
            if text:  # text before a result stays before it
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": _text(b.content or "", f"{where}.{j}.content")})
        else:
            raise ValueError(_unsupported(b.type, f"{where}.{j}"))
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


# ------------------------------------------------------------------ replies
def too_long(prompt_tokens: int, max_model_len: int, detail: str) -> str:
    """A prompt over the context in Anthropic's words: clients written for it
    (Claude Code) compact their history on a message that starts so."""
    limit = max_model_len - 1  # one token must be left to generate
    if prompt_tokens > limit:
        return f"prompt is too long: {prompt_tokens} tokens > {limit} maximum"
    return f"prompt is too long: {prompt_tokens} tokens; {detail}"  # it is the KV pool that is short


def usage(final: RequestOutput | None, output_tokens: int, marks: Callable[[list[int]], list] | None = None) -> dict:
    """Anthropic's usage fields (server/cache_breakpoints.py); marks: the
    request's cache_control marks' positions for its prompt ids."""
    prompt = list(final.prompt_token_ids) if final else []
    cached = final.num_cached_tokens if final else 0
    return cache_breakpoints.usage(len(prompt), cached, marks(prompt) if marks and prompt else [], output_tokens)


def stop_reason(c: CompletionOutput, called: bool, max_tokens: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished choice. A max_tokens
    larger than what the context leaves after the prompt is not an error
    here (Claude Code asks for 32,000 whatever the prompt): the reply runs
    to the end of the context and says so, as Anthropic's API does."""
    if called:
        return "tool_use", None
    if c.finish_reason == "length":
        return ("max_tokens" if len(c.token_ids) >= max_tokens else "model_context_window_exceeded"), None
    if isinstance(c.stop_reason, str) and c.finish_reason == "stop":
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}


def _thinking(text: str) -> dict:
    """A reasoning model's thoughts (server/harmony.py) as a thinking block;
    unsigned: nothing checks it when a client sends it back."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def message(final: RequestOutput, chat_message: dict, model: str, max_tokens: int, notes: dict | None = None,
            marks: Callable[[list[int]], list] | None = None) -> dict:
    """The reply as a message; chat_message: what the chat endpoint would
    return for the choice (content and tool_calls); notes: fields that say
    what the request asked and did not get (ignored_tools, tools_not_shown)."""
    c, msg = final.outputs[0], chat_message["message"]
    content = [_thinking(msg["reasoning_content"])] if msg.get("reasoning_content") else []
    content += [{"type": "text", "text": msg["content"]}] if msg["content"] else []
    calls = msg.get("tool_calls") or []
    content += [_tool_use(call) for call in calls]
    reason, seq = stop_reason(c, bool(calls), max_tokens)
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(final, len(c.token_ids), marks), **(notes or {})}


async def events(chunks: AsyncIterator[dict], tap: Tap, model: str, max_tokens: int,
                 notes: dict | None = None, marks: Callable[[list[int]], list] | None = None) -> AsyncIterator[str]:
    """The chat endpoint's stream chunks (one choice) as Anthropic's
    server-sent events: message_start, per block content_block_start /
    _delta / _stop (text as it comes; a tool call whole, its input as one
    input_json_delta), message_delta with the stop reason and usage,
    message_stop."""
    blocks, called, started = 0, False, False
    open_kind = None  # the block deltas go into: "thinking", "text", or None

    def open_block(kind: str | None) -> list[str]:
        """Events that end the open block unless it is of this kind, and start one that is."""
        nonlocal blocks, open_kind
        out = []
        if open_kind == kind:
            return out
        if open_kind is not None:
            out.append(sse_event("content_block_stop", {"index": blocks}))
            blocks += 1
        open_kind = kind
        if kind is not None:
            block = _thinking("") if kind == "thinking" else {"type": "text", "text": ""}
            out.append(sse_event("content_block_start", {"index": blocks, "content_block": block}))
        return out

    async for chunk in chunks:
        if not chunk["choices"]:
            continue
        if not started:  # the first output: the prompt has been computed, cached tokens are known
            started = True
            yield sse_event("message_start", {"message": {
                "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(tap.last, 0, marks),
                **(notes or {})}})
            yield sse_event("ping", {})
        delta = chunk["choices"][0]["delta"]
        if delta.get("reasoning_content"):
            for e in open_block("thinking"):
                yield e
            yield sse_event("content_block_delta", {"index": blocks, "delta": {"type": "thinking_delta",
                                                                           "thinking": delta["reasoning_content"]}})
        if delta.get("content"):
            for e in open_block("text"):
                yield e
            yield sse_event("content_block_delta", {"index": blocks, "delta": {"type": "text_delta",
                                                                           "text": delta["content"]}})
        for call in delta.get("tool_calls") or []:
            for e in open_block(None):
                yield e
            block = _tool_use(call)
            args = json.dumps(block["input"])
            yield sse_event("content_block_start", {"index": blocks, "content_block": {**block, "input": {}}})
            yield sse_event("content_block_delta", {"index": blocks, "delta": {"type": "input_json_delta",
                                                                           "partial_json": args}})
            yield sse_event("content_block_stop", {"index": blocks})
            blocks += 1
            called = True
    if not started or tap.last is None or not tap.last.finished:
        return  # the client went away, or the request ended without output
    for e in open_block(None):
        yield e
    c = tap.last.outputs[0]
    reason, seq = stop_reason(c, called, max_tokens)
    yield sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                  "usage": usage(tap.last, len(c.token_ids), marks)})
    yield sse_event("message_stop", {})
