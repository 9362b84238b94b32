"""`trajserve serve`'s arguments; the work is in server/serve.py (one engine)
or cluster/launch.py (replicas), which trajserve/cli.py picks. Loads no
torch or web framework."""
from __future__ import annotations

import argparse

from trajserve.engine.options import add_engine_args
from trajserve.server.config import DEFAULT
from trajserve.server.tool_calls import FORMATS


def _slo(text: str):
    from trajserve.server.slo_choice import parse_slo

    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start-up)")
    s.add_argument("--allowed-origins", nargs="+", default=list(DEFAULT.allowed_origins), metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS; default: any, as vLLM)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model id clients send (default: the file's stem); more names are aliases, e.g. the "
                        "model names an Anthropic client sends to /v1/messages; a reply names the one its "
                        "request used")
    s.add_argument("--max-waiting", type=int, default=DEFAULT.max_waiting,
                   help="admission queue limit; a request beyond it gets 429 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT.max_body_bytes, help="request body cap (413 above it)")
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="/v1 routes want one of these keys (Authorization: Bearer KEY, or x-api-key: KEY); "
                        "default: $TRAJSERVE_API_KEY if set, else no key")
    s.add_argument("--api-key-priority", nargs="+", type=int, default=None, metavar="PRIORITY",
                   help="one per --api-key, in order: the priority a key's requests run at when they name none, "
                        "and the best (lowest) they may name (-1000..1000; --scheduling priority / program)")
    s.add_argument("--session-ttl", type=float, default=DEFAULT.sessions.idle_ttl_s, metavar="SECONDS",
                   help="close a session (and free its saved KV state) after this long without a turn, pause or "
                        "resume; 0: never")
    s.add_argument("--max-sessions", type=int, default=DEFAULT.sessions.max_sessions,
                   help="open session records; one more closes the least recently active (0: no limit)")
    s.add_argument("--idle-keep-factor", type=float, default=DEFAULT.sessions.idle_keep_factor, metavar="PHI",
                   help="a paused session's state stays on the device while its expected wait is under PHI host "
                        "round trips at an empty pool (one at the admission ceiling): the keep policy's "
                        "allowance (sessions/keep_policy.py)")
    s.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults for requests that name none, as vLLM's: temperature, top_p, top_k, "
                        "repetition_penalty; and max_new_tokens, a cap on every reply (e.g. '{\"temperature\": 0, "
                        "\"max_new_tokens\": 512}': greedy replies for harnesses that send no temperature)")
    s.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="the SLO's time to first token: /metrics counts the requests that meet it (goodput)")
    s.add_argument("--slo-itl-ms", type=float, default=None, metavar="MS",
                   help="the SLO's time between output tokens (a request's mean): goodput counts against it too")
    s.add_argument("--slo", type=_slo, default=None, metavar="requests=N,input=T,shared=T,output=T,deadline=S",
                   help="choose the configuration (KV format, prefix sharing, drafts by lookup) that meets this "
                        "deadline for a batch of N requests arriving together, as `plan choose` does, priced from "
                        "this engine's step times measured at start-up, and run it (also memory=BYTES: the KV "
                        "budget, default the pool's; lookup=TOKENS a round by lookup drafts, default 2; "
                        "drafts=N positions verified a round, default 4); the start-up line says why")
    s.add_argument("--admission", default="off", metavar="off|auto|N",
                   help="cap the requests the engine holds (running and queued); one more gets 429 with "
                        "Retry-After. auto: where goodput under the SLO starts to fall, from this engine's fitted "
                        "step times and its recent requests (needs --slo-ttft-ms or --slo-itl-ms; "
                        "`bench serve --sweep-rate` measures the knee from outside)")
    s.add_argument("--tool-call-parser", choices=("auto", *FORMATS), default=DEFAULT.tool_call_parser,
                   help="how the model writes tool calls (auto: from the chat template; Hermes <tool_call> "
                        "for Qwen, Llama 3's JSON form)")
    c = s.add_argument_group("replicas (Ray; pip install 'trajserve[cluster]')")
    c.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas as Ray actors behind one front end (each with its own KV pool "
                        "and tiers, sized by the engine options below)")
    c.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. auto, or HOST:6379); default: start a local Ray instance")
    c.add_argument("--router", default="kv", choices=("kv", "round-robin", "least-loaded", "char-prefix"),
                   help="which replica serves a request: kv (prefix directory vs load), or a baseline")
    c.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                   help="CPUs each replica reserves on Ray (its torch threads follow)")
    add_engine_args(s)
    return s
