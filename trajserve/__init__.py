"""trajserve: a serving engine for AI agents.

The offline API (README, "Python"): `from trajserve import LLM, SamplingParams`.
The names load on first use, so `trajserve plan` and the other commands that
need no model do not pay for importing torch (~3 s against ~0.2 s).
"""
from importlib import import_module

_EXPORTS = {"LLM": "trajserve.llm", "SamplingParams": "trajserve.sampling",
            "RequestOutput": "trajserve.outputs", "CompletionOutput": "trajserve.outputs",
            "StructuredOutput": "trajserve.structured"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trajserve' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
