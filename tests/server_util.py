"""Run `trajserve serve` in a subprocess on an ephemeral 127.0.0.1 port,
or the server's app in process over an engine (`served`)."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time

import httpx

from test_cli import _command


@contextlib.contextmanager
def served(engine, config):
    """A TestClient on the app over `engine` (its cache cleared), its engine
    loop running; the loop and the sessions shut down after."""
    from fastapi.testclient import TestClient

    from trajserve.server.app import build_app

    engine.kv.clear_cache()
    app = build_app(engine, config)
    app.state.engine.start()
    try:
        with TestClient(app) as c:
            yield c
    finally:
        app.state.engine.shutdown()
        app.state.sessions.shutdown()


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 180, tmpdir: str | None = None) -> None:
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if tmpdir is not None:  # where the server's temporary files go
            env["TMPDIR"] = tmpdir
        self.proc = subprocess.Popen([*_command(), "serve", "--port", "0", *args], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, env=env)
        self.url = self._wait_for_port(startup_timeout)
        # Drain stderr from here on: a server that logs more than a pipe holds (64 KiB) between two
        # stderr_so_far calls would otherwise block in write() mid-request, and its client wait forever.
        self._log: list[str] = []
        self._log_lock = threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        while True:  # the socket is bound before uvicorn listens on it
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("server did not become healthy")
            time.sleep(0.2)

    def _wait_for_port(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                if self.proc.poll() is not None:
                    raise RuntimeError("server exited:\n" + "".join(lines))
                continue
            lines.append(line)
            m = re.search(r"serving \S+ on (http://\S+)", line)
            if m:
                return m.group(1)
        raise RuntimeError("no 'serving' line:\n" + "".join(lines))

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def _drain(self) -> None:
        for line in self.proc.stderr:
            with self._log_lock:
                self._log.append(line)

    def stderr_so_far(self, settle: float = 0.2) -> str:
        """What the server has written to stderr since the last call (after
        `settle` seconds for the drain to catch up with lines just written)."""
        time.sleep(settle)
        with self._log_lock:
            text, self._log = "".join(self._log), []
        return text

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> int | None:
        """SIGTERM, as a process manager stops a server; the exit status (None: killed after 30 s)."""
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def agent_turns(call_id: str) -> list[dict]:
    """The chat messages of a short agent exchange (system, a user turn in
    two lines, a text + run_tests call, its result, a follow-up): what the
    translated APIs' tests render the same conversation against."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Run the tests\nin tests/."},
        {"role": "assistant", "content": "Running.", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "run_tests", "arguments": '{"path": "tests/"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "3 passed"},
        {"role": "user", "content": "Summarise."}]
