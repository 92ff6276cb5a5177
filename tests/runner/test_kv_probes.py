"""Start-up's probes (runner/kv_setup.py: the activation profile, the graph-memory probes, the compile-ahead pass)
each bind the model to a temporary KV pool: when a probe ends the model must let go of it, or its memory stays
allocated through what start-up measures next (what is in use is charged as weights, so the real KV pool would
lose it)."""

import contextlib
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from ostinato.runner.kv_setup import temporary_kv_pool


class BoundModel:
    """What allocate_kv_cache binds the pool to: keeps the caches, as the attention layers do."""

    def __init__(self):
        self.caches = None

    def bind_kv_caches(self, caches):
        self.caches = caches


def _spec():
    config = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    return SimpleNamespace(model_config=config, block_size=4, dtype=torch.float32, kv_dtype=torch.float32,
                           device=torch.device("cpu"), model=BoundModel())


@pytest.mark.parametrize("fails", [False, True])
def test_the_model_lets_go_of_a_temporary_pool_when_the_probe_ends(fails):
    spec = _spec()
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with temporary_kv_pool(spec, 8):
            k_cache = spec.model.caches[0][0]
            assert k_cache.shape == (9, 4, 2, 8)  # the 8 blocks and the scratch block
            pool = weakref.ref(k_cache._base)
            del k_cache
            if fails:
                raise RuntimeError("the probe failed")
    assert [k.shape[0] for k, _ in spec.model.caches] == [1, 1]  # the scratch block alone
    gc.collect()
    assert pool() is None  # nothing holds the probe's pool: its memory is free
