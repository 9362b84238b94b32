"""`bench peers --agents`: the agent load it drives, on trajserve's own
server (llama-server is not at hand in the suite)."""
import argparse

import pytest

from trajserve.bench import peer_agents


def _args(model, **kw) -> argparse.Namespace:
    return argparse.Namespace(**({"model": str(model), "agents": 3, "turns": 2, "reply_tokens": 5,
                                  "llama_cpp": "/nonexistent", "rounds": 1} | kw))


def test_the_conversations_are_the_same_for_both_engines(embedded_gguf):
    a, b = peer_agents.conversations(_args(embedded_gguf)), peer_agents.conversations(_args(embedded_gguf))
    assert a == b
    system, tasks, results = a
    assert len(tasks) == 3 and len(set(tasks)) == 3 and [len(r) for r in results] == [2, 2, 2]


def test_every_agent_writes_every_reply_in_full_on_trajserve(embedded_gguf):
    """3 agents x 2 turns x 5 tokens, EOS ignored: the wall time counts the same work on either engine."""
    args = _args(embedded_gguf)
    r = peer_agents._one("trajserve", args, 2, peer_agents.conversations(args))
    assert r["tokens"] == 3 * 2 * 5 and r["wall_s"] > 0


def test_no_llama_server_is_a_clear_error(embedded_gguf, tmp_path):
    with pytest.raises(SystemExit, match="no llama-server there"):
        peer_agents._server("llama.cpp", _args(embedded_gguf, llama_cpp=str(tmp_path)), 2, 8080)
