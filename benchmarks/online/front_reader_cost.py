"""What the server's front spends on its reader thread per streamed sequence per step, piece by piece.

Every step the engine core sends one record per sequence that got tokens (engine/step_outputs.py); the front's
reader thread unpickles the message, makes each record a RequestOutput (outputs.output_from_record) and shows
the step to the latency metrics (ServerMetrics.on_step) before the event loop writes the chunks. The reader
holds the GIL the event loop needs for all of it, so each microsecond here is one the loop cannot spend writing.

    PYTHONPATH=src python benchmarks/online/front_reader_cost.py --streams 256

Prints microseconds per record for each piece (the best of --repeats runs over --steps steps).
"""

from __future__ import annotations

import argparse
import itertools
import pickle
import time

from ostinato.engine.outputs import output_from_record
from ostinato.server.metrics import ServerMetrics


def _step_records(streams: int, finished: bool = False) -> list[tuple]:
    """One decode step's records: a token of text for each stream, as a streamed greedy request gets them."""
    return [(f"cmpl-{i:032x}", [(0, " tok", [1234], "length" if finished else None, None)], finished, 1.0,
             2.0 if finished else None, 0) for i in range(streams)]


def _best_us_per_record(fn, steps: int, records: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for step in range(steps):
            fn(step)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / (steps * records)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args(argv)
    records = _step_records(ns.streams)
    message = pickle.dumps(("step", records, 1.0), protocol=pickle.HIGHEST_PROTOCOL)
    prompt_ids = list(range(256))
    outputs = [output_from_record(r, None, prompt_ids, 0.5) for r in records]
    metrics = ServerMetrics("m")
    metrics.on_step(outputs, 1.0)  # every stream has had its first token: the steps below observe gaps
    clock = itertools.count(1.005, 0.005)  # a step every 5 ms
    pieces = {
        "unpickle the step's message": lambda step: pickle.loads(message),
        "output_from_record": lambda step: [output_from_record(r, None, prompt_ids, 0.5) for r in records],
        "ServerMetrics.on_step": lambda step: metrics.on_step(outputs, next(clock)),
    }
    for name, fn in pieces.items():
        us = _best_us_per_record(fn, ns.steps, ns.streams, ns.repeats)
        print(f"{name:>30}: {us:5.2f} us per record ({us * ns.streams / 1e3:.2f} ms per step of {ns.streams})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
