"""Synthetic coding-agent conversations for `bench agent`: a shared system +
tool preamble, a task per trajectory, then per turn the model's reply and a
tool result (test logs, file listings) of a random length. Seeded, so two
runs replay the same text."""
from __future__ import annotations

import json
import random

WORDS = ("assert", "config", "handler", "request", "cache", "block", "token", "parser", "router", "session",
         "expected", "actual", "timeout", "retry", "buffer", "index", "schema", "worker", "queue", "client")
TOOLS = ("read_file", "write_file", "list_dir", "run_tests", "grep", "git_diff", "git_commit", "run_shell",
         "open_url", "search_docs", "apply_patch", "format_code", "lint", "type_check", "ask_human")


def preamble(tokenizer, target_tokens: int) -> str:
    """System prompt plus JSON tool definitions, grown to about target_tokens."""
    text = ("You are a careful software engineering agent working in a git repository. "
            "Think step by step, call one tool at a time, read files before editing them, "
            "and run the tests after every change. Available tools:\n")
    i = 0
    while len(tokenizer.encode(text)) < target_tokens:
        name = TOOLS[i % len(TOOLS)] + ("" if i < len(TOOLS) else f"_v{i // len(TOOLS) + 1}")
        spec = {"name": name, "description": f"{name.replace('_', ' ')}: operates on the working tree "
                f"and returns its output as text; fails with a message naming the problem.",
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string", "description": "file or directory, relative to the repo root"},
                    "args": {"type": "array", "items": {"type": "string"}},
                    "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}},
                    "required": ["path"]}}
        text += json.dumps(spec) + "\n"
        i += 1
    return text


def tool_result(tokenizer, rng: random.Random, target_tokens: int) -> str:
    """A pytest-like log of about target_tokens tokens."""
    lines: list[str] = []
    n = 0
    while n < target_tokens:
        mod, case = rng.randrange(40), rng.randrange(200)
        status = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"))
        detail = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 8)))
        line = f"tests/test_mod{mod}.py::test_{detail.split()[0]}_{case} {status} {detail}"
        lines.append(line)
        n += len(tokenizer.encode(line + "\n"))
    return "\n".join(lines)


def task(i: int) -> str:
    return (f"Task {i}: the test suite fails in module {i * 7 % 40}. Find the cause, fix it with the "
            f"smallest change, and make every test pass.")
