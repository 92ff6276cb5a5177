"""`ostinato` command line: make-checkpoint, generate, serve, bench, bench-serve, verify, advise."""

from __future__ import annotations

import argparse
import logging
import sys

from .errors import OstinatoError


def _register_generate(sub) -> None:
    from .cli_args import add_engine_args

    p = sub.add_parser("generate", help="generate text for one or more prompts (offline)")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    import time

    from .cli_args import engine_args_from
    from .engine.llm import LLM
    from .sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sample_seed)
    llm = LLM.from_engine_args(engine_args_from(args))
    t0 = time.perf_counter()
    outs = llm.generate(args.prompt, params)
    dt = time.perf_counter() - t0
    for out in outs:
        c = out.outputs[0]
        print(f"--- prompt: {out.prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"--- {n} tokens in {dt:.2f} s; decode graphs: {llm.engine.graph_status}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ostinato", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    from .tools import checkpoint

    checkpoint.register(sub)
    _register_generate(sub)
    for module in ("ostinato.server.app", "ostinato.tools.bench", "ostinato.tools.bench_serve",
                   "ostinato.tools.verify", "ostinato.tools.advise"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError as e:  # a missing optional dependency must not hide the other commands
            logging.getLogger(__name__).debug("command module %s unavailable: %s", module, e)
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `ostinato bench serve ...` is spelled like vLLM's; it is the bench-serve command.
    if argv[:2] == ["bench", "serve"]:
        argv = ["bench-serve"] + argv[2:]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except OstinatoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
