"""gpt-oss replies: OpenAI's harmony format, read back into what the APIs send.

gpt-oss writes its reply as messages, each a header and a body:

    <|channel|>analysis<|message|>The user wants ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is 4.<|return|>

or, to call a tool,

    <|channel|>commentary to=functions.run_tests <|constrain|>json<|message|>{"path": "tests/"}<|call|>

(the recipient may also stand before the channel: `assistant to=functions.x<|channel|>...`).
The prompt ends with `<|start|>assistant`, so the reply opens on its first
message's header. Read back:

    channel analysis                  -> the reasoning (`reasoning_content`)
    channel final, or commentary
    with no recipient (a preamble)    -> the content
    recipient functions.NAME          -> a tool call; its body, a JSON object, the arguments

A call the reply did not finish (no `<|call|>`: max_tokens cut it) or whose
body is not a JSON object is not handed to the client as a call: its body
joins the content. A reply with no harmony markers at all is content.

A reply held to JSON (a forced tool_choice, a response_format) opens on a
header the server writes into the prompt (`held_opening`), so the model
writes the JSON where it would: the call's or the answer's message body.

The reply is read as text with the markers in it (the engine detokenizes a
harmony vocabulary's replies with its special tokens kept), so a marker the
model spells out of ordinary tokens reads as a marker too.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

from trajserve.server.tool_calls import Parsed, _call, parse_forced
from trajserve.structured import closed_objects

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_ENDS = (END, RETURN, CALL, START)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_WORD = re.compile(r"\s*([^\s<]+)")


class _Message:
    __slots__ = ("channel", "recipient", "body", "closed_by")

    def __init__(self, header: str, body: str, closed_by: str | None) -> None:
        at = header.find(CHANNEL)
        word = _WORD.match(header, at + len(CHANNEL)) if at >= 0 else None
        self.channel = word.group(1) if word else None
        to = _RECIPIENT.search(header)
        self.recipient = to.group(1) if to else None
        self.body = body
        self.closed_by = closed_by  # the marker that ended it, None: the reply ended inside it


def _messages(text: str) -> list[_Message]:
    """The reply's messages in order (the last one maybe open)."""
    out = []
    pos = 0
    while pos < len(text):
        m = text.find(MESSAGE, pos)
        if m < 0:
            break  # a header the reply ended in: nothing of its body yet
        header = text[pos:m]
        body_at = m + len(MESSAGE)
        ends = [(i, mk) for mk in _ENDS if (i := text.find(mk, body_at)) >= 0]
        if not ends:
            out.append(_Message(header, text[body_at:], None))
            break
        i, mk = min(ends)
        out.append(_Message(header, text[body_at:i], mk))
        pos = i + len(mk)
        if mk == START:
            continue
        if text.startswith(START, pos):
            pos += len(START)
    return out


def _kind(msg: _Message, calls: bool) -> str | None:
    """What a message is to the client: "call", "reasoning", "content", or
    None (a built-in tool's message, e.g. to=browser.search: not passed on).
    calls=False (the request parses no tool calls): a call is content."""
    if msg.recipient is not None:
        if not msg.recipient.startswith("functions."):
            return None
        return "call" if calls else "content"
    return "reasoning" if msg.channel == "analysis" else "content"


def _plain(text: str) -> bool:
    """A reply that does not open on a harmony header: plain content."""
    head = text.lstrip()
    return bool(head) and not any(mk.startswith(head[:len(mk)]) for mk in (CHANNEL, START))


def parse(text: str, calls: bool = True) -> Parsed:
    """A finished reply as content, reasoning and tool calls (none when
    calls=False: the request asked for none)."""
    if _plain(text):
        return Parsed(text if text.strip() else None)
    reasoning, content, made = [], [], []
    for msg in _messages(text):
        kind = _kind(msg, calls)
        if kind == "call":
            call = _as_call(msg) if msg.closed_by == CALL else None
            if call is None:
                content.append(msg.body)
            else:
                made.append(call)
        elif kind == "reasoning":
            reasoning.append(msg.body)
        elif kind == "content":
            content.append(msg.body)
    joined = "".join(content)
    return Parsed(joined if joined.strip() else None, made, "".join(reasoning) or None)


# A function name the header can carry: OpenAI's rule for names; any other
# is not written into the prompt, where a marker in it would read as one.
_HEADER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


# A "required" reply opens here: the model then writes which function it
# calls, as it would, and the rest of the header (required_grammar).
REQUIRED_OPENING = f"{CHANNEL}commentary to=functions."


def held_opening(forced: str | None, names: Sequence[str] = ()) -> str:
    """The header of a reply held to JSON (a forced tool_choice, a
    response_format), which the server writes into the prompt after
    `<|start|>assistant`: gpt-oss opens a call as a commentary message to
    functions.NAME constrained to json, an answer on the final channel. A
    reply held to JSON from its first token would skip the header the model
    writes first, and its end marker would stay in the JSON.
    forced: tool_choice's function name or "required"; None: an output
    constraint. names: the tools' names. "required" opens up to the
    function's name (REQUIRED_OPENING, held by required_grammar); where a
    name is not one the header can carry, as a commentary message whose
    JSON names the calls."""
    if forced is None:
        return f"{CHANNEL}final{MESSAGE}"
    if forced == "required":
        if names and all(_HEADER_NAME.fullmatch(n) for n in names):
            return REQUIRED_OPENING
        return f"{CHANNEL}commentary{MESSAGE}"
    if not _HEADER_NAME.fullmatch(forced):
        return f"{CHANNEL}commentary{MESSAGE}"
    return f"{CHANNEL}commentary to=functions.{forced} {CONSTRAIN}json{MESSAGE}"


def required_grammar(tools: list[dict], is_special: Callable[[str], bool]) -> str:
    """The Lark grammar (llguidance's) a "required" reply is held to after
    REQUIRED_OPENING: one of the tools' names, the header's rest
    (` <|constrain|>json<|message|>`), then that tool's arguments under its
    schema (objects closed, as every forced call's). One call: harmony
    writes each call as its own message, and the reply ends at the first's
    <|call|>. is_special: which markers the vocabulary holds as control
    tokens (gpt-oss's: all); the grammar takes those as the tokens, others
    as their text (which reads back as the marker all the same)."""
    constrain, message = (m if is_special(m) else json.dumps(m) for m in (CONSTRAIN, MESSAGE))
    alts = []
    for t in tools:
        fn = t["function"]
        schema = closed_objects(fn.get("parameters") or {"type": "object"})
        alts.append(f'{json.dumps(fn["name"])} " " {constrain} "json" {message} %json {json.dumps(schema)}')
    return "start: " + " | ".join(alts)


def held_body(opening: str, text: str) -> str:
    """What a reply that opened on `opening` (held_opening) wrote in its
    message: its text without the marker that ended it; with no opening
    (not a harmony reply), the text."""
    if not opening:
        return text
    msgs = _messages(opening + text)
    return msgs[0].body if msgs else text


def held_call(opening: str, text: str, forced: str) -> Parsed:
    """A forced reply (tool_choice `forced`) that opened on `opening`, as
    its call; one cut short (max_tokens) stays text."""
    if opening != REQUIRED_OPENING:
        return parse_forced(held_body(opening, text), forced)
    msgs = _messages(opening + text)
    call = _as_call(msgs[0]) if msgs and (msgs[0].recipient or "").startswith("functions.") else None
    return Parsed(text) if call is None else Parsed(None, [call])


def _as_call(msg: _Message) -> dict | None:
    """A message to functions.NAME as the API's call; None if its body is
    not a JSON object."""
    if not _is_object(msg.body):
        return None
    return _call({"name": msg.recipient[len("functions."):], "arguments": msg.body.strip()})


def _is_object(body: str) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except json.JSONDecodeError:
        return False


def _open_tail(text: str) -> int:
    """Length of the longest tail of text that is a proper prefix of a marker."""
    for k in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        tail = text[-k:]
        if any(mk.startswith(tail) and mk != tail for mk in MARKERS):
            return k
    return 0


class HarmonyStream:
    """A streamed harmony reply: `feed` returns the content that can go out
    now and leaves the reasoning that can go out in `take_reasoning()`;
    tool calls come whole from `finish`, as for the other formats."""

    def __init__(self, calls: bool = True) -> None:
        self.calls = calls
        self.text = ""
        self.sent_content = 0
        self.sent_reasoning = 0

    def _so_far(self) -> Parsed:
        """The reply so far, read as if it ended here: the tail that may be
        the start of a marker held back, and everything from the first tool
        call on (a call, or the content it turns out to be, is decided at
        the end)."""
        text = self.text[:len(self.text) - _open_tail(self.text)]
        if _plain(text):
            return Parsed(text)
        reasoning, content, called = [], [], False
        for msg in _messages(text):
            kind = _kind(msg, self.calls)
            called = called or kind == "call"
            if kind == "reasoning":
                reasoning.append(msg.body)
            elif kind == "content" and not called:
                content.append(msg.body)
        return Parsed("".join(content), [], "".join(reasoning))

    def feed(self, delta: str) -> str:
        self.text += delta
        now = self._so_far()
        out = (now.content or "")[self.sent_content:]
        self.sent_content += len(out)
        return out

    def take_reasoning(self) -> str:
        now = self._so_far()
        out = (now.reasoning or "")[self.sent_reasoning:]
        self.sent_reasoning += len(out)
        return out

    def finish(self) -> Parsed:
        whole = parse(self.text, self.calls)
        content = (whole.content or "")[self.sent_content:] if whole.content else ""
        reasoning = (whole.reasoning or "")[self.sent_reasoning:] if whole.reasoning else ""
        return Parsed(content or None, whole.tool_calls, reasoning or None)
