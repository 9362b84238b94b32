"""Anthropic's `context_management` edits, applied before the prompt renders.

clear_tool_uses_20250919: once the prompt passes its trigger (`input_tokens`,
100,000 by default, or a number of `tool_uses`), the results of the oldest
tool uses become a short placeholder; the `keep` most recent (3 by default)
and those of `exclude_tools` stay. With `clear_at_least` (input tokens) the
edit clears oldest first until that much is gone, and does nothing when the
eligible results do not hold that much. `clear_tool_inputs` clears the
calls' arguments too (true: every cleared call's; a list: those tools').
The reply says what was done in `context_management.applied_edits`
(`cleared_tool_uses`, `cleared_input_tokens`), as Anthropic's does.

clear_thinking_20251015: the models served here write no thinking and
thinking blocks never reach the prompt (server/anthropic.py), so there is
nothing for it to clear; accepted, never reported as applied.

A cleared history renders to other tokens from the first cleared result on:
the prefix cache serves what comes before it, as Anthropic's cache does.
`trajserve doctor` renders a logged request without its edits."""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
PLACEHOLDER = "[tool result cleared to save context]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP = 3


class EditCount(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_tokens", "tool_uses", "thinking_turns"]
    value: int = Field(ge=0)


class ContextEdit(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    trigger: EditCount | None = None
    keep: EditCount | Literal["all"] | None = None  # clear_thinking's keep may be "all" (Claude Code sends it)
    clear_at_least: EditCount | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: StrictBool | list[str] | None = None


def _check(edit: ContextEdit, where: str) -> None:
    if edit.trigger is not None and edit.trigger.type not in ("input_tokens", "tool_uses"):
        raise ValueError(f"{where}.trigger.type must be input_tokens or tool_uses, got {edit.trigger.type!r}")
    if edit.keep is not None and (edit.keep == "all" or edit.keep.type != "tool_uses"):
        got = edit.keep if edit.keep == "all" else edit.keep.type
        raise ValueError(f"{where}.keep.type must be tool_uses, got {got!r}")
    if edit.clear_at_least is not None and edit.clear_at_least.type != "input_tokens":
        raise ValueError(f"{where}.clear_at_least.type must be input_tokens, got {edit.clear_at_least.type!r}")


def apply(edits: list[ContextEdit], req, count: Callable[[], int], tokens: Callable[[str], int]) -> list[dict]:
    """Apply the edits to req (a chat request: tool results are its tool
    messages) in place; count(): req's prompt tokens as it renders now (its
    last call sees req as the edits leave it);
    tokens(text): a text's tokens. The edits applied, as the reply lists
    them (ValueError naming a malformed edit)."""
    applied = []
    for i, edit in enumerate(edits):
        if edit.type != CLEAR_TOOL_USES:
            continue
        _check(edit, f"context_management.edits.{i}")
        done = _clear_tool_uses(edit, req, count, tokens)
        if done is not None:
            applied.append({"type": edit.type, **done})
    return applied


def _clear_tool_uses(edit: ContextEdit, req, count, tokens) -> dict | None:
    calls = {c.id: (m, c) for m in req.messages if m.role == "assistant" for c in m.tool_calls or []}
    uses = [m for m in req.messages if m.role == "tool" and m.tool_call_id in calls]
    trigger = edit.trigger or EditCount(type="input_tokens", value=DEFAULT_TRIGGER_TOKENS)
    before = count() if trigger.type == "input_tokens" or edit.clear_at_least is not None else None
    if (trigger.value >= before) if trigger.type == "input_tokens" else (trigger.value >= len(uses)):
        return None
    keep = (edit.keep.value if edit.keep is not None else DEFAULT_KEEP)
    skip = set(edit.exclude_tools or ())
    eligible = [m for m in uses[:max(0, len(uses) - keep)]
                if calls[m.tool_call_id][1].function.name not in skip and m.content != PLACEHOLDER]
    if edit.clear_at_least is not None:  # oldest first, until that much would be gone; else not at all
        chosen, freed = [], 0
        for m in eligible:
            if freed >= edit.clear_at_least.value:
                break
            chosen.append(m)
            freed += max(0, tokens(_text(m.content)) - tokens(PLACEHOLDER))
        if freed < edit.clear_at_least.value:
            return None
        eligible = chosen
    if not eligible:
        return None
    inputs = edit.clear_tool_inputs
    for m in eligible:
        m.content = PLACEHOLDER
        call = calls[m.tool_call_id][1]
        if inputs is True or (isinstance(inputs, list) and call.function.name in inputs):
            call.function.arguments = "{}"
    before = count() if before is None else before
    return {"cleared_tool_uses": len(eligible), "cleared_input_tokens": max(0, before - count())}


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text or "" for p in content or [])
