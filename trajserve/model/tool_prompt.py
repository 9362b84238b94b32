"""Tools for a chat template that renders none (--tool-prompt hermes).

Many small models' templates (SmolLM2's among them) never read `tools`:
a request's tool definitions would reach the model as nothing at all. With
`--tool-prompt hermes` they are written into the system message in the
Hermes form (JSON signatures inside <tools></tools>, calls answered inside
<tool_call></tool_call>), the form server/tool_calls.py parses back. Without
it the server says, in the reply and once in the log, that the tools were
not shown (server/state.py)."""
from __future__ import annotations

import json
import re


def template_shows_tools(template: str | None) -> bool:
    """Whether a chat template reads its `tools` variable at all."""
    return template is not None and re.search(r"\btools\b", template) is not None


def hermes_block(tools: list[dict]) -> str:
    """The tools' signatures and how to call them, in the Hermes form."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call the functions whose JSON signatures are listed in <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call one, answer with its name and arguments as a JSON object inside <tool_call></tool_call>, "
            "one block per call:\n<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<arguments>}}\n"
            "</tool_call>")


def with_tools_shown(messages: list[dict], tools: list[dict]) -> list[dict]:
    """messages with the tools' block ending the first system message (a new
    system message first when there is none): the same text every turn, so
    the conversation's prefix stays cacheable."""
    block = hermes_block(tools)
    if messages and messages[0].get("role") == "system":
        content = messages[0].get("content") or ""
        return [{**messages[0], "content": f"{content}\n\n{block}" if content else block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
