"""The server's two processes exempt their start-up heap from Python's cyclic collector and collect young objects
less often (engine/startup_heap.py): a full collection then walks only what serving keeps alive, not torch's and
the model's objects, whose walk paused every stream for up to 170 ms.

Each test gets pytest's collector settings back (the gc_settings_restored fixture of tests/conftest.py).
"""

import gc
import threading
import types
import weakref

from ostinato.engine.startup_heap import YOUNG_COLLECTION_THRESHOLD, freeze_startup_heap
from support.core_in_process import run_core_main


class _Node:
    """A tracked object that can hold itself in a cycle."""

    def __init__(self):
        self.me = self


def _tracked_by_collections(obj) -> bool:
    """Whether a collection would walk obj (the frozen generation is outside gc.get_objects())."""
    return any(o is obj for o in gc.get_objects())


def test_freezing_collects_the_start_up_garbage_exempts_what_is_alive_and_collects_young_objects_less_often(
        gc_settings_restored):
    thresholds = gc.get_threshold()
    alive, garbage = _Node(), _Node()
    garbage_ref = weakref.ref(garbage)
    del garbage  # a cycle: only the collector frees it
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 0
    assert garbage_ref() is None  # freed before the freeze, not kept for good
    assert not _tracked_by_collections(alive)
    later = _Node()
    assert _tracked_by_collections(later)  # what serving creates is still collected
    assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *thresholds[1:]) != thresholds


def test_the_engine_core_freezes_its_heap_once_the_engine_is_built_before_it_serves(gc_settings_restored):
    seen, ready = {}, threading.Event()

    def factory(args):
        seen["frozen_while_building"] = gc.get_freeze_count()
        seen["engine"] = types.SimpleNamespace(tokenizer=None, model_config=None, scheduler_config=None,
                                               served_model_name="m", graph_status="off", generation_defaults={},
                                               has_unfinished=lambda: False)
        return seen["engine"]

    class Commands:
        def recv(self):  # the stop only once the core said ready: it cannot freeze after serving, unseen
            if not ready.wait(30) or seen.get("stop_sent"):
                raise EOFError
            seen["stop_sent"] = True
            return ("stop",)

    class Events:
        def send(self, message):
            if message[0] == "ready":
                seen["engine_frozen_when_ready"] = not _tracked_by_collections(seen["engine"])
                ready.set()

    run_core_main(factory, None, Commands(), Events())
    assert seen["frozen_while_building"] == 0
    assert seen["engine_frozen_when_ready"] is True
