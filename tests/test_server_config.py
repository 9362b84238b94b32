"""ServerConfig and SessionConfig: one home per default, checked when made,
and the server wired from them at construction."""
import pytest

from trajserve.cli import build_parser
from trajserve.server.config import ServerConfig
from trajserve.sessions.config import SessionConfig


def _serve(*flags):
    return build_parser().parse_args(["serve", *flags])


def test_the_flags_defaults_are_the_configs(monkeypatch):
    monkeypatch.delenv("TRAJSERVE_API_KEY", raising=False)
    assert ServerConfig.from_args(_serve()) == ServerConfig()
    # The server closes idle sessions and caps them; the library does neither.
    assert ServerConfig().sessions == SessionConfig(idle_ttl_s=3600.0, max_sessions=4096)
    assert SessionConfig().idle_ttl_s is None and SessionConfig().max_sessions is None


def test_flags_reach_the_config(monkeypatch):
    monkeypatch.setenv("TRAJSERVE_API_KEY", "from-env")
    c = ServerConfig.from_args(_serve("--max-waiting", "3", "--max-body-bytes", "1000", "--session-ttl", "0",
                                      "--max-sessions", "0", "--served-model-name", "a", "b",
                                      "--allowed-origins", "http://x", "--tool-call-parser", "hermes",
                                      "--idle-keep-factor", "250"))
    assert (c.max_waiting, c.max_body_bytes, c.served_model_names, c.allowed_origins, c.tool_call_parser) == \
        (3, 1000, ("a", "b"), ("http://x",), "hermes")
    assert c.sessions.idle_ttl_s is None and c.sessions.max_sessions is None  # 0: never / no limit
    assert c.sessions.idle_keep_factor == 250
    assert c.api_keys == ("from-env",)
    assert ServerConfig.from_args(_serve("--api-key", "k1", "k2")).api_keys == ("k1", "k2")
    assert c.names_for("/m/SmolLM2.Q4_1.gguf") == ["a", "b"]
    assert ServerConfig().names_for("/m/SmolLM2.Q4_1.gguf") == ["SmolLM2.Q4_1"]
    assert ServerConfig().names_for("/m/Qwen3-0.6B") == ["Qwen3-0.6B"]


@pytest.mark.parametrize("flags, named", [
    (("--max-waiting", "0"), "--max-waiting"), (("--max-body-bytes", "0"), "--max-body-bytes"),
    (("--session-ttl", "-1"), "--session-ttl"), (("--session-ttl", "inf"), "--session-ttl"),
    (("--max-sessions", "-1"), "--max-sessions"), (("--api-key", ""), "--api-key")])
def test_bad_flags_are_refused_by_name(flags, named):
    with pytest.raises(ValueError, match=named):
        ServerConfig.from_args(_serve(*flags))


@pytest.mark.parametrize("kw, named", [
    ({"prefetch_fraction": 1.5}, "prefetch_fraction"), ({"host_bytes": -1}, "host_bytes"),
    ({"disk_bytes": 1.5}, "disk_bytes"), ({"idle_ttl_s": 0}, "idle_ttl_s"), ({"max_sessions": 0}, "max_sessions"),
    ({"idle_keep_factor": 0.5}, "idle_keep_factor")])
def test_session_config_checks_its_values(kw, named):
    with pytest.raises(ValueError, match=named):
        SessionConfig(**kw)


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        ServerConfig().max_waiting = 1
    with pytest.raises(AttributeError):
        SessionConfig().host_bytes = 1


def test_the_app_is_wired_at_construction(engine_f32):
    """build_app makes the AsyncEngine with its callbacks and the session
    manager from the config; nothing is set on them afterwards."""
    from trajserve.server.app import build_app

    config = ServerConfig(served_model_names=("m",), max_waiting=7,
                          sessions=SessionConfig(idle_ttl_s=60.0, max_sessions=5, idle_keep_factor=300.0))
    app = build_app(engine_f32, config)
    try:
        ae, st = app.state.engine, app.state.server
        assert ae.max_waiting == 7 and ae.on_finished == st.metrics.observe
        assert ae.extra_metrics() == {"sessions": app.state.sessions.metrics()}
        assert app.state.sessions.config is config.sessions
        assert (app.state.sessions.idle_ttl_s, app.state.sessions.max_sessions) == (60.0, 5)
        assert app.state.sessions.policy.idle_keep_factor == 300.0
        assert st.names == ["m"]
    finally:
        app.state.sessions.shutdown()
