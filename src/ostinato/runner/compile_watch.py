"""Makes a Triton compilation inside a live step visible: a WARNING naming the kernel, and a counter.

Why: Triton compiles a kernel the first time it meets a new specialisation (constexpr values, dtypes, and
integer arguments equal to 1 or divisible by 16), and a compile costs 0.1-1 s of host time. After start-up
that lands inside a user's step: every running stream stalls for it (a first 1-token prompt can take 25 times
the second; benchmarks/step/first_request.py). Start-up warms
what it can (runner/warmup.py); this watch says, never silently, when something still compiled in service.

Hooks Triton's `knobs.runtime.jit_cache_hook`, which Triton calls before every compilation (an in-memory
cache miss; the on-disk cache may still spare the compile itself, not the load). The hook is process-wide,
so the newest engine's watch is the one installed (it takes over from an earlier engine's watch in the same
process); a hook someone else set is chained, not replaced.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


def _runtime_knobs():
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)


class CompileWatch:
    """Counts Triton compilations; after `seal()` each one is logged as a stall inside a live step."""

    def __init__(self) -> None:
        self.compiles_at_startup = 0
        self.compiles_in_service = 0
        self.kernels_in_service: list[str] = []  # "name(specialisation)" of each in-service compile, in order
        self._kernels: list[str] = []  # the name of every compile since install, in order (kernels_since)
        self._sealed = False
        self._lock = threading.Lock()
        self._previous = None
        self._knobs = None

    @property
    def installed(self) -> bool:
        return self._knobs is not None

    def install(self) -> bool:
        """Hook into Triton; False where this Triton has no compile hook (or no Triton): nothing is counted."""
        knobs = _runtime_knobs()
        if knobs is None or not hasattr(knobs, "jit_cache_hook"):
            logger.debug("this Triton has no jit_cache_hook: in-service compilations are not counted")
            return False
        previous = knobs.jit_cache_hook
        owner = getattr(previous, "__self__", None)
        if isinstance(owner, CompileWatch):  # an earlier engine's watch in this process: take over from it
            previous = owner._previous
        self._previous = previous
        knobs.jit_cache_hook = self.on_compile
        self._knobs = knobs
        return True

    def uninstall(self) -> None:
        if self._knobs is not None and self._knobs.jit_cache_hook == self.on_compile:
            self._knobs.jit_cache_hook = self._previous
        self._knobs = None

    def seal(self) -> None:
        """Start-up is over: from now on every compilation is a stall inside a live step."""
        self._sealed = True

    @property
    def compiles(self) -> int:
        """Compilations seen so far (start-up and in service): a mark for kernels_since."""
        return len(self._kernels)

    def kernels_since(self, mark: int) -> list[str]:
        """The kernels compiled after `mark` (a value of `compiles`), by name, in order."""
        return self._kernels[mark:]

    def on_compile(self, *, key=None, repr=None, fn=None, **kwargs):
        """Triton's hook signature (keyword arguments). Returns what a chained hook returns (True skips the
        compile: only a chained hook may ask for that); this watch itself never changes what Triton does."""
        with self._lock:
            self._kernels.append(str(getattr(fn, "__name__", None) or getattr(fn, "name", None) or repr))
            if not self._sealed:
                self.compiles_at_startup += 1
            else:
                self.compiles_in_service += 1
                self.kernels_in_service.append(str(repr or getattr(fn, "name", fn)))
                logger.warning(
                    "Triton compiled %s inside a live step: a one-time stall (0.1-1 s) for every running "
                    "request. Start-up warm-up did not cover this specialisation; please report it with this "
                    "line (count so far: %d).", repr or fn, self.compiles_in_service)
        if self._previous is not None:
            return self._previous(key=key, repr=repr, fn=fn, **kwargs)
        return None
