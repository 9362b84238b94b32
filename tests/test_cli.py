"""The `trajserve` command in a subprocess: exit codes, stdout, error messages."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _command() -> list[str]:
    script = Path(sys.executable).parent / "trajserve"
    if script.exists():
        return [str(script)]
    found = shutil.which("trajserve")
    return [found] if found else [sys.executable, "-m", "trajserve.cli"]


def trajserve(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Idle OpenMP threads sleep instead of spinning: with other processes on
    # the 2 test cores, spinning threads make each step ~30x slower.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return subprocess.run([*_command(), *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env)


SMALL_POOL = ("--kv-cache-memory", "64MiB")


def test_generate():
    r = trajserve("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
                  *SMALL_POOL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no completion printed"
    assert r.stdout.endswith("\n")
    assert "KV cache" in r.stderr  # the startup summary goes to stderr, not into the completion
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, words", [
    (("--max-tokens", "0"), ["max_tokens", ">= 1", "0"]),
    (("--top-p", "1.5"), ["top_p", "(0, 1]", "1.5"]),
    (("--top-p", "0"), ["top_p", "(0, 1]"]),
    (("--temperature", "-1"), ["temperature", ">= 0"]),
    (("--max-prefill-chunk", "0"), ["max_prefill_chunk", "--max-prefill-chunk", ">= 1"]),  # was taken as unset
    (("--model", "/nonexistent"), ["/nonexistent"]),
    (("--model", "/nonexistent/model.gguf"), ["/nonexistent/model.gguf"]),
])
def test_bad_arguments_exit_2_with_a_message(args, words):
    r = trajserve("generate", "--prompt", "hi", *SMALL_POOL, *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert not r.stdout.strip()
    err = r.stderr
    assert "Traceback" not in err
    assert "error:" in err
    for w in words:
        assert w in err, (w, err)


def test_argparse_errors_exit_2():
    r = trajserve("generate", "--max-tokens", "8")  # --prompt is required
    assert r.returncode == 2 and "--prompt" in r.stderr


def test_chat_replies_and_quits_on_empty_line():
    r = trajserve("chat", "--max-tokens", "16", "--temperature", "0", *SMALL_POOL, stdin="Hello\n\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    # stdout: "> " prompt, the streamed reply, newline, "> " prompt (then the empty line quits).
    lines = r.stdout.split("\n")
    assert lines[0].startswith("> ")
    reply = lines[0][2:]
    assert reply.strip(), f"no reply in {r.stdout!r}"
    assert lines[-1] == "> "


def test_commands_without_a_model_do_not_import_torch():
    """Every command builds the whole parser; `plan` answers from arithmetic.
    The bench-resume parser imported torch at the top of its module, which
    made `trajserve plan` take ~4 s here instead of ~0.5 s."""
    code = ("import contextlib, io, sys\n"
            "from trajserve.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['plan', '--model', 'llama-3-8b', '--gpu', 'h200']) == 0\n"
            "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch" not in r.stdout, r.stdout


def test_bench_structured_prints_a_table_and_json():
    r = trajserve("bench", "structured", "--batch-sizes", "2", "--steps", "6", "--repeats", "1", *SMALL_POOL)
    assert r.returncode == 0, r.stderr
    table, js = r.stdout.split("{", 1)
    assert "step free" in table and "sampler json" in table
    (row,) = json.loads("{" + js)["rows"]
    assert row["batch"] == 2 and row["steps_free"] > 0 and row["steps_json"] > 0 and row["step_ratio"] > 0


def test_help_states_the_defaults():
    """Every subcommand's --help says what an option it leaves out is set to."""
    from trajserve.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command")  # noqa: SLF001
    texts = {name: parser.format_help() for name, parser in sub.choices.items()}
    serve = " ".join(texts["serve"].split())  # argparse wraps lines
    for words in ("--port PORT 0 picks a free port (printed at start-up) (default: 8000)",
                  "(default: 127.0.0.1)", "--max-waiting MAX_WAITING", "(default: 256)", "--block-size BLOCK_SIZE"):
        assert words in serve, words
    assert re.search(r"--block-size BLOCK_SIZE tokens per KV block [^-]*\(default: 16\)", serve), serve
    assert re.search(r"--no-prefix-caching disable the radix prefix cache --", serve)  # a flag: no default
    # Options with no default (None) or a flag (False) say nothing; none says it twice.
    assert "(default: None)" not in serve and "(default: False)" not in serve
    assert all(t.count("(default: default") == 0 for t in texts.values())
    bench = next(a for a in sub.choices["bench"]._actions if a.dest and a.choices)  # noqa: SLF001
    assert "(default:" in bench.choices["agent"].format_help()
