"""The offline engine most engine tests run on: LLM over a tiny random Llama checkpoint, on CPU in float32.

One helper, so that a change in how such an engine is built (a new required flag, another default) is made
here once and not in every module that wants one. Each module still gets its own engine from its own
module-scoped fixture: the engine's settings (KV blocks, window, queue bound) are what each module tests.
"""

from __future__ import annotations

from ostinato import LLM
from ostinato.tools.checkpoint import make_checkpoint


def tiny_llm(tmp_path_factory, name: str, *, seed: int = 1, **engine_kwargs) -> LLM:
    """An LLM on a fresh tiny checkpoint made with `seed` in a temp folder named after `name`;
    engine_kwargs are LLM's (num_kv_blocks, max_model_len, max_num_seqs, ...)."""
    path = tmp_path_factory.mktemp(name)
    make_checkpoint(path, shape="tiny", family="llama", seed=seed)
    return LLM(str(path), device="cpu", dtype="float32", **engine_kwargs)
