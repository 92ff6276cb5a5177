"""The random weights of `ostinato make-checkpoint`'s folders (tools/checkpoint.py). Every tensor is drawn in chunks,
each from its own generator seeded by (seed, tensor name, chunk), so the weights depend on the seed and dtype alone:
not on the shard layout, nor on the number of threads that drew them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ostinato.tools.checkpoint import Shape

_CHUNK_NUMEL = 1 << 22  # elements per draw: fine enough that all threads share even one big tensor
_POOL_MIN_BYTES = 64 << 20  # below this a thread pool costs more than it saves


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill_chunk(flat, name: str, chunk: int, seed: int, spec: Shape) -> None:
    """Draw chunk `chunk` of the flattened tensor `flat` in place, in its own dtype.

    Drawing bf16 directly is about as fast as drawing fp32 and casting, and it keeps each worker thread to a
    single serial op: a cast would open an OpenMP team inside every worker and oversubscribe the cores.
    """
    import torch

    out = flat[chunk * _CHUNK_NUMEL:(chunk + 1) * _CHUNK_NUMEL]
    generator = torch.Generator().manual_seed(_chunk_seed(seed, name, chunk))
    if name == "model.norm.weight":
        out.uniform_(0.5 * spec.final_norm_gain, 1.5 * spec.final_norm_gain, generator=generator)
    elif name.endswith("norm.weight"):
        out.uniform_(0.5, 1.5, generator=generator)  # RMSNorm gains around 1, far enough to test them
    else:
        out.normal_(0.0, spec.init_std, generator=generator)


def _random_tensors(shapes: dict[str, tuple[int, ...]], dtype, seed: int, spec: Shape, pool,
                    on_chunk_done=None) -> dict[str, Any]:
    """Draw the named tensors; `pool` (a thread pool or None) shares the chunks out, `on_chunk_done(nbytes)`
    reports progress."""
    import torch

    tensors = {name: torch.empty(dims, dtype=dtype) for name, dims in shapes.items()}
    jobs = [
        (tensor.view(-1), name, chunk)
        for name, tensor in tensors.items()
        for chunk in range((tensor.numel() + _CHUNK_NUMEL - 1) // _CHUNK_NUMEL)
    ]

    def draw(job) -> None:
        flat, name, chunk = job
        _fill_chunk(flat, name, chunk, seed, spec)
        if on_chunk_done is not None:
            on_chunk_done(min(_CHUNK_NUMEL, flat.numel() - chunk * _CHUNK_NUMEL) * flat.element_size())

    # torch releases the GIL inside the draws, so a thread pool uses all cores
    list(pool.map(draw, jobs) if pool is not None else map(draw, jobs))
    return tensors


def remove_old_weights(out: Path) -> None:
    """Delete weight files a previous run left here: HF would otherwise mix stale and new layouts."""
    for path in out.iterdir():
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", path.name):
            path.unlink()


def write_weights(out: Path, shapes: dict[str, tuple[int, ...]], dtype_name: str, seed: int, spec: Shape,
                  max_shard_size: int, progress: bool, transform=None) -> int:
    """Write the safetensors files of the named tensors (`shapes`: tools/checkpoint.py's weight_shapes) shard by
    shard (memory stays at one shard); returns bytes written (as planned, in the drawn dtype). transform: maps a
    shard's drawn tensors to the tensors to store (tools/checkpoint_fp8.py's FP8 layouts; the names it adds go
    into that shard's index entries)."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from tqdm import tqdm

    dtype = getattr(torch, dtype_name)
    # Plan on meta tensors: huggingface_hub's splitter needs only sizes, nothing is allocated.
    plan = split_torch_state_dict_into_shards(
        {name: torch.empty(dims, dtype=dtype, device="meta") for name, dims in shapes.items()},
        max_shard_size=max_shard_size,
    )
    total = plan.metadata["total_size"]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    use_pool = threads > 1 and total >= _POOL_MIN_BYTES
    # delay: quick (tiny) writes print no bar at all. tqdm.update is thread-safe.
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, delay=1.0)
    weight_map = dict(plan.tensor_to_filename)
    with ThreadPoolExecutor(threads) if use_pool else contextlib.nullcontext() as pool:
        n_shards = len(plan.filename_to_tensors)
        for i, (filename, names) in enumerate(plan.filename_to_tensors.items()):
            bar.set_description(f"drawing shard {i + 1}/{n_shards}", refresh=False)
            tensors = _random_tensors({n: shapes[n] for n in names}, dtype, seed, spec, pool, bar.update)
            if transform is not None:
                tensors = transform(tensors)
                weight_map.update({name: filename for name in tensors})
            bar.set_description(f"writing shard {i + 1}/{n_shards}", refresh=False)
            save_file(tensors, str(out / filename), metadata={"format": "pt"})
            del tensors  # before drawing the next shard: memory stays at one shard
    bar.close()
    if plan.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total
