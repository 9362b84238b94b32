"""Readers for the public KV-cache traces in shared/data/traces (see its
README.md). Traces carry prefix-block hash ids, never text; a replay maps each
hash id to one fixed block of synthetic tokens."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class TraceRequest:
    """One model call of a Claude Code session, main agent or sub-agent."""

    t: float  # seconds from session start (sub-agent calls shifted by the sub-agent's start)
    input_tokens: int
    output_tokens: int
    hash_ids: list[int]  # one per full `block_size`-token block of the prompt
    api_time: float
    agent: str  # "main" or the sub-agent's agent_id


@dataclass(slots=True)
class ClaudeCodeTrace:
    id: str
    block_size: int
    requests: list[TraceRequest]  # all calls, in arrival order


def default_trace_dir(repo_root: Path) -> Path:
    """shared/ sits next to the repository checkout."""
    return repo_root.parent / "shared" / "data" / "traces"


def load_claude_code_trace(path: Path) -> ClaudeCodeTrace:
    """Read one `trace_NNNN.json`; nested sub-agent calls are flattened and
    everything is ordered by arrival time (stable, so equal times keep file
    order)."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"trace {str(path)!r} is not valid JSON: {e}") from None
    missing = [k for k in ("id", "block_size", "requests") if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise ValueError(f"trace {str(path)!r} is not a Claude Code trace: it lacks {', '.join(missing)} "
                         "(see the README beside the traces)")
    out: list[TraceRequest] = []

    def walk(reqs: list[dict], t0: float, agent: str) -> None:
        for r in reqs:
            if r.get("type") == "subagent":
                # Sub-agent call times count from the sub-agent's own start.
                walk(r.get("requests", []), t0 + r["t"], r.get("agent_id", "subagent"))
                continue
            out.append(TraceRequest(t=t0 + r["t"], input_tokens=r["in"], output_tokens=r["out"],
                                    hash_ids=list(r["hash_ids"]), api_time=r.get("api_time", 0.0),
                                    agent=agent))

    walk(doc["requests"], 0.0, "main")
    out.sort(key=lambda r: r.t)
    return ClaudeCodeTrace(id=doc["id"], block_size=doc["block_size"], requests=out)


def tool_waits(trace_dir: Path) -> list[float]:
    """The client-side gaps of every Claude Code trace in trace_dir: for
    consecutive main-agent calls, t_next - (t + api_time) -- the tool (or
    human) time between one reply and the next call, in seconds."""
    gaps = []
    files = sorted(Path(trace_dir).glob("trace_*.json"))
    if not files:
        raise ValueError(f"no trace_*.json files in {trace_dir}")
    for f in files:
        main = [r for r in load_claude_code_trace(f).requests if r.agent == "main"]
        gaps.extend(max(0.0, b.t - (a.t + a.api_time)) for a, b in zip(main, main[1:]))
    return gaps
