"""Trace replay: Mooncake (FAST'25) and Claude Code sessions
(shared/data/traces, README there). Traces carry hash ids, never text;
sim/tokens.py turns each id into one fixed block of token ids.

  * Mooncake: one request per line, open loop at its timestamp (ms);
    512-token hash blocks, the last one usually partial.
  * Claude Code: one session per file, 64-token hash blocks over full blocks
    only (the prompt's tail is private). Hash ids are local to a file, so
    each file is its own cache namespace (cache_salt = trace id). Replayed
    closed loop by default: an agent's (main or sub-agent's) next call
    arrives its recorded gap (tool or human wait: t_next - (t + api_time))
    after the simulated end of its previous call; sub-agents start at their
    recorded times. Open loop replays every call at its recorded time.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trajserve.sim.synthetic import arrival_times
from trajserve.sim.tokens import TokenSource
from trajserve.sim.workload import Call, Session, fixed
from trajserve.traces import load_claude_code_trace

MOONCAKE_BLOCK = 512


@dataclass(slots=True)
class MooncakeRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_mooncake(path: str | Path, limit: int | None = None) -> list[MooncakeRequest]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(MooncakeRequest(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                           list(d["hash_ids"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i + 1}: not a Mooncake trace line ({e})") from None
    return out


def mooncake_sessions(reqs: list[MooncakeRequest], tokens: TokenSource, time_scale: float = 1.0) -> list[Session]:
    def prompt(r: MooncakeRequest):
        return fixed(lambda: tokens.hash_prompt(r.hash_ids, MOONCAKE_BLOCK, r.input_length))

    return [Session(f"mc{i}", [Call(prompt(r), r.output_length, arrival=r.timestamp_ms / 1e3 * time_scale, turn=1)])
            for i, r in enumerate(reqs)]


def claude_code_files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("trace_*.json"))
        if not files:
            raise ValueError(f"no trace_*.json files in {str(p)!r}")
        return files
    if not p.is_file():
        raise FileNotFoundError(f"trace {str(p)!r} not found")
    return [p]


def claude_code_sessions(files: list[Path], tokens: TokenSource, *, closed_loop: bool = True,
                         time_scale: float = 1.0, rate: float = float("inf"), burstiness: float = 1.0,
                         seed: int = 0, limit: int | None = None) -> list[Session]:
    """One session per agent per trace file; trace files start at t = 0, or
    staggered by `rate` (sessions per second)."""
    starts = arrival_times(len(files), rate, burstiness, np.random.default_rng(seed))
    sessions: list[Session] = []
    n = 0
    for f, start in zip(files, starts):
        tr = load_claude_code_trace(f)
        by_agent: dict[str, list] = {}
        for r in tr.requests:
            if limit is not None and n >= limit:
                break
            by_agent.setdefault(r.agent, []).append(r)
            n += 1
        for agent, reqs in by_agent.items():
            calls = []
            for k, r in enumerate(reqs):
                prompt = _cc_prompt(tokens, r.hash_ids, tr.block_size, r.input_tokens)
                at = float(start) + r.t * time_scale
                if closed_loop and k > 0:
                    prev = reqs[k - 1]
                    gap = max(0.0, r.t - (prev.t + prev.api_time)) * time_scale
                    calls.append(Call(prompt, r.output_tokens, wait=gap, cache_salt=tr.id, turn=k + 1))
                else:
                    calls.append(Call(prompt, r.output_tokens, arrival=at, cache_salt=tr.id, turn=k + 1))
            if closed_loop:
                sessions.append(Session(f"{tr.id}/{agent}", calls))
            else:  # each call on its own: arrival times are the recorded ones
                sessions.extend(Session(f"{tr.id}/{agent}/{k}", [c]) for k, c in enumerate(calls))
    return sessions


def _cc_prompt(tokens: TokenSource, hash_ids: list[int], block: int, n: int):
    return fixed(lambda: tokens.hash_prompt(hash_ids, block, n))


def iter_hash_prefix_hits(requests: list[tuple[list[int], int]], trace_block: int, engine_block: int
                          ) -> Iterator[int]:
    """Oracle for an unlimited cache and requests that never overlap in time:
    per request, the tokens the engine can reuse, counted on hash ids alone.

    A request's hit is its longest common prefix with any earlier request,
    in tokens: the leading hash ids it shares with that request, plus, when
    the next id is also shared (a partial last block, Mooncake), the shorter
    of the two partial lengths; then cut to what the engine matches: full
    engine blocks of the prompt minus its last token (whose logits are
    needed). Earlier requests' outputs never match (fresh ids)."""
    trie: dict = {}
    for ids, n in requests:
        node, depth, lcp = trie, 0, 0
        for k, h in enumerate(ids):
            nxt = node.get(h)
            if nxt is None:
                break
            child, longest = nxt
            mine = min(trace_block, n - k * trace_block)
            lcp = k * trace_block + min(mine, longest)
            node, depth = child, depth + 1
            if mine < trace_block:
                break
        yield (min(lcp, n - 1) // engine_block) * engine_block
        # Insert this request's path, remembering per id the longest block length seen.
        node = trie
        for k, h in enumerate(ids):
            mine = min(trace_block, n - k * trace_block)
            entry = node.get(h)
            if entry is None:
                entry = node[h] = ({}, mine)
            elif entry[1] < mine:
                entry = node[h] = (entry[0], mine)
            node = entry[0]
