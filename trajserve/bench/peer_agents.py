"""`trajserve bench peers --agents N`: one agent load, over HTTP, against
trajserve's server and llama.cpp's llama-server on the same GGUF file.

N agents share a system prompt of tool definitions (bench agent's
workload, the same seeded text for both), each with its own task; every
agent runs `--turns` turns at once with the others: a chat completion of
`--reply-tokens` greedy tokens (EOS ignored, so both engines write the same
number of tokens), then a test log as the next user message. The figure is
the wall time from the first request to the last reply, per engine; rounds
alternate the engines, each server a fresh process on a free local port.

Each server is started as its users start it: `trajserve serve --model F`
with its defaults (prefix cache on), `llama-server -m F -np N -c N x CTX`
(a slot per agent, each slot's prompt cache on, llama.cpp's default).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trajserve.bench.agent_workload import preamble, task, tool_result

SLOT_CONTEXT = 4096  # llama-server's context per slot: the longest conversation here fits


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} was not ready within {timeout_s:.0f} s")


def _server(engine: str, args: argparse.Namespace, threads: int, port: int) -> list[str]:
    if engine == "trajserve":
        return [sys.executable, "-m", "trajserve.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
                "--port", str(port), "--threads", str(threads)]
    tool = next((str(c) for c in (Path(args.llama_cpp) / "llama-server", Path(args.llama_cpp) / "bin" / "llama-server")
                 if c.is_file()), None)
    if tool is None:
        raise SystemExit(f"--llama-cpp {args.llama_cpp}: no llama-server there (build its `llama-server` target)")
    return [tool, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-np", str(args.agents), "-c", str(args.agents * SLOT_CONTEXT)]


def conversations(args: argparse.Namespace) -> tuple[str, list[str], list[list[str]]]:
    """The system prompt, each agent's task and its tool results, seeded."""
    from trajserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(args.model)
    rng = random.Random(0)
    results = [[tool_result(tok, rng, rng.randrange(50, 200)) for _ in range(args.turns)] for _ in range(args.agents)]
    return preamble(tok, 600), [task(i) for i in range(args.agents)], results


async def _agents(url: str, system: str, tasks: list[str], results: list[list[str]], reply_tokens: int) -> int:
    """Every agent's turns, all agents at once; returns the tokens written."""
    import httpx

    async def agent(i: int, client) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": tasks[i]}]
        written = 0
        for result in results[i]:
            r = await client.post(url + "/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": reply_tokens, "temperature": 0,
                "ignore_eos": True})
            r.raise_for_status()
            body = r.json()
            written += body["usage"]["completion_tokens"]
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""},
                         {"role": "user", "content": result}]
        return written

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]  # the name each server answers to
        return sum(await asyncio.gather(*(agent(i, client) for i in range(len(tasks)))))


def _one(engine: str, args: argparse.Namespace, threads: int, work) -> dict:
    port = _free_port()
    proc = subprocess.Popen(_server(engine, args, threads, port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        t = time.perf_counter()
        tokens = asyncio.run(_agents(url, *work, args.reply_tokens))
        return {"wall_s": time.perf_counter() - t, "tokens": tokens}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_agents(args: argparse.Namespace, threads: int) -> dict:
    """The agent load on both engines, rounds alternated; medians and their ratio."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    work = conversations(args)
    raw: dict[str, list[dict]] = {"trajserve": [], "llama.cpp": []}
    for r in range(args.rounds):
        for engine in (("trajserve", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "trajserve")):
            raw[engine].append(_one(engine, args, threads, work))
    wall = {e: statistics.median(x["wall_s"] for x in runs) for e, runs in raw.items()}
    return {"agents": args.agents, "turns": args.turns, "reply_tokens": args.reply_tokens, "wall_s": wall,
            "llama_cpp_over_trajserve": wall["llama.cpp"] / wall["trajserve"], "rounds_raw": raw}


def print_agents(r: dict) -> None:
    print(f"agent load: {r['agents']} agents x {r['turns']} turns, {r['reply_tokens']} tokens a reply, over HTTP")
    for e in ("trajserve", "llama.cpp"):
        print(f"  {e:10s} {r['wall_s'][e]:8.1f} s   (rounds: "
              + ", ".join(f"{x['wall_s']:.1f}" for x in r["rounds_raw"][e]) + ")")
    print(f"  llama.cpp's wall time / trajserve's: {r['llama_cpp_over_trajserve']:.2f}x")
