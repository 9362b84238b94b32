"""The real agent clients, unchanged, against `trajserve serve` on the
embedded model: Codex CLI (`codex exec`, the Responses API) and Claude Code
(`claude -p`, the Messages API), pinned and installed from the npm registry.

Each runs a session of four model calls: a request whose greedy reply is a
shell call, which the client executes and answers, the reply to that result;
then the same again in a continued turn (`codex exec resume`, `claude
--continue`). Both stream. Neither sends a trajserve field: the server names
their conversations from their own APIs (Codex's prompt_cache_key, Claude
Code's metadata.user_id) and pauses them after each reply. The embedded
135M model calls a tool when shown how: tests/clients/demo_tool_calls.jinja
puts two worked calls before the first request, and the server's sampling
default is greedy (neither client sends a temperature)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from server_util import ServerProcess

pytestmark = pytest.mark.clients

CODEX = ("@openai/codex", "0.171.0", "codex")
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.197", "claude")
TEMPLATE = Path(__file__).parent / "clients" / "demo_tool_calls.jinja"
# The client flags a user of a small model would set: Claude Code with one
# tool and a short system prompt, Codex without its sub-agent, goal and image
# tools (their definitions alone would fill most of the 8K context).
CLAUDE_ARGS = ("--bare", "--tools", "Bash", "--allowedTools", "Bash", "--system-prompt", "You are a coding agent.",
               "--output-format", "stream-json", "--verbose")
CODEX_ARGS = ("--skip-git-repo-check", "--disable", "multi_agent", "--disable", "goals", "--disable", "view_image",
              "--json")
CALL_TIMEOUT_S = 300


def _installed(prefix: Path, package: str, version: str) -> bool:
    meta = prefix / "node_modules" / package / "package.json"
    return meta.is_file() and json.loads(meta.read_text()).get("version") == version


def _client(package: str, version: str, command: str) -> Path:
    """The client's executable, installed once into a cache directory
    ($TRAJSERVE_TEST_CLIENTS, else ~/.cache/trajserve/test-clients)."""
    root = Path(os.environ.get("TRAJSERVE_TEST_CLIENTS") or Path.home() / ".cache" / "trajserve" / "test-clients")
    prefix = root / f"{package.strip('@').replace('/', '-')}-{version}"
    if not _installed(prefix, package, version):
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: the real clients come from the npm registry")
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                               "--loglevel=error", f"{package}@{version}"], capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0 and _installed(prefix, package, version), \
            f"npm install {package}@{version} failed:\n{done.stderr[-2000:]}"
    return prefix / "node_modules" / ".bin" / command


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--served-model-name", "m", "--tool-prompt", "hermes", "--chat-template", str(TEMPLATE),
                       "--override-generation-config", '{"temperature": 0, "max_new_tokens": 256}') as s:
        yield s


def _errors(server: ServerProcess) -> dict[str, float]:
    """The server's 4xx and 5xx answers so far, by code."""
    return {k: v for k, v in server.metrics().items()
            if k.startswith("trajserve_http_responses_total") and not k.endswith('code="200"}') and v}


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _run(argv: list, cwd: Path, env: dict) -> list[dict]:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
    assert done.returncode == 0, f"{argv[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return _events(done.stdout)


def _session(server: ServerProcess, origin: str) -> dict:
    listed = httpx.get(server.url + "/v1/sessions", timeout=10).json()["data"]
    ours = [s for s in listed if s["origin"] == origin]
    assert len(ours) == 1, f"expected one {origin} conversation, got {listed}"
    return httpx.get(server.url + "/v1/sessions/" + ours[0]["id"], timeout=10).json()


def _check_session(s: dict, tool: str) -> None:
    """Four calls in one conversation; each after the first read >= 90 % of
    the previous call's context from the cache, and none broke the prefix;
    a pause per reply, the tool's ones answered (their resume observed the
    wait)."""
    hits = s["turn_hits"]
    assert s["turns"] == len(hits) == 4, s
    for before, turn in zip(hits, hits[1:]):
        context = before["prompt_tokens"] + before["output_tokens"]
        assert turn["cached_tokens"] >= 0.9 * context, (before, turn)
    pauses = s["pauses"]
    assert [p["waiting_for"] for p in pauses] == [tool, "(reply)", tool, "(reply)"], pauses
    assert all(p["decision"] in ("keep", "host", "disk", "drop") and p["reason"] for p in pauses), pauses
    assert all(p["waited_s"] is not None for p in pauses[:3]), pauses  # each resumed by the next call
    assert s["state"] == "paused" and s["waiting_for"] == "(reply)"
    assert s["prefix_breaks"] == []  # each call's prompt kept the previous context whole


def test_claude_code_runs_a_tool_and_a_continued_turn(server, tmp_path):
    claude = _client(*CLAUDE_CODE)
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir(), home.mkdir()
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": "m", "ANTHROPIC_SMALL_FAST_MODEL": "m", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    for argv, command, output in (([claude, "-p", "Run the shell command: echo hello"], "echo hello", "hello"),
                                  ([claude, "--continue", "-p", "Run the shell command: ls"], "ls", None)):
        events = _events_of(_run([*argv, *CLAUDE_ARGS], work, env))
        assert events["calls"] == [{"command": command}], events
        assert len(events["results"]) == 1 and not events["results"][0].get("is_error"), events
        if output is not None:
            assert events["results"][0]["content"] == output
        assert events["result"]["subtype"] == "success" and events["result"]["result"], events
    assert _errors(server) == {}
    _check_session(_session(server, "metadata.user_id"), "Bash")


def _events_of(events: list[dict]) -> dict:
    """Claude Code's stream-json: its tool calls' inputs, the tool results it sent back, the final result."""
    blocks = [(e["type"], b) for e in events if e.get("type") in ("assistant", "user")
              for b in (e["message"]["content"] if isinstance(e["message"]["content"], list) else [])]
    return {"calls": [b["input"] for t, b in blocks if t == "assistant" and b["type"] == "tool_use"],
            "results": [b for t, b in blocks if t == "user" and b["type"] == "tool_result"],
            "result": next(e for e in events if e.get("type") == "result")}


def test_codex_runs_a_tool_and_a_resumed_turn(server, tmp_path):
    codex = _client(*CODEX)
    work, home = tmp_path / "work", tmp_path / "codex-home"
    work.mkdir(), home.mkdir()
    (home / "config.toml").write_text(
        'model = "m"\nmodel_provider = "trajserve"\n\n[model_providers.trajserve]\nname = "trajserve"\n'
        f'base_url = "{server.url}/v1"\nwire_api = "responses"\n')
    env = {"CODEX_HOME": str(home), "OPENAI_API_KEY": "unused"}
    for argv, command, output in (([codex, "exec", *CODEX_ARGS, "Run the shell command: uname"], "uname", "Linux"),
                                  ([codex, "exec", *CODEX_ARGS, "resume", "--last", "Run the shell command: ls"],
                                   "ls", None)):
        events = _run(argv, work, env)
        runs = [e["item"] for e in events if e.get("type") == "item.completed"
                and e["item"]["type"] == "command_execution"]
        assert len(runs) == 1 and runs[0]["command"].endswith(f" {command}") and runs[0]["exit_code"] == 0, events
        if output is not None:
            assert runs[0]["aggregated_output"].strip() == output
        replies = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                   and e["item"]["type"] == "agent_message"]
        assert len(replies) == 1 and replies[0], events
        assert any(e.get("type") == "turn.completed" for e in events), events
    assert _errors(server) == {}
    _check_session(_session(server, "prompt_cache_key"), "exec_command")
