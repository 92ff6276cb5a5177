"""A GGUF file run as it is: a cached folder of its metadata only, the weights read from the file at each start.

Why: dequantizing an 8B Q4_K_M to a float32 folder writes 32 GB and takes minutes, and the model then runs in
bf16, reading 3x the bytes the file holds per token. Here the folder holds config.json, the tokenizer files
(chat template included) and generation_config.json, parsed out of the metadata by transformers, and a table of
the file's tensors (name, type, shape, byte offset). The loader (model/gguf_weights.py) memory-maps the file and
reads tensors one at a time from those offsets, keeping the projections' blocks quantized on the device.

The folder's key is the file's path, size and modification time (not its SHA-256: hashing a 5 GB file would
cost the seconds a cached start should take) and this module's source. A later start reads no GGUF header at
all: the `gguf` reader parses every metadata field, vocabularies included, which takes seconds on big ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path

from ostinato.errors import CheckpointError
from ostinato.model.gguf_sources import (
    CACHE_FORMAT, DONE_MARKER, cache_root, converter_hash, inspect_gguf, open_gguf, remove_stale_conversions,
    write_cache_folder, write_metadata,
)

logger = logging.getLogger(__name__)

TENSORS_FILE = "gguf_tensors.json"  # name -> [ggml type id, shape (ne: fastest dimension first), offset, bytes]
NATIVE_SOURCE = Path(__file__)


def native_dir(path: Path) -> Path:
    """The metadata folder of `path`: keyed by where the file is, its size and mtime, and this module."""
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return cache_root() / "gguf" / f"{key}-{CACHE_FORMAT}-native-{converter_hash(NATIVE_SOURCE)}"


def is_native_gguf_dir(model_dir: Path) -> bool:
    """Whether `model_dir` is a GGUF metadata folder (its weights are in the GGUF file it names)."""
    marker = Path(model_dir) / DONE_MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("weights") == "gguf"


def native_marker(model_dir: Path) -> dict:
    """The folder's facts: gguf_file, architecture, tensor_types, num_params, weights = "gguf"."""
    return json.loads((Path(model_dir) / DONE_MARKER).read_text())


def tensor_table(model_dir: Path) -> dict[str, tuple[int, tuple[int, ...], int, int]]:
    return {name: (t, tuple(shape), off, n) for name, (t, shape, off, n) in
            json.loads((Path(model_dir) / TENSORS_FILE).read_text()).items()}


def _write_native_dir(path: Path, out: Path) -> tuple[str, dict[str, int], int]:
    reader = open_gguf(path)
    arch, types, params = inspect_gguf(path, reader)
    table = {t.name: [int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes)]
             for t in reader.tensors}

    def fill(tmp: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        try:
            with _parsed_once(path, reader):
                config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
                tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except (ValueError, NotImplementedError, KeyError) as e:
            raise CheckpointError(f"transformers could not read {path.name}'s metadata: {e}") from e
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        write_metadata(tmp, config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type], tokenizer)
        (tmp / TENSORS_FILE).write_text(json.dumps(table))

    write_cache_folder(out, fill, {"source": str(path), "gguf_file": str(path), "weights": "gguf",
                                   "architecture": arch, "tensor_types": types, "num_params": params})
    return arch, types, params


@contextlib.contextmanager
def _parsed_once(path: Path, reader):
    """Inside, the `gguf` library's reader of `path` is `reader`, already parsed. transformers' GGUF config and
    tokenizer loaders each construct their own reader of the file, and a reader parses every metadata field up
    front, a 128k-token vocabulary one string at a time: seconds a reader, three times over. A reader only reads,
    so one serves all three. Any other file, or other arguments, gets a reader of its own; if transformers stops
    constructing it through `gguf.GGUFReader`, it parses again."""
    import gguf

    construct = gguf.GGUFReader

    def shared(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == path:
            return reader
        return construct(file, *args, **kwargs)

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = construct


def gguf_metadata_dir(path: Path) -> Path:
    """The metadata folder of GGUF file `path`, written on first use (seconds to a minute: transformers parses
    the metadata), reused after. Raises CheckpointError for an architecture or a type ostinato cannot run."""
    path = Path(path).resolve()
    out = native_dir(path)
    if (out / DONE_MARKER).is_file():
        logger.info("GGUF %s: metadata from the cache %s; weights read from the file", path.name, out)
        return out
    remove_stale_conversions(out.parent)
    t0 = time.perf_counter()
    try:
        arch, types, params = _write_native_dir(path, out)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"reading {path.name}'s metadata was stopped; nothing was cached, the next run "
                                "reads it again") from None
    types_text = ", ".join(f"{n} x {t}" for t, n in sorted(types.items(), key=lambda kv: -kv[1]))
    logger.info("GGUF %s (%s; %s; %.1fM parameters): metadata read in %.1f s, cached in %s", path.name, arch,
                types_text, params / 1e6, time.perf_counter() - t0, out)
    return out
