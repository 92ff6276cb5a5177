"""Does a request stall the first time it brings a new shape? Start an engine, then send one request at a time
with prompt lengths that fall in different classes (Triton specialises integer arguments equal to 1 or divisible
by 16, so a first odd length may compile new kernel variants inside a live step), each length twice, and print
the wall time of each request. A first time far above the second is a stall a user would feel.

    PYTHONPATH=src python3 benchmarks/step/first_request.py /tmp/ck-qwen3-0.6b [--lengths 64,100,37,1,513,2000]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main() -> int:
    from ostinato import LLM, SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--lengths", default="64,100,37,1,513,2000,3001")
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, max_model_len=args.max_model_len, gpu_memory_utilization=0.5)
    print(f"start-up {time.perf_counter() - t0:.1f} s")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for n in (int(x) for x in args.lengths.split(",")):
        times = []
        for rep in range(2):
            prompt = [[(7 + 13 * i + rep) % 1000 + 3 for i in range(n)]]
            torch.cuda.synchronize()
            prof = cProfile.Profile() if rep == 0 else None
            t = time.perf_counter()
            if prof:
                prof.enable()
            llm.generate(prompt, params)
            torch.cuda.synchronize()
            if prof:
                prof.disable()
            times.append(1e3 * (time.perf_counter() - t))
        print(f"prompt {n:5d} tokens: first {times[0]:8.1f} ms, second {times[1]:8.1f} ms")
        if times[0] > 2 * times[1] + 50:  # a stall: where did the first one's host time go?
            pstats.Stats(prof).sort_stats("cumulative").print_stats(12)
    watch = getattr(llm.engine.runner, "compile_watch", None)
    if watch is not None:
        print(f"Triton compilations: {watch.compiles_at_startup} at start-up, {watch.compiles_in_service} in service "
              f"{watch.kernels_in_service}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
