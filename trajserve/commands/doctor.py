"""`trajserve doctor LOG`: prefix-break diagnosis over a recorded request log.

LOG is JSON lines, one request each: {"api": "messages" | "responses" |
"chat", "body": {...}} or a bare request body (its API read from its shape:
`input` is a Responses request, `max_tokens` with `system` or content blocks
a Messages request, else chat). Each request is rendered as the server
renders it (the model's tokenizer and chat template only: no weights load),
grouped into conversations as the server groups them
(server/conversations.py: session_id, prompt_cache_key, client_metadata,
metadata.user_id, nvext.agent_context; then lineages under a key), and each
turn compared with the conversation's previous prompt
(server/prefix_break.py). Without the replies a log does not hold, a turn
is compared with the previous prompt, not prompt and reply: a prompt that
keeps the previous one whole is no break.

The report: per conversation its turns, each turn's share of the prompt the
previous prompt could have served from the cache (an upper bound of eq. 2's
H_prefix for that turn), and every break (position, lost tokens, cause,
excerpts of both prompts: this log's own text, printed to whoever runs it).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace


def add_doctor_parser(p: argparse.ArgumentParser) -> None:
    from trajserve.engine.options import BY_NAME

    p.add_argument("log", help="a JSON-lines file of request bodies ({api, body} or bare bodies)")
    for name in ("model", "chat_template", "tool_prompt"):  # what renders a prompt: the engine's own options
        o = BY_NAME[name]
        p.add_argument(o.flag, dest=o.name, default=None, choices=o.choices, metavar=o.metavar, help=o.help)
    p.add_argument("--json", action="store_true", help="print only JSON")


@dataclass
class _Conversation:
    key: str
    origin: str
    turns: list[dict] = field(default_factory=list)
    last: object = None      # the latest turn's (prompt ids, TurnShape)
    breaks: list[dict] = field(default_factory=list)


def _api(entry: dict) -> tuple[str, dict]:
    """(api, body) of a log line; a bare body's API from its shape (give
    {api, body} where a chat request might read as a Messages one)."""
    if "body" in entry and "api" in entry:
        return entry["api"], entry["body"]
    if "input" in entry:
        return "responses", entry
    if "max_tokens" in entry and ("system" in entry or "metadata" in entry):
        return "messages", entry
    return "chat", entry


def _chat(api: str, body: dict):
    """The chat request the server would serve for body (ValueError as the server's 400)."""
    from trajserve.server import anthropic, responses
    from trajserve.server.protocol import ChatCompletionRequest

    if api == "messages":
        return anthropic.MessagesRequest.model_validate(body).to_chat()
    if api == "responses":
        req = responses.ResponsesRequest.model_validate(body)
        if req.previous_response_id is not None:
            raise ValueError("previous_response_id: the stored conversation is not in the log")
        return req.to_chat([])
    if api == "chat":
        return ChatCompletionRequest.model_validate(body)
    raise ValueError(f"api must be messages, responses or chat, got {api!r}")


def diagnose_log(lines, tok) -> dict:
    """The report for an iterable of JSON lines (see the module docstring)."""
    from trajserve.server.conversations import conversation_id, lineage
    from trajserve.server.prefix_break import TurnShape, common_prefix, diagnose
    from trajserve.server.state import render_chat

    conversations: dict[str, _Conversation] = {}
    skipped: list[dict] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            api, body = _api(json.loads(line))
            req = _chat(api, body)
            ids = render_chat(tok, req)
        except Exception as e:  # noqa: BLE001 - a line the server would refuse is reported, not fatal
            skipped.append({"line": n, "why": str(getattr(e, "message", e))[:200]})
            continue
        named = ("session_id", req.session_id) if req.session_id else req.conversation()
        if named is None:
            skipped.append({"line": n, "why": "names no conversation"})
            continue
        base = conversation_id(named[1], named[0], req.cache_salt, None)
        # Lineages as the server picks them, over what this log has seen.
        seen = {sid: SimpleNamespace(last_output=SimpleNamespace(prompt_token_ids=c.last[0]), history=c.last[0],
                                     in_flight=False, session_id=sid)
                for sid, c in conversations.items() if sid.startswith(base)}
        sid = lineage(seen, base, ids) or f"{base}-overflow"
        conv = conversations.setdefault(sid, _Conversation(sid, named[0]))
        shape = TurnShape.of(len(ids), req.messages,
                             [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None)
        turn = {"line": n, "api": api, "prompt_tokens": len(ids), "reusable_tokens": 0}
        if conv.last is not None:
            before_ids, before = conv.last
            turn["reusable_tokens"] = common_prefix(before_ids, ids)
            hit = diagnose(len(conv.turns), before_ids, before, ids, shape,
                           lambda t: tok.decode(t, skip_special_tokens=False))
            if hit is not None:
                conv.breaks.append({"line": n, **hit.as_dict()})
        turn["reusable_share"] = turn["reusable_tokens"] / len(ids) if ids else 0.0
        conv.turns.append(turn)
        conv.last = (ids, shape)
    out = []
    for c in conversations.values():
        later = c.turns[1:]
        out.append({"id": c.key, "origin": c.origin, "turns": len(c.turns),
                    "prompt_tokens": sum(t["prompt_tokens"] for t in c.turns),
                    "reusable_tokens": sum(t["reusable_tokens"] for t in c.turns),
                    "h_prefix_bound": (sum(t["reusable_tokens"] for t in later) /
                                       sum(t["prompt_tokens"] for t in later)) if later else None,
                    "breaks": c.breaks, "turn_list": c.turns})
    return {"conversations": out, "skipped": skipped,
            "breaks_by_cause": {cause: sum(1 for c in out for b in c["breaks"] if b["cause"] == cause)
                                for cause in sorted({b["cause"] for c in out for b in c["breaks"]})}}


def run(args: argparse.Namespace) -> int:
    from trajserve.model.tokenizer import load_tokenizer, read_chat_template

    tok = load_tokenizer(args.model)
    if args.chat_template is not None:
        tok.chat_template = read_chat_template(args.chat_template)
    tok.tool_prompt = args.tool_prompt
    with open(args.log, encoding="utf-8") as f:
        report = diagnose_log(f, tok)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for c in report["conversations"]:
        bound = f"{c['h_prefix_bound']:.3f}" if c["h_prefix_bound"] is not None else "-"
        print(f"{c['id']} ({c['origin']}): {c['turns']} turns, {c['prompt_tokens']:,} prompt tokens, "
              f"H_prefix <= {bound}, {len(c['breaks'])} breaks")
        for b in c["breaks"]:
            print(f"  line {b['line']} (turn {b['turn'] + 1}): {b['cause']} at token {b['position']:,}, "
                  f"{b['lost_tokens']:,} tokens prefilled again\n    before: {b['previous']!r}\n    now:    {b['now']!r}")
    for s in report["skipped"]:
        print(f"line {s['line']} skipped: {s['why']}", file=sys.stderr)
    print("\nJSON:")
    print(json.dumps(report))
    return 0
