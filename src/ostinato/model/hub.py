"""Models named by hub id (`Qwen/Qwen3-0.6B`), resolved through huggingface_hub and its local cache.

The cache is huggingface_hub's own (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub), so a
model another tool downloaded is used as it is. `HF_HUB_OFFLINE=1` reads the cache only. Where the network
allows, only the files the engine reads are downloaded: config, safetensors weights, tokenizer and
generation_config, never the .bin/.gguf/onnx copies a repository may also hold.

These variables (and `HF_ENDPOINT`, a mirror) are read at each call, where huggingface_hub reads them once at
its import, so a process that sets them late, as a test does, is honoured too.

Also here: which files an HF folder needs, and a check that names the missing ones, for hub snapshots and for
the tokenizer of any folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from ostinato.errors import CheckpointError

# What the loader, the tokenizer and the model's defaults read from a repository.
HUB_FILE_PATTERNS = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
# Any one of these sets is a tokenizer transformers can load without extra packages or a network.
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
_TRUE = {"1", "on", "yes", "true"}  # huggingface_hub's spelling of a set boolean variable


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def missing_tokenizer_files(folder: Path) -> str | None:
    """None when `folder` holds a tokenizer; else the files it lacks, as one phrase."""
    if any(all((folder / name).is_file() for name in names) for names in TOKENIZER_FILE_SETS):
        return None
    return " or ".join(" + ".join(names) for names in TOKENIZER_FILE_SETS)


def check_tokenizer_folder(folder: str | Path) -> None:
    """A local folder without tokenizer files: a CheckpointError naming them, before transformers would fall
    back to a slow tokenizer class and fail on a package it does not need. A non-folder (a hub name given
    as the tokenizer) is left to transformers."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    missing = missing_tokenizer_files(folder)
    if missing:
        raise CheckpointError(f"{folder} has no tokenizer files: it needs {missing} (with tokenizer_config.json "
                              "where the model has one); copy them from the model's repository into the folder")


def missing_checkpoint_files(folder: Path) -> list[str]:
    """The files (or alternatives) an HF folder lacks for ostinato to load it."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    tokenizer = missing_tokenizer_files(folder)
    if tokenizer:
        missing.append(f"tokenizer files ({tokenizer})")
    return missing


def _how_to_provide(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return (f"download it where there is network (`hf download {repo_id}{rev}`, into {hub_cache_dir()} or the "
            f"cache $HF_HUB_CACHE names), or pass the path of a local folder holding config.json, the "
            f"*.safetensors weights and the tokenizer files")


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of repo_id at revision, from the cache or downloaded; typed errors for the rest."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (  # where every huggingface_hub version exports them
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    offline = hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(),
                                      allow_patterns=list(HUB_FILE_PATTERNS), local_files_only=offline,
                                      endpoint=os.environ.get("HF_ENDPOINT") or None))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise CheckpointError(f"{repo_id}{at} is not in the HF cache {hub_cache_dir()} and {why}, so it cannot "
                              f"be downloaded: {_how_to_provide(repo_id, revision)}") from None
    except GatedRepoError:
        raise CheckpointError(f"{repo_id} is a gated repository: accept its terms on the hub and log in "
                              f"(`hf auth login`), or {_how_to_provide(repo_id, revision)}") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo_id} has no revision {revision!r}: pass a branch, tag or commit id "
                              "it has") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"no model {repo_id!r} on the hub (nor a local folder of that name): check the "
                              "id, or log in for a private repository") from None
    except HfHubHTTPError as e:
        raise CheckpointError(f"downloading {repo_id}{at} failed ({e}); retry, or "
                              f"{_how_to_provide(repo_id, revision)}") from None


def resolve_hub_id(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of a hub id, downloaded first where needed and allowed. Raises
    CheckpointError saying what is missing and how to provide it."""
    folder = _snapshot(repo_id, revision)
    missing = missing_checkpoint_files(folder)
    if missing:
        raise CheckpointError(f"the cached snapshot of {repo_id} ({folder}) lacks {', '.join(missing)}: "
                              f"{_how_to_provide(repo_id, revision)}")
    return folder
