"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}).

Codex CLI and the OpenAI Agents SDK speak this shape. As with /v1/messages,
a request is translated into the chat request the server already serves
(template, tool-call parsing, forced tool_choice, structured output,
sessions, prefix cache), and the reply back into a response or its stream
of events:

    instructions                 -> a system message first (not carried to
                                    the next response, as OpenAI's)
    input: text or items         -> messages: role items (input_text /
                                    output_text parts), function_call items
                                    -> the assistant's tool_calls,
                                    function_call_output -> tool messages;
                                    a reasoning item's text -> the reasoning
                                    of the calls after it (gpt-oss's template
                                    writes it back), else dropped
    previous_response_id         -> that response's conversation first (kept
                                    in memory while store is true, LRU)
    tools (type function)        -> function tools; tool_choice likewise
    tools (type namespace: a group of functions, Codex's)
                                 -> each function as `namespace.name`; its
                                    calls come back as function_call items
                                    with `name` and `namespace` (function_call
                                    input items with a namespace likewise)
    hosted tools (web_search, file_search, code_interpreter, ...)
                                 -> left out of the prompt (this server cannot
                                    run them), named in the response's
                                    `ignored_tools` and once in the log
    tools (type custom: freeform input, Codex's apply_patch)
                                 -> a function with one string argument,
                                    `input`; its calls come back as
                                    custom_tool_call items (custom_tool_call
                                    / _output input items likewise)
    text.format                  -> response_format (json_schema / json_object)
    max_output_tokens            -> max_tokens (a reply cut there is
                                    status "incomplete", reason max_output_tokens)
    prompt_cache_key, client_metadata.session_id
                                 -> the conversation a turn belongs to: it
                                    pauses and resumes as a session
                                    (server/conversations.py)
    store: false, include, reasoning, prompt_cache_retention,
    safety_identifier, user      -> accepted; a reasoning model's thoughts
                                    (gpt-oss: server/harmony.py) come back as
                                    a reasoning item with its raw text, the
                                    other models served here write none

A conversation continued by previous_response_id renders to the same tokens
it had, so the prefix cache serves it: only the new input is computed.
Images and files are refused by name: the models served here read text and
call the client's function and custom tools. A custom tool's grammar
(`format`) is not enforced on its input.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from trajserve.config import PRIORITY_RANGE
from trajserve.server.goodput import DEADLINE_MAX_MS
from trajserve.outputs import RequestOutput
from trajserve.server.conversations import KEY_MAX
from trajserve.server.hints import KvHints, NvExt
from trajserve.server.protocol import ChatCompletionRequest, PauseTier

log = logging.getLogger("trajserve.server")

STORE_LIMIT = 4096  # stored responses (oldest dropped first): previous_response_id reaches these


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's functions


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function", "custom"]
    name: str


# Custom (freeform) tools reach the model as a function with one string argument.
CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                     "additionalProperties": False}
CLIENT_TOOLS = ("function", "custom")  # what the model can call and the client runs
# OpenAI's hosted tool types, named in the log when left out (any other type
# is logged as "another type": no client string reaches the log).
HOSTED = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
          "image_generation", "mcp", "local_shell", "tool_search")
_said: set[str] = set()  # hosted tool types logged as left out (once each)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: StrictBool = True
    metadata: dict | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=KEY_MAX)
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    client_metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    user: str | None = None
    kv_hints: KvHints | None = None  # other engines' hint envelopes (server/hints.py)
    nvext: NvExt | None = None
    # extensions, as on the chat endpoint
    top_k: int | None = None
    seed: int | None = None
    cache_salt: str | None = None
    priority: StrictInt | None = Field(default=None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    deadline_ms: float | None = Field(default=None, gt=0, le=DEADLINE_MAX_MS, allow_inf_nan=False)
    session_id: str | None = None
    tool_wait_s: float | None = Field(default=None, ge=0)
    tool: str | None = None
    tool_decision: PauseTier | None = None

    def client_tools(self) -> tuple[list[tuple[str, FunctionTool]], list[dict]]:
        """The tools the model sees, as (name it calls, tool): functions and
        custom tools, a namespace's as `namespace.name`; and the hosted ones
        left out, as {index, type} (ValueError naming a malformed one)."""
        seen, shown, left_out = set(), [], []
        for i, t in enumerate(self.tools or []):
            if t.type == "namespace":
                if not t.name or not t.tools:
                    raise ValueError(f"tools.{i}: a namespace tool needs a name and tools")
                inner = [(f"{t.name}.{u.name}", u, f"tools.{i}.tools.{j}") for j, u in enumerate(t.tools)]
            elif t.type in CLIENT_TOOLS:
                inner = [(t.name, t, f"tools.{i}")]
            else:  # a hosted tool: OpenAI's servers run it, this one cannot
                left_out.append({"index": i, "type": t.type})
                continue
            for name, u, where in inner:
                if u.type not in CLIENT_TOOLS:
                    raise ValueError(f"{where}: a namespace holds function or custom tools, got {u.type!r}")
                if not u.name:
                    raise ValueError(f"{where}: a {u.type} tool needs a name")
                if name in seen:
                    raise ValueError(f"{where}: two tools are named {name!r}")
                seen.add(name)
                shown.append((name, u))
        return shown, left_out

    @property
    def custom_tools(self) -> frozenset[str]:
        return frozenset(name for name, t in self.client_tools()[0] if t.type == "custom")

    @property
    def namespaced(self) -> dict[str, tuple[str, str]]:
        """A namespace's function as the model calls it -> (namespace, name)."""
        return {f"{t.name}.{u.name}": (t.name, u.name) for t in self.tools or [] if t.type == "namespace"
                for u in t.tools or [] if u.name}

    def input_messages(self) -> list[dict]:
        """`input` as chat messages (ValueError naming the item)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        msgs: list[dict] = []
        thought = ""  # a reasoning item's text, for the tool calls after it
        for i, item in enumerate(self.input):
            where = f"input.{i}"
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise ValueError(f"{where}: role must be user, system, developer or assistant, got {role!r}")
                msgs.append({"role": role, "content": _text(item.get("content"), where)})
                thought = ""
            elif kind in ("function_call", "custom_tool_call"):
                argument = "arguments" if kind == "function_call" else "input"
                for key in ("call_id", "name", argument):
                    if not isinstance(item.get(key), str) or (key != argument and not item[key]):
                        raise ValueError(f"{where}: a {kind} item needs {key} (a string)")
                args = ((item["arguments"] or "{}") if kind == "function_call"
                        else json.dumps({"input": item["input"]}))
                ns = item.get("namespace")
                if ns is not None and (not isinstance(ns, str) or not ns):
                    raise ValueError(f"{where}: a {kind} item's namespace must be a non-empty string")
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": f"{ns}.{item['name']}" if ns else item["name"], "arguments": args}}
                last = msgs[-1] if msgs else None
                if last is not None and last["role"] == "assistant":  # several calls, or text then calls: one turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thought:  # the reasoning item before the call: its thoughts (server/harmony.py)
                    msgs[-1]["reasoning_content"], thought = thought, ""
            elif kind in ("function_call_output", "custom_tool_call_output"):
                out = item.get("output")
                msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": out if isinstance(out, str) else _text(out, where + ".output")})
            elif kind == "reasoning":  # its raw text, where a client kept it (summaries and encrypted ones: none)
                parts = item.get("content")
                thought = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)) \
                    if isinstance(parts, list) else ""
            else:
                raise ValueError(f"{where}: input item type {kind!r} is not supported here")
        if not msgs:
            raise ValueError("input has no messages")
        return msgs

    def to_chat(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat request for history (a previous response's conversation)
        plus this input, under this request's instructions."""
        msgs = ([{"role": "system", "content": self.instructions}] if self.instructions else []) \
            + history + self.input_messages()
        _check_outputs_answer_calls(msgs)
        body = {"model": self.model, "messages": msgs, "max_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stream": self.stream, "stream_options": {"include_usage": True} if self.stream else None,
                "parallel_tool_calls": self.parallel_tool_calls, "cache_salt": self.cache_salt,
                "priority": self.priority, "deadline_ms": self.deadline_ms,
                "session_id": self.session_id, "tool_wait_s": self.tool_wait_s, "tool": self.tool,
                "tool_decision": self.tool_decision, "kv_hints": self.kv_hints, "nvext": self.nvext,
                "prompt_cache_retention": self.prompt_cache_retention}
        shown, left_out = self.client_tools()
        for t in left_out:
            kind = t["type"] if t["type"] in HOSTED else "another type"
            if kind not in _said:  # once per type
                _said.add(kind)
                log.info("responses: hosted tool (%s) left out of the prompt (this server runs no hosted tools; "
                         "the response names it in ignored_tools)", kind)
        if shown:
            body["tools"] = [{"type": "function", "function": {
                "name": name, "description": t.description,
                "parameters": CUSTOM_PARAMETERS if t.type == "custom"
                else t.parameters or {"type": "object", "properties": {}}}} for name, t in shown]
        tc = self.tool_choice
        if tc is not None:
            body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ValueError("text.format of type json_schema needs a schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name,
                                                                              "schema": fmt.schema_}}
        body["prompt_cache_key"] = self.prompt_cache_key
        req = ChatCompletionRequest.model_validate(body)
        sid = (self.client_metadata or {}).get("session_id")
        if self.prompt_cache_key is None and sid:  # Codex names its thread here too
            req.name_conversation("client_metadata.session_id", sid[:KEY_MAX])
        return req


def _check_outputs_answer_calls(msgs: list[dict]) -> None:
    """A function_call_output answers a call made before it, in this input
    or the previous response (OpenAI refuses one that does not): a model
    shown a result for a call it never made is a client's bug to report,
    not a prompt to render."""
    made: set[str] = set()
    for m in msgs:
        made.update(c["id"] for c in m.get("tool_calls") or [])
        if m["role"] == "tool" and m.get("tool_call_id") not in made:
            raise ValueError(f"input: no tool call found for function call output with call_id "
                             f"{m.get('tool_call_id')!r} (none in this input or the previous response)")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be text or a list of text parts")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"{where}.content.{j}: {kind} parts are not supported; the models served here read text")
        parts.append(p.get("text") or "")
    return "\n".join(parts)


# ------------------------------------------------------------------ store
class ResponseStore:
    """Stored responses and their conversations (without instructions), for
    GET and previous_response_id; the oldest go first past `limit`."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self.limit = limit
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None


# ------------------------------------------------------------------ replies
def _items(chat_message: dict, shell: Shell) -> list[dict]:
    """Output items of a finished reply: its reasoning (a reasoning model's)
    as a reasoning item, its text as a message, each call as a
    function_call (custom_tool_call for a custom tool)."""
    msg = chat_message["message"]
    out = [reasoning_item(msg["reasoning_content"], "completed")] if msg.get("reasoning_content") else []
    if msg["content"]:
        out.append(message_item(msg["content"], "completed"))
    for call in msg.get("tool_calls") or []:
        out.append(call_item(call, "completed", shell))
    return out


def reasoning_item(text: str, status: str) -> dict:
    """A reasoning model's thoughts (gpt-oss: server/harmony.py), as its raw
    reasoning text: no summary is made."""
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call: dict, status: str, shell: Shell) -> dict:
    name, args, key = call["function"]["name"], call["function"]["arguments"], call["id"].removeprefix("call_")
    ns, inner = shell.namespaced.get(name, (None, name))  # a namespace's function: called back by its own name
    where = {"namespace": ns} if ns is not None else {}
    if name in shell.custom:  # its one argument is the freeform input
        value = json.loads(args).get("input")
        return {"type": "custom_tool_call", "id": "ctc_" + key, "call_id": call["id"], "name": inner, **where,
                "input": value if isinstance(value, str) else json.dumps(value)}
    return {"type": "function_call", "id": "fc_" + key, "call_id": call["id"], "name": inner, **where,
            "arguments": args, "status": status}


def conversation_after(req: ChatCompletionRequest, output: list[dict], has_instructions: bool) -> list[dict]:
    """The conversation a later previous_response_id continues: this
    request's messages without its instructions (the first, system,
    message when given), then the reply's output items as one assistant turn."""
    msgs = [m.model_dump(exclude_none=True) for m in req.messages][1 if has_instructions else 0:]
    text = "".join(c["text"] for it in output if it["type"] == "message" for c in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {
        "name": f"{it['namespace']}.{it['name']}" if it.get("namespace") else it["name"],
        "arguments": it["arguments"] if it["type"] == "function_call" else json.dumps({"input": it["input"]})}}
        for it in output if it["type"] in ("function_call", "custom_tool_call")]
    reply = {"role": "assistant", "content": text or None}
    if calls:
        reply["tool_calls"] = calls
        thoughts = "".join(c["text"] for it in output if it["type"] == "reasoning" for c in it["content"])
        if thoughts:
            reply["reasoning_content"] = thoughts
    return msgs + [reply]


class Shell:
    """The response object's fields that echo the request."""

    def __init__(self, body: ResponsesRequest, model: str, notes: dict | None = None) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.custom = body.custom_tools
        self.namespaced = body.namespaced
        # What the request asked and did not get (hosted tools; notes: tools the
        # template cannot show, a prefix break), extension fields of the response.
        ignored = body.client_tools()[1]
        self.notes = {**({"ignored_tools": ignored} if ignored else {}), **(notes or {})}
        self.created_at = int(time.time())
        self.fields = {
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
            else (body.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
            if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
            "metadata": body.metadata or {}, "store": body.store}

    def response(self, status: str, output: list[dict], final: RequestOutput | None = None) -> dict:
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "output": output,
                "usage": usage(final) if final is not None else None, **self.fields, **self.notes}


def status_of(final: RequestOutput) -> str:
    return "incomplete" if final.outputs[0].finish_reason == "length" else "completed"


def usage(final: RequestOutput) -> dict:
    prompt, out = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + out}


def response(shell: Shell, final: RequestOutput, chat_message: dict) -> dict:
    return shell.response(status_of(final), _items(chat_message, shell), final)
