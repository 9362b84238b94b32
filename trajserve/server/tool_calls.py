"""Tool calls: what the model writes, what OpenAI sends.

Three formats, chosen per server (`trajserve serve --tool-call-parser`; by
default from the chat template: one that writes `<tool_call>` is Hermes,
one that writes `<|python_tag|>` is Llama 3's JSON form, one that writes
harmony messages is gpt-oss's, read by server/harmony.py).

Hermes. Qwen2/2.5/3 were trained to call a tool by writing

    <tool_call>
    {"name": "run_tests", "arguments": {"path": "tests/"}}
    </tool_call>

(a JSON list of such objects inside one block is read as several calls,
as some fine-tunes write them). With `tools`
in a chat request and tool_choice "auto", the reply is parsed: each block
becomes an OpenAI `tool_calls` entry (arguments as a JSON string), the text
outside the blocks is the message content (None when only whitespace), and
finish_reason is "tool_calls". A block that is not such JSON, or one left
open (the reply hit max_tokens), makes the whole reply plain content: a
client is never handed a call the model did not finish writing. This is
vLLM's `--tool-call-parser hermes`.

Streaming sends the text before the first block as it comes, holding back
only a tail that could be the start of `<tool_call>`; the calls go out
whole, once the reply has finished. A client sees a call only after it is
complete, never half of its arguments.

Llama 3 JSON (Llama 3.1-3.3 instruct; vLLM's `llama3_json`). The whole
reply is the call(s): `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by ";". A reply that starts otherwise
is text and streams as text; one that starts like a call is held until it
ends and is text if it does not parse.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FORMATS = ("hermes", "llama3_json", "harmony")  # harmony: read by server/harmony.py


def format_for_template(template: str | None) -> str:
    """The tool-call format a chat template's model writes (Hermes unless the
    template is Llama 3's or writes harmony messages, as gpt-oss's does)."""
    t = template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return "harmony"
    return "llama3_json" if PYTHON_TAG in t and OPEN not in t else "hermes"


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    reasoning: str | None = None  # what a reasoning model thought before answering (server/harmony.py)


def _call(obj) -> dict | None:
    """A call from its JSON, or None. Its arguments must be a JSON object
    (or a string holding one, as some models write them): clients read
    them as one (OpenAI's arguments, Anthropic's tool_use input), and a
    reply with `"arguments": "ls"` is then not a call but text."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    args = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def hermes_text(name: str, arguments) -> str:
    """One call as the model writes it (what an earlier reply held)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def parse(text: str) -> Parsed:
    """Split a finished reply into content and tool calls (see the module doc)."""
    start = text.find(OPEN)
    if start < 0:
        return Parsed(text)
    calls, pos, outside = [], start, [text[:start]]
    while True:
        end = text.find(CLOSE, pos)
        if end < 0:
            return Parsed(text)  # left open
        try:
            body = json.loads(text[pos + len(OPEN):end])
        except json.JSONDecodeError:
            return Parsed(text)
        for obj in body if isinstance(body, list) else [body]:
            call = _call(obj)
            if call is None:
                return Parsed(text)
            calls.append(call)
        pos = text.find(OPEN, end)
        if pos < 0:
            outside.append(text[end + len(CLOSE):])
            break
        outside.append(text[end + len(CLOSE):pos])
    if not calls:
        return Parsed(text)
    content = "".join(outside)
    return Parsed(content if content.strip() else None, calls)


def parse_llama3_json(text: str) -> Parsed:
    """A finished reply in Llama 3's JSON form (see the module doc)."""
    body = text.strip().removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return Parsed(text)
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return Parsed(text)
        # Bare JSON is a call only with both keys: {"name": "Bob"} is an answer.
        call = _call(obj) if isinstance(obj, dict) and ("parameters" in obj or "arguments" in obj) else None
        if call is None:
            return Parsed(text)
        calls.append(call)
        while pos < len(body) and body[pos] in " \t\n;":
            pos += 1
    return Parsed(None, calls)


class Llama3JsonStream:
    """Streaming a reply in Llama 3's JSON form: text goes out as it comes
    unless the reply starts like a call, which is held until the end."""

    def __init__(self) -> None:
        self.text, self.sent, self.held = "", 0, None  # held: None = not decided yet

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.held is None:
            head = self.text.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return ""  # could still become a call
            self.held = head.startswith(("{", PYTHON_TAG))
        if self.held:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def finish(self) -> Parsed:
        if self.held:
            parsed = parse_llama3_json(self.text)
            if parsed.tool_calls:
                return parsed
        rest = self.text[self.sent:]
        return Parsed(rest or None)


def parse_calls(text: str, fmt: str) -> Parsed:
    return parse_llama3_json(text) if fmt == "llama3_json" else parse(text)


def call_stream(fmt: str):
    return Llama3JsonStream() if fmt == "llama3_json" else StreamParser()


class StreamParser:
    """One choice's streamed reply (Hermes): `feed` returns the content that
    can go out now; `finish` returns what is left (content, tool calls)."""

    def __init__(self) -> None:
        self.text = ""   # the whole reply so far
        self.sent = 0    # characters of it already sent as content
        self.opened = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.opened:
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.opened = True
            return self._send(at)
        # Hold back the longest tail that is a proper prefix of OPEN.
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1)
                     if OPEN.startswith(self.text[-k:])), 0)
        return self._send(len(self.text) - keep)

    def finish(self) -> Parsed:
        """The rest of the content (None if nothing is left to send) and the calls."""
        parsed = parse(self.text)
        if not parsed.tool_calls:
            rest = self.text[self.sent:]
            return Parsed(rest or None)
        # Content before the first block went out already; what follows the
        # blocks goes now, unless the reply's content is only whitespace.
        before = self.text.find(OPEN)
        rest = (parsed.content or "")[before:] if parsed.content is not None else ""
        return Parsed(rest or None, parsed.tool_calls)

    def _send(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out


# ------------------------------------------- tool_choice "required" / named
# A forced call is not left to the model's own format: the reply is held to
# JSON (trajserve/structured.py) -- the named function's arguments, or for
# "required" a list of {"name", "arguments"} objects over the given tools --
# and that JSON becomes the calls. As vLLM does it.
def forced_schema(tools: list[dict], forced: str, parallel: bool = True) -> dict:
    """The JSON schema a reply is held to. tools: OpenAI tool dicts;
    forced: "required" or a function name (one of the tools'); parallel=False
    (OpenAI's parallel_tool_calls): at most one call."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if forced != "required":
        return params[forced]
    # Each tool's schema moves under the wrapper's $defs, its own $defs beside
    # it and its "#..." references rebased, so a recursive schema ($ref
    # "#/$defs/node") compiles here as it does alone in response_format.
    defs, anyof = {}, []
    for i, (name, p) in enumerate(params.items()):
        tag = f"tool{i}"
        p = _rebase(p, tag)
        for kind in ("$defs", "definitions"):
            for k, v in (p.pop(kind, None) or {}).items() if isinstance(p, dict) else ():
                defs[f"{tag}.{kind.strip('$')}.{k}"] = v
        defs[tag] = p
        args = {"$ref": f"#/$defs/{tag}"}
        anyof.append({"type": "object", "properties": {"name": {"const": name}, "arguments": args},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return {"$defs": defs, "type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
            "items": {"anyOf": anyof}}


def _rebase(schema, tag: str):
    """A copy of schema whose local references ("#", "#/$defs/x/...",
    "#/properties/...") point where forced_schema puts its parts."""
    if isinstance(schema, list):
        return [_rebase(v, tag) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            parts = v[2:].split("/") if v != "#" else []
            if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
                v = "/".join([f"#/$defs/{tag}.{parts[0].strip('$')}.{parts[1]}", *parts[2:]])
            else:
                v = "/".join([f"#/$defs/{tag}", *parts])
            out[k] = v
        else:
            out[k] = _rebase(v, tag)
    return out


def parse_forced(text: str, forced: str) -> Parsed:
    """A finished forced reply as calls; one cut short (max_tokens) stays text."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return Parsed(text)
    if forced != "required":
        call = _call({"name": forced, "arguments": text.strip()})
        return Parsed(text) if call is None else Parsed(None, [call])
    calls = [_call(o) for o in body] if isinstance(body, list) else []
    if not calls or None in calls:
        return Parsed(text)
    return Parsed(None, calls)


class ForcedStream:
    """Streaming a forced reply: nothing goes out as text; the calls at the
    end. read: the whole reply as its calls (parse_forced; a harmony
    reply's, harmony.held_call)."""

    def __init__(self, read: Callable[[str], Parsed]) -> None:
        self.read, self.text = read, ""

    def feed(self, delta: str) -> str:
        self.text += delta
        return ""

    def finish(self) -> Parsed:
        return self.read(self.text)
