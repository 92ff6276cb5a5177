"""A GGUF file's start-up cost, kept in its blocks or converted to float32 (`--gguf-dequantize`): the seconds to
resolve it (parse and cache its metadata, or convert it to a float32 folder once) and to load the weights, the
process's resident memory before the load and at its peak, and the bytes the model holds. Only the loader runs
(no KV cache, no graphs), so the memory is the start-up's alone; on a GPU (`--device cuda`) the tensors go to the
device one at a time and the host keeps only what the load needs.

    PYTHONPATH=src python3 benchmarks/step/gguf_load.py FILE [--gguf-dequantize] [--device cpu|cuda]

Run it twice with the same OSTINATO_CACHE_DIR for a first and a cached start. One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ostinato.attention.torch_ref import TorchRefBackend
from ostinato.config import ModelConfig
from ostinato.model.gguf_sources import resolve_model_dir
from ostinato.model.loader import load_model, weights_nbytes


def _rss_bytes(key: str) -> int:
    """VmRSS (now) or VmHWM (the peak so far) of this process, from /proc."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--gguf-dequantize", action="store_true")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    start = time.perf_counter()
    model_dir = resolve_model_dir(args.file, gguf_dequantize=args.gguf_dequantize)
    resolved = time.perf_counter()
    config = ModelConfig.from_dir(model_dir)
    before_load = _rss_bytes("VmRSS:")
    model = load_model(model_dir, config, dtype, torch.device(args.device), TorchRefBackend(), progress=False)
    if args.device == "cuda":
        torch.cuda.synchronize()
    loaded = time.perf_counter()
    print(json.dumps({
        "file": args.file, "gguf_dequantize": args.gguf_dequantize, "device": args.device,
        "resolve_s": round(resolved - start, 2), "load_s": round(loaded - resolved, 2),
        "model_GiB": round(weights_nbytes(model) / 2**30, 2),
        "rss_before_load_GiB": round(before_load / 2**30, 2),  # the process, the resolve step included
        "peak_rss_GiB": round(_rss_bytes("VmHWM:") / 2**30, 2),
    }))


if __name__ == "__main__":
    main()
