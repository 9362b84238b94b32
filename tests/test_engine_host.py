"""The sessions package reaches the engine only through EngineHost
(sessions/host.py): every engine member its modules touch is declared
there, and the engine has every member declared. Read with ast from the
source; the checker is checked on a planted snippet."""
from __future__ import annotations

import ast
import typing
from pathlib import Path

from trajserve.sessions.host import EngineHost

SESSIONS = Path(__file__).resolve().parents[1] / "trajserve" / "sessions"
DECLARED = set(typing.get_type_hints(EngineHost)) | {n for n in vars(EngineHost) if not n.startswith("_")}


def engine_members(source: str) -> set[str]:
    """X of every `engine.X`, `eng.X` or `<anything>.engine.X`."""
    def is_engine(v: ast.AST) -> bool:
        return (isinstance(v, ast.Name) and v.id in ("engine", "eng")) or \
            (isinstance(v, ast.Attribute) and v.attr == "engine")
    return {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and is_engine(n.value)}


def test_the_checker_sees_engine_members():
    assert engine_members("self.engine.kv.pin(x)\neng.step()\nengine.runner.copy\n") == {"kv", "step", "runner"}


def test_sessions_use_only_what_engine_host_declares():
    used = {}
    for path in sorted(SESSIONS.glob("*.py")):
        extra = engine_members(path.read_text()) - DECLARED
        if extra:
            used[path.name] = sorted(extra)
    assert not used, used


def test_the_engine_is_an_engine_host(engine_f32):
    missing = [m for m in sorted(DECLARED) if not hasattr(engine_f32, m)]
    assert not missing, missing
