"""ServerConfig: the HTTP server's options, one home for their defaults
(server/cli.py reads its flags' defaults from here) and their checks.
Imports no torch or web framework: the CLI and the cluster front end read it."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from trajserve.server.admission_limit import parse_admission
from trajserve.server.generation_defaults import GenerationDefaults
from trajserve.server.key_priority import check_key_priorities
from trajserve.sessions.config import SessionConfig


def _server_sessions() -> SessionConfig:
    # An HTTP client that sends a session_id need not DELETE it: the server
    # closes idle records and caps their number, the library does neither.
    return SessionConfig(idle_ttl_s=3600.0, max_sessions=4096)


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...] = ()  # empty: the model file's stem; more names are aliases
    max_waiting: int = 256  # admission queue limit: 429 beyond it
    max_body_bytes: int = 8 * 2**20  # 413 above it
    api_keys: tuple[str, ...] | None = None  # /v1 routes want one of them (server/auth.py)
    # Each key's default and best priority, in the keys' order (server/key_priority.py).
    api_key_priorities: tuple[int, ...] | None = None
    allowed_origins: tuple[str, ...] = ("*",)  # CORS (vLLM's default: any)
    tool_call_parser: str = "auto"  # how the model writes tool calls (server/state.py calls_format_for)
    sessions: SessionConfig = field(default_factory=_server_sessions)
    generation: GenerationDefaults = GenerationDefaults()  # sampling defaults and the reply cap
    # The SLO goodput counts against (server/goodput.py): None, no target.
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    # A cap on the requests in the engine (server/admission_limit.py): off, auto (the SLO's knee) or a number.
    admission: str | int = "off"

    def __post_init__(self) -> None:
        if not isinstance(self.max_waiting, int) or self.max_waiting < 1:
            raise ValueError(f"--max-waiting must be >= 1, got {self.max_waiting}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        for flag, v in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-itl-ms", self.slo_itl_ms)):
            if v is not None and not (0 < v < float("inf")):
                raise ValueError(f"{flag} must be a positive number of milliseconds, got {v}")
        parse_admission(self.admission, self.slo_ttft_ms, self.slo_itl_ms)
        if self.api_keys is not None and not all(self.api_keys):
            raise ValueError("--api-key: a key must not be empty")
        check_key_priorities(self.api_keys, self.api_key_priorities)

    def names_for(self, model_path: str) -> list[str]:
        """The model ids clients send; the first is the one replies name."""
        p = Path(model_path)
        return list(self.served_model_names) or [p.stem if p.suffix == ".gguf" else p.name]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """`trajserve serve`'s flags (server/cli.py); the API keys default to
        $TRAJSERVE_API_KEY. --session-ttl 0 / --max-sessions 0: never / no limit."""
        if not 0 <= args.session_ttl < float("inf"):
            raise ValueError(f"--session-ttl must be a finite number of seconds >= 0 (0: never), "
                             f"got {args.session_ttl}")
        if args.max_sessions < 0:
            raise ValueError(f"--max-sessions must be >= 0 (0: no limit), got {args.max_sessions}")
        keys = args.api_key or ([os.environ["TRAJSERVE_API_KEY"]] if os.environ.get("TRAJSERVE_API_KEY") else None)
        return cls(served_model_names=tuple(args.served_model_name or ()), max_waiting=args.max_waiting,
                   max_body_bytes=args.max_body_bytes, api_keys=tuple(keys) if keys is not None else None,
                   api_key_priorities=tuple(args.api_key_priority) if args.api_key_priority else None,
                   allowed_origins=tuple(args.allowed_origins), tool_call_parser=args.tool_call_parser,
                   generation=GenerationDefaults.parse(args.override_generation_config),
                   slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms,
                   admission=parse_admission(args.admission, args.slo_ttft_ms, args.slo_itl_ms),
                   sessions=SessionConfig(idle_ttl_s=args.session_ttl or None, max_sessions=args.max_sessions or None,
                                          idle_keep_factor=args.idle_keep_factor))


DEFAULT = ServerConfig()
