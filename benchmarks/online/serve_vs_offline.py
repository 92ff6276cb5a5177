"""Server vs offline on the same work: output tokens/s of `LLM.generate` and of `ostinato serve` under
`ostinato bench serve`, then under the independent client benchmarks/online/aiohttp_client.py, and their ratios
(the goal: the server within 5% of offline).

Both runs use the same prompts (bench serve's random token ids), greedy, ignore_eos, exactly --output-len
tokens each, and the same engine flags (everything after `--`), the step policy included: unless the flags set
--max-prefill-tokens-while-decoding, LLM.generate runs with the server's default cap, not uncapped as the offline
API defaults to (--offline-own-policy measures that instead). Each runs in its own process, one after the other,
so they never share a GPU or a GIL; the load generator runs in this process. Every phase is logged with its start
time, bench serve shows its progress, and a load run past --load-timeout stops with what the server still holds.

On a GPU (the measurement in docs/PERFORMANCE.md):

    ostinato make-checkpoint /tmp/ck-qwen3-0.6b --shape qwen3-0.6b --dtype bfloat16
    PYTHONPATH=src python3 benchmarks/online/serve_vs_offline.py /tmp/ck-qwen3-0.6b -- --max-num-seqs 64 \
        --max-model-len 1024

CPU, with the forward replaced by a no-op (tools/bench/noop_forward.py: the Python around the model, server and offline
alike), acting as an asynchronous GPU step of --noop-forward-ms (0: the host's ceiling):

    PYTHONPATH=src python benchmarks/online/serve_vs_offline.py /tmp/ck-tiny --noop-forward --noop-forward-ms 3 -- \\
        --device cpu --dtype float32 --max-num-seqs 64 --max-model-len 1024 --num-kv-blocks 4096

Each run also prints the garbage collections the server's front and engine core ran while bench serve loaded
them (how many of each generation, their total and longest pause): a full collection stops every stream.

`--profile DIR` runs the server's event loop, its engine core and the load generator under cProfile and prints
where each spends its time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def _child_offline(ns, engine_argv: list[str]) -> None:
    from ostinato.engine.llm import LLM
    from ostinato.sampling_params import SamplingParams
    from ostinato.tools.bench.serve import make_prompts

    llm = LLM.from_engine_args(_offline_engine_args(ns.model, engine_argv, ns.offline_own_policy))
    if ns.noop_forward:
        from ostinato.tools.bench import noop_forward

        noop_forward.install(llm.engine, ns.noop_forward_ms)
    prompts = make_prompts(_bench_config(ns))
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up, as bench serve sends one request first
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    duration, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(json.dumps({"output_tokens": tokens, "duration_s": duration, "output_throughput": tokens / duration,
                      "cpu_s": cpu,
                      "prefill_tokens_while_decoding": llm.engine.scheduler_config.max_prefill_tokens_while_decoding}))


def _offline_engine_args(model: str, engine_argv: list[str], own_policy: bool):
    """The offline run's EngineArgs from the server's flags. Unless own_policy or the flags set it, with the
    server's cap on a decoding step's prompt tokens, so both sides run one step policy (LLM alone leaves the
    step uncapped: docs/PERFORMANCE.md says what each buys)."""
    from dataclasses import replace

    from ostinato.cli_args import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = engine_args_from(p.parse_args([model, *engine_argv]))
    if own_policy:
        return args
    return replace(args, max_prefill_tokens_while_decoding=args.prefill_tokens_while_decoding())  # given, or the rule


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, from /proc (Linux); {} elsewhere."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    except OSError:
        pass
    return out


def _cpu_report(pid: int, before: dict[int, float], after: dict[int, float], tokens: int) -> str:
    """CPU ms per 1,000 output tokens, per busy thread of the server (and its children, e.g. an engine core
    process), so one can see which thread bounds the throughput."""
    used = sorted(((after[t] - before.get(t, 0.0), t) for t in after), reverse=True)
    parts = [f"{'main' if t == pid else t}: {1e6 * s / max(tokens, 1):.0f}" for s, t in used[:4] if s > 0]
    return "CPU ms per 1k output tokens by server thread: " + ", ".join(parts)


def _profiled_engine(args, factory, path: str):
    """Build the engine with `factory` and profile the engine core's loop (its main thread) with cProfile until
    the process exits (module-level: spawn pickles it into the core process)."""
    import atexit
    import cProfile

    engine = factory(args)
    profile = cProfile.Profile()
    atexit.register(lambda: (profile.disable(), profile.dump_stats(path)))
    profile.enable()
    return engine


def _record_gc_pauses(path: str) -> None:
    """Log every collection of Python's garbage collector in this process (when it ended, its generation, its
    length) and write the log to `path` as JSON at exit: a full collection stops every stream of the server."""
    import atexit
    import gc

    pauses, began = [], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((time.monotonic(), info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(on_gc)

    def write() -> None:
        with open(path, "w") as f:
            json.dump(pauses, f)

    atexit.register(write)


def _gc_logged_engine(args, factory, path: str):
    """Build the engine with `factory` in the engine core process, logging its collections (module-level: spawn
    pickles it into the core process)."""
    _record_gc_pauses(path)
    return factory(args)


def _gc_report(path: str, start: float, end: float) -> str:
    """The collections a process logged between start and end (time.monotonic, one clock for all processes)."""
    try:
        with open(path) as f:
            pauses = [(gen, length) for at, gen, length in json.load(f) if start <= at <= end]
    except OSError:
        return "no log"
    parts = []
    for gen in (0, 1, 2):
        lengths = [1e3 * length for g, length in pauses if g == gen]
        if lengths:
            parts.append(f"gen{gen} {len(lengths)} x, {sum(lengths):.0f} ms in all, longest {max(lengths):.1f} ms")
    return "; ".join(parts) or "none"


def _child_serve(ns, engine_argv: list[str]) -> None:
    import functools
    import logging

    from ostinato.cli import build_parser
    from ostinato.engine.core_process import build_engine
    from ostinato import serve_command
    from ostinato.tools.bench import noop_forward

    logging.basicConfig(level="WARNING")
    serve_ns = build_parser().parse_args(["--log-level", "WARNING", "serve", ns.model, "--port", str(ns.port),
                                          "--host", "127.0.0.1", *engine_argv]
                                         + (["--engine-thread"] if ns.engine_thread else [])
                                         + ["--loop", ns.server_loop])
    factory = functools.partial(noop_forward.build_engine, step_ms=ns.noop_forward_ms) if ns.noop_forward \
        else build_engine
    if ns.profile and not ns.engine_thread:
        factory = functools.partial(_profiled_engine, factory=factory, path=f"{ns.profile}/core.prof")
    _record_gc_pauses(f"{ns.gc_log}/front.json")
    if not ns.engine_thread:
        factory = functools.partial(_gc_logged_engine, factory=factory, path=f"{ns.gc_log}/core.json")
    profile = None
    if ns.profile:  # the server's main thread: the event loop (HTTP, JSON, streams)
        import cProfile

        profile = cProfile.Profile()
    try:
        sys.exit(profile.runcall(serve_command.run, serve_ns, engine_factory=factory) if profile
                 else serve_command.run(serve_ns, engine_factory=factory))
    except KeyboardInterrupt:  # how main() stops this child (uvicorn re-raises the SIGINT once it has shut down)
        sys.exit(0)
    finally:
        if profile is not None:
            profile.dump_stats(f"{ns.profile}/front.prof")


def _bench_config(ns):
    from ostinato.tools.bench.serve import BenchConfig

    return BenchConfig(base_url=f"http://127.0.0.1:{ns.port}", num_prompts=ns.num_prompts,
                       max_concurrency=ns.max_concurrency, input_len=ns.input_len, output_len=ns.output_len)


def _children(pid: int) -> list[int]:
    """Processes the server started (an engine core), children of its process or its descendants."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        found += kids
        frontier += kids
    return found


def _metric(port: int, name: str) -> float:
    """The sum of a metric's samples (all its labels) on the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"ostinato:{name}{{") or line.startswith(f"ostinato:{name} "))


def _decode_steps(port: int) -> int:
    """Decode steps the server ran so far (graph + eager)."""
    return int(_metric(port, "decode_steps_total"))


def _server_state(port: int) -> str:
    """What the server holds now, for a load run that did not end in time."""
    try:
        return (f"{_metric(port, 'num_requests_running'):.0f} requests running, "
                f"{_metric(port, 'num_requests_waiting'):.0f} waiting, {_decode_steps(port)} decode steps so far")
    except OSError as e:
        return f"/metrics did not answer ({e})"


def _host_limits() -> str:
    """The limits many concurrent connections meet: the listen backlog cap and the open-file limit."""
    import resource

    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            somaxconn = f.read().strip()
    except OSError:
        somaxconn = "?"
    return (f"host: {os.cpu_count()} CPUs, net.core.somaxconn {somaxconn}, open files "
            f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}")


def _wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s")


def main() -> int:
    from ostinato.serve_command import EVENT_LOOPS

    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--noop-forward", action="store_true", help="replace the model step by a no-op (CPU runs)")
    p.add_argument("--noop-forward-ms", type=float, default=0.0,
                   help="with --noop-forward: each step sleeps this long, like a GPU forward (e.g. 3.5)")
    p.add_argument("--engine-thread", action="store_true",
                   help="serve with the engine on a thread of the server's process (serve --engine-thread)")
    p.add_argument("--server-loop", choices=EVENT_LOOPS, default="auto",
                   help="the server's event loop (serve --loop)")
    p.add_argument("--profile", metavar="DIR",
                   help="cProfile the server's event loop (DIR/front.prof), its engine core (DIR/core.prof) and "
                        "the load generator (DIR/client.prof), and print where each spends its time")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--no-independent-client", dest="independent_client", action="store_false",
                   help="skip the second load run, by benchmarks/online/aiohttp_client.py, on the same server")
    p.add_argument("--summary-json", metavar="PATH",
                   help="write offline, bench serve and the independent client's figures here as one JSON object")
    p.add_argument("--offline-own-policy", action="store_true",
                   help="run LLM.generate at the offline API's own default (no cap on a decoding step's prompt "
                        "tokens) instead of the server's step policy")
    p.add_argument("--load-timeout", type=float, default=600.0,
                   help="seconds each load run (bench serve, then the independent client) may take; past it the "
                        "run stops and says what the server still holds")
    p.add_argument("--gc-log", help=argparse.SUPPRESS)  # the folder the server's processes log collections to
    p.add_argument("--child", choices=["offline", "serve"], help=argparse.SUPPRESS)
    ns = p.parse_args(own)
    if ns.child == "offline":
        _child_offline(ns, engine_argv)
        return 0
    if ns.child == "serve":
        _child_serve(ns, engine_argv)
        return 0

    me = [sys.executable, os.path.abspath(__file__), *own]
    if ns.profile:
        os.makedirs(ns.profile, exist_ok=True)
        ns.profile = os.path.abspath(ns.profile)
        me += ["--profile", ns.profile]  # the server child profiles itself and its engine core
    import atexit
    import shutil
    import tempfile

    gc_log = tempfile.mkdtemp(prefix="serve-vs-offline-gc-")
    atexit.register(shutil.rmtree, gc_log, True)  # however the run ends (its reports read it before)
    me += ["--gc-log", gc_log]
    t0 = time.monotonic()

    def phase(what: str) -> None:  # each phase timed, so a run cut short by an outer bound shows where it was
        print(f"[{time.monotonic() - t0:6.1f} s] {what}", flush=True)

    phase(_host_limits())
    phase(f"LLM.generate starts (engine flags: {' '.join(engine_argv)})")
    res = subprocess.run([*me, "--child", "offline", "--", *engine_argv], check=True, stdout=subprocess.PIPE,
                         text=True)
    offline = json.loads(res.stdout.strip().splitlines()[-1])
    offline["engine_argv"] = engine_argv
    phase(f"LLM.generate: {offline['output_tokens']} tokens in {offline['duration_s']:.2f} s = "
          f"{offline['output_throughput']:.0f} output tok/s (a decoding step carried at most "
          f"{offline['prefill_tokens_while_decoding']} prompt tokens)")

    phase(f"the server starts (engine flags: {' '.join(engine_argv)})")
    server = subprocess.Popen([*me, "--child", "serve", "--", *engine_argv])
    try:
        _wait_healthy(ns.port, server, ns.startup_timeout)
        phase("the server is ready; bench serve starts")
        from ostinato.tools.bench.serve import format_table

        asyncio.run(_bounded_load(ns, warm_up=True))  # apart, so that the counts below are the run's alone
        pids = [server.pid, *_children(server.pid)]
        before = {pid: _thread_cpu(pid) for pid in pids}
        steps_before, hits_before = _decode_steps(ns.port), _metric(ns.port, "prefix_cache_hits_total")
        client_cpu, load_began = time.process_time(), time.monotonic()
        if ns.profile:
            import cProfile

            profile = cProfile.Profile()
            summary = profile.runcall(asyncio.run, _bounded_load(ns))
            profile.dump_stats(f"{ns.profile}/client.prof")
        else:
            summary = asyncio.run(_bounded_load(ns))
        client_cpu, load_ended = time.process_time() - client_cpu, time.monotonic()
        phase(f"bench serve done: {summary['completed']} requests, {summary['failed']} failed; the server so far: "
              f"{_metric(ns.port, 'num_preemptions_total'):.0f} preemptions, "
              f"{_metric(ns.port, 'kernel_compiles_in_service_total'):.0f} kernel compiles in service")
        steps = _decode_steps(ns.port) - steps_before
        cpu_lines = [_cpu_report(pid, before[pid], _thread_cpu(pid), summary["total_output_tokens"])
                     for pid in pids]
        summary["prefix_cache_hit_tokens"] = _metric(ns.port, "prefix_cache_hits_total") - hits_before
        independent = None
        if ns.independent_client:
            hits_before = _metric(ns.port, "prefix_cache_hits_total")
            independent = _independent_client(ns)
            independent["prefix_cache_hit_tokens"] = _metric(ns.port, "prefix_cache_hits_total") - hits_before
            phase(f"the independent client done: {independent['completed']} requests, {independent['failed']} "
                  "failed")
    finally:
        # uvicorn re-raises the signal once it has shut down: SIGINT's KeyboardInterrupt lets the server child's
        # `finally` blocks run (they stop the engine core and write the profiles); SIGTERM would end it there.
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    print(format_table(summary))
    if steps:
        print(f"server: {steps} decode steps, {summary['total_output_tokens'] / steps:.1f} output tokens per "
              "decode step (prefill steps give a token each too)")
    print(f"offline CPU ms per 1k output tokens: {1e6 * offline['cpu_s'] / offline['output_tokens']:.0f}")
    for pid, line in zip(pids, cpu_lines):
        print(f"pid {pid}: {line}")
    for process in ("front", "core"):  # written at their exit: after server.wait above
        print(f"garbage collections in the server's {process} during bench serve: "
              f"{_gc_report(f'{gc_log}/{process}.json', load_began, load_ended)}")
    print(f"prompt tokens found in the prefix cache: bench serve {summary['prefix_cache_hit_tokens']:.0f}"
          + (f", the independent client {independent['prefix_cache_hit_tokens']:.0f}" if independent else ""))
    print(f"the load generator (bench serve, this process): "
          f"{1e6 * client_cpu / max(summary['total_output_tokens'], 1):.0f} CPU ms per 1k output tokens")
    ratio = summary["output_throughput"] / offline["output_throughput"]
    print(f"\nLLM.generate {offline['output_throughput']:.0f} tok/s | server {summary['output_throughput']:.0f} "
          f"tok/s (median ITL {summary['itl_ms']['median']:.2f} ms) | server/offline = {ratio:.2f} "
          f"(goal >= 0.95)")
    if independent is not None:
        print(f"independent client (aiohttp): {independent['output_throughput']:.0f} tok/s, "
              f"{independent['output_tokens']} tokens in {independent['chunks']} chunks, ITL median "
              f"{independent['itl_ms']['median']:.2f} ms, p99 {independent['itl_ms']['p99']:.2f} ms | "
              f"server/offline = {independent['output_throughput'] / offline['output_throughput']:.2f}")
        # One event loop parses every chunk: near 100% busy, the client (not the server) bounds its figure.
        print(f"the independent client's own CPU: {1e6 * independent['cpu_s'] / max(independent['chunks'], 1):.1f} "
              f"us per chunk, {independent['cpu_s'] / independent['duration_s']:.0%} of its wall time")
    if ns.summary_json:
        with open(ns.summary_json, "w") as f:
            json.dump({"offline": offline, "bench_serve": summary, "independent": independent}, f)
    if ns.profile:
        _print_profiles(ns.profile)
    failed = summary["failed"] + (independent["failed"] if independent is not None else 0)
    return 0 if failed == 0 else 1


async def _bounded_load(ns, warm_up: bool = False) -> dict:
    """bench serve's run (with its progress bar on stderr), or its warm-up request alone, stopped after
    --load-timeout seconds with what the server still holds."""
    from dataclasses import replace

    from ostinato.tools.bench.serve import run_benchmark

    cfg = replace(_bench_config(ns), num_warmups=0)
    if warm_up:
        cfg = replace(cfg, num_prompts=1)
    run = asyncio.ensure_future(run_benchmark(cfg, progress=not warm_up))
    done, _ = await asyncio.wait({run}, timeout=ns.load_timeout)
    if not done:  # the state first: cancelling the run closes its connections, which aborts their requests
        state = _server_state(ns.port)
        run.cancel()
        raise SystemExit(f"bench serve did not finish within --load-timeout {ns.load_timeout:g} s; the server "
                         f"holds {state}")
    return run.result()


def _independent_client(ns) -> dict:
    """The same work again, loaded by benchmarks/online/aiohttp_client.py (no ostinato code) in its own process.
    Its prompts are drawn with another seed: the same prompts as bench serve's would find all their blocks in the
    prefix cache that run filled, and skip the prefill that bench serve and LLM.generate paid for."""
    client = os.path.join(os.path.dirname(os.path.abspath(__file__)), "aiohttp_client.py")
    try:
        res = subprocess.run([sys.executable, client, "--base-url", f"http://127.0.0.1:{ns.port}", "--json",
                              "--num-prompts", str(ns.num_prompts), "--input-len", str(ns.input_len),
                              "--output-len", str(ns.output_len), "--max-concurrency", str(ns.max_concurrency),
                              "--seed", "1"],
                             stdout=subprocess.PIPE, text=True, timeout=ns.load_timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the independent client did not finish within --load-timeout {ns.load_timeout:g} s; "
                         f"the server holds {_server_state(ns.port)}") from None
    if res.returncode != 0:
        raise SystemExit(f"the independent client exited {res.returncode} (its error is above; it needs aiohttp); "
                         "--no-independent-client skips it")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _print_profiles(folder: str, top: int = 25) -> None:
    import pstats

    for name in ("front", "core", "client"):
        path = f"{folder}/{name}.prof"
        if os.path.exists(path):
            print(f"\n==== {name}: the {top} functions with the most own time ({path})")
            pstats.Stats(path).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    sys.exit(main())
