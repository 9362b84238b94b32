"""The README's examples (and the docs' command lines) work as written: a
new user copies them first.

Until these tests, `from trajserve import LLM, SamplingParams` (the README's
first line of Python) raised ImportError, because the package exported
nothing; every test imported from the submodules and never noticed. The
README's and docs/plan.md's first `plan` lines failed too (a shared prefix
longer than a context they asked about)."""
from __future__ import annotations

import json
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(client: bool) -> list[str]:
    """The README's Python blocks: the OpenAI-client ones (they need a
    server: tests/test_server.py runs them) or the offline ones."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if ("OpenAI(" in b) == client]


def test_the_readme_python_examples_run_as_written(capsys):
    blocks = python_blocks(client=False)
    assert len(blocks) >= 2, "README lost its Python examples"
    ns: dict = {}
    for block in blocks:  # one namespace: the sessions block uses the first block's `llm`
        exec(compile(block, str(README), "exec"), ns)
    printed = capsys.readouterr().out
    assert ns["outs"][0].outputs[0].text and ns["outs"][0].outputs[0].text in printed
    assert ns["reply"].outputs[0].token_ids  # the session's second turn
    assert isinstance(json.loads(ns["order"][0].outputs[0].text)["apples"], int)  # the structured example
    assert ns["d"].decision.value in {"keep", "host", "disk", "drop"} and ns["d"].reason in printed
    assert len(ns["kids"]) == 2
    assert ns["llm"].sessions is None  # the example ends with llm.close()


def test_the_package_exports_the_offline_api_and_nothing_else():
    import trajserve
    from trajserve import LLM, SamplingParams
    from trajserve.llm import LLM as LLM_
    from trajserve.sampling import SamplingParams as SP_

    assert LLM is LLM_ and SamplingParams is SP_
    assert set(trajserve.__all__) >= {"LLM", "SamplingParams"}
    try:
        trajserve.NoSuchThing
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def readme_commands(doc: Path = README) -> list[list[str]]:
    """Every `trajserve ...` line of a document's bash blocks (with its
    backslash continuations), as argv without the comments."""
    import shlex

    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip().removeprefix(".venv/bin/")
            if line.startswith("trajserve "):
                cmds.append(shlex.split(line)[1:])
    return cmds


def test_every_readme_and_docs_command_line_parses():
    """A flag renamed in the code and not in the docs fails here (argparse
    exits 2 naming it)."""
    from trajserve.cli import build_parser

    cmds = [c for doc in [README, *sorted(README.parent.glob("docs/*.md"))] for c in readme_commands(doc)]
    assert len(cmds) >= 30, "the docs lost their command examples"
    for argv in cmds:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # argparse's way of saying no
            raise AssertionError(f"README command does not parse: trajserve {' '.join(argv)}") from e
        assert args.command == argv[0]


def test_the_readme_plan_examples_run(capsys, tmp_path, monkeypatch):
    """The capacity examples answer in seconds, so they run, not only parse:
    the README's line failed on the first default context (8,192 tokens,
    under its 24,576-token shared prefix) and docs/plan.md's asked for it."""
    from trajserve.cli import main

    monkeypatch.chdir(tmp_path)  # --plot wall.png lands here
    plans = [argv for doc in (README, README.parent / "docs" / "plan.md") for argv in readme_commands(doc)
             if argv[0] == "plan" and "path/to/config.json" not in argv]  # that one names the reader's file
    assert len(plans) >= 4
    for argv in plans:
        assert main(argv) == 0, f"trajserve {' '.join(argv)}"
        out = capsys.readouterr().out
        answers = {"spec": "best draft length", "offload": "copy per round", "reads": "b_KV", "request": "TTFT",
                   "goodput": "R_good", "task": "saves nothing", "lora": "one adapter", "choose": "chosen: D"}
        if argv[1] in answers:  # a question beyond capacity: its own table
            assert answers[argv[1]] in out
        else:
            assert "m_token" in out and ("B max" in out or '"rows"' in out)
    assert {argv[1] for argv in plans} >= set(answers) and sum(argv[1] not in answers for argv in plans) >= 4
