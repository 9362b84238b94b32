"""`trajserve` command: generate, chat, serve (one engine, or replicas on Ray),
bench, plan, simulate, calibrate."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from trajserve.bench.cli import add_bench_parser
from trajserve.engine.options import add_engine_args
from trajserve.sampling import SamplingParams
from trajserve.server.cli import add_serve_parser


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set of this much mass")
    g.add_argument("--top-k", type=int, default=0, help="the k likeliest tokens only (0: off)")
    g.add_argument("--sampling-seed", type=int, default=None, help="this request's seed (default: from --seed)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages prompt and output tokens")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], per occurrence in the output")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], once per token in the output")


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed, stop=list(args.stop),
                          repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty)


def cmd_generate(args: argparse.Namespace) -> int:
    sp = sampling_from(args)  # bad sampling values fail before the model loads
    from trajserve.llm import LLM

    llm = LLM.from_args(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    out = None
    for out in llm.stream(prompt, sp):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if out is not None and args.verbose:
        m = out.metrics
        c = out.outputs[0]
        print(f"[{len(c.token_ids)} tokens, finish={c.finish_reason}, TTFT {m.ttft * 1e3:.0f} ms]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    sp = sampling_from(args)
    from trajserve.llm import LLM

    llm = LLM.from_args(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("trajserve chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)  # end the prompt's line
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = llm.tokenizer.encode_chat(messages)
        reply = ""
        for out in llm.stream(ids, sp):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            reply = out.outputs[0].text
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from trajserve.server import log_guard

    if args.slo is not None and (args.replicas is not None or args.ray_address is not None):
        raise ValueError("--slo chooses one engine's configuration: it does not take --replicas / --ray-address")
    # Before anything logs: a slow or full stderr must never stall serving.
    log_guard.install(logging.getLogger().level)
    if args.replicas is not None or args.ray_address is not None:
        from trajserve.cluster.launch import serve_cluster

        return serve_cluster(args)
    from trajserve.server.serve import serve

    return serve(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from trajserve.sim.cli import check_args, run_simulation

    check_args(args)
    if not args.validate:
        return run_simulation(args)
    if args.replicas > 1:
        raise ValueError("--validate predicts one engine: it does not take --replicas")
    from trajserve.bench.validate import run  # measures bench agent on this engine

    return run(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from trajserve.commands.doctor import run

    return run(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from trajserve.bench.calibrate import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajserve", description="A serving engine for AI agents")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print it")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    add_serve_parser(sub).set_defaults(func=cmd_serve)
    add_bench_parser(sub)

    from trajserve.commands.plan import add_plan_parser  # arithmetic only: imports no torch
    add_plan_parser(sub.add_parser("plan", help="closed-form capacity: how many trajectories fit a node"))
    from trajserve.sim.cli import add_calibrate_parser, add_simulate_parser  # imports no torch
    s = sub.add_parser("simulate", help="the real scheduler + KV cache on a cost model: latency, hit rate, U_KV")
    add_simulate_parser(s)
    s.set_defaults(func=cmd_simulate)
    c = sub.add_parser("calibrate", help="measure this machine's engine; write a hardware profile for simulate")
    add_calibrate_parser(c)
    c.set_defaults(func=cmd_calibrate)
    from trajserve.commands.doctor import add_doctor_parser  # imports no torch
    d = sub.add_parser("doctor", help="why a harness's requests miss the prefix cache: breaks in a request log")
    add_doctor_parser(d)
    d.set_defaults(func=cmd_doctor)
    _show_defaults(p)
    return p


class _DefaultsHelp(argparse.HelpFormatter):
    """--help states each option's default (as ArgumentDefaultsHelpFormatter),
    except where it has none or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not _has_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _has_default(action: argparse.Action) -> bool:
    """An option whose default is worth stating (not a flag, not unset)."""
    d = action.default
    return bool(action.option_strings) and action.nargs != 0 and d is not None and d != [] \
        and d is not argparse.SUPPRESS


def _show_defaults(p: argparse.ArgumentParser) -> None:
    p.formatter_class = _DefaultsHelp
    for action in p._actions:  # noqa: SLF001 - argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for child in action.choices.values():
                _show_defaults(child)
        elif not action.help and _has_default(action):
            action.help = "default: %(default)s"  # argparse prints nothing for an option without help


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if not getattr(args, "json", False) else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader left (`trajserve plan ... | head`): nothing more to say,
        # and Python's exit-time flush of stdout must not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
