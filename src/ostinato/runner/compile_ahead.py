"""Compiles the Triton kernels a set of steps will launch, ahead of running them, in worker processes.

Why: on a machine whose Triton cache is empty, a capture loop compiles each batch size's new kernel
specialisations (GEMV and few-rows tiles, split plans, sampling chunk plans, integer arguments equal to 1 or
divisible by 16) one after the other, in the capturing thread, and Triton's compile holds the GIL: a first
start's decode capture took several times as long as a later one's. So, in two passes:

1. Record. Which specialisations a step needs is known only by running it (its constexprs come from host-side
   plans over the shapes), so every step runs once with Triton's compile hook answering "skip" to every
   launch: the hook receives the kernel and its specialisation (signature, constexprs, attributes, options),
   which become a KernelJob, and Triton then neither compiles nor launches. Kernels already in memory are
   made to miss too (their in-memory caches are set aside for the pass), so no Triton kernel runs at all.
   A step's shapes and host-side plans never depend on its kernels' outputs (the decode step has no host
   syncs by design), but torch ops between the kernels still run, on outputs never written: so the pass
   runs under `ValuesOff`, which skips every torch op that writes into a tensor that existed before the pass
   and every op that indexes by a tensor's values (embedding, index_select, gather, ...: garbage indices
   would trip a device-side assert, which no process survives), giving their outputs as empty tensors of the
   right shape. The pass leaves no trace: no tensor that existed before it is written. What a step creates
   lazily and keeps (SplitCounters) must be initialised by a torch factory or from host data, which run for
   real, not by a Triton kernel, which the pass skips.
2. Compile. The distinct specialisations not already in the on-disk cache go to a CompilePool
   (runner/compile_pool.py), under the cache key the launch will compute; the real launches that follow
   (the capture) then load them from disk.

Whatever cannot be recorded or compiled ahead (a step that fails under the pass, a kernel not importable by
name, a worker that fails) is left to the capture, which compiles it as before; the report says how much.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ostinato.runner.compile_pool import CompilePool, JitRef, KernelJob

logger = logging.getLogger(__name__)

# Arguments by which an op reads a tensor at positions given by another tensor's values.
_INDEX_ARGUMENTS = frozenset({"index", "indices", "offsets", "per_sample_weights"})
_VALUE_CHECKED_OPS = frozenset({"multinomial", "bincount", "histc"})  # device asserts on bad values
_METADATA_WRITES = frozenset({"resize_", "resize_as_", "set_", "as_strided_"})  # change shapes: must run


class ValuesOff(TorchDispatchMode):
    """Torch ops on tensors whose values are garbage, made safe. A write into a tensor that existed before the
    pass is skipped (the written tensor is returned as is): it may be state (KV cache, sampled tokens, tables).
    An op that indexes by a tensor's values (or checks them) gives empty outputs of the shapes the op would
    give (from its meta kernel), and a write by index is skipped whatever it writes into. Every other op runs:
    views, factories (so state a step creates lazily is initialised for real, from constants or host data),
    arithmetic on garbage, and writes into tensors the pass itself created."""

    _kinds: dict[Any, str] = {}

    def __init__(self) -> None:
        super().__init__()
        self._fresh: set[int] = set()  # storages created inside the pass, by address

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._kinds.get(func) or self._kinds.setdefault(func, _kind(func))
        if kind == "writes by index" or kind == "writes" and not self._all_fresh(_written(func, args, kwargs)):
            return _written_arguments(func, args, kwargs)
        if kind == "reads values":
            out = _empty_outputs(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if kind in ("computes", "reads values"):
            tree_map(self._note_fresh, out)
        return out

    def _note_fresh(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            self._fresh.add(_storage_address(x))
        return x

    def _all_fresh(self, tensors: list[Any]) -> bool:
        return all(isinstance(t, torch.Tensor) and _storage_address(t) in self._fresh for t in tensors)


def _storage_address(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1  # no storage of its own: never counted as fresh


def _kind(func) -> str:
    schema = func._schema
    name = schema.name.split("::")[-1]
    if name in _METADATA_WRITES or torch.Tag.inplace_view in func.tags:
        return "metadata"
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return "view"  # no values read, and it must stay a view (its offset sets Triton's alignment)
    by_index = name in _VALUE_CHECKED_OPS or any(a.name in _INDEX_ARGUMENTS and "Tensor" in str(a.type)
                                                 for a in schema.arguments)
    writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if writes and all(r.alias_info is not None for r in schema.returns):
        return "writes by index" if by_index else "writes"
    return "reads values" if by_index else "computes"


def _written(func, args, kwargs) -> list[Any]:
    schema = func._schema
    return [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _written_arguments(func, args, kwargs):
    """What a mutating op returns: the arguments it writes, matched by alias set (self, out=, ...)."""
    schema = func._schema
    by_set: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            for alias in a.alias_info.before_set:
                by_set[alias] = value
    outs = [by_set[next(iter(r.alias_info.before_set))] for r in schema.returns]
    return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _empty_outputs(func, args, kwargs):
    device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)

    def to_meta(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    def to_device(x):
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
        return x

    return tree_map(to_device, func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs)))


def _jit_functions() -> list[Any]:
    from triton.runtime.jit import JITFunction
    with warnings.catch_warnings():  # isinstance reads __class__, which some deprecated objects warn on
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, JITFunction)]


@contextmanager
def _in_memory_caches_set_aside() -> Iterator[None]:
    """Every loaded kernel misses while inside: the pass must launch none (its inputs would be garbage)."""
    saved = []
    for fn in _jit_functions():
        for caches in list(fn.device_caches.values()):
            kernels = caches[0]
            saved.append((kernels, dict(kernels)))
            kernels.clear()
    try:
        yield
    finally:
        for kernels, content in saved:
            kernels.update(content)


def _deep_tuple(x):
    return tuple(_deep_tuple(v) for v in x) if isinstance(x, list) else x


def _options_of(compile_kwargs: dict, backend) -> Any:
    """The launch's options object, from the JSON Triton's hook carries (tuples come back as lists)."""
    options = json.loads(compile_kwargs["specialization_data"])["options"]
    return backend.parse_options({k: _deep_tuple(v) for k, v in options.items()})


def launch_cache_key(fn, signature: dict, constexprs: dict, attrs: dict, options, backend) -> str:
    """The on-disk cache key triton.compile computes for this specialisation (compiler/compiler.py)."""
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import ASTSource
    from triton.runtime.cache import get_cache_key

    src = ASTSource(fn, signature, constexprs, attrs)
    parsed = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, parsed, env_vars=get_cache_invalidating_env_vars())
    if knobs.runtime.add_stages_inspection_hook is not None:
        key += knobs.runtime.add_stages_inspection_hook()[0]
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _in_disk_cache(key: str, name: str) -> bool:
    from triton.runtime.cache import get_cache_manager
    return get_cache_manager(key).get_group(f"{name[:150]}.json") is not None


def job_from_hook(fn_info, compile_kwargs: dict) -> KernelJob | str:
    """A KernelJob for the specialisation Triton's compile hook describes, or why it cannot be one."""
    import pickle

    from triton.runtime.jit import JITFunction

    jit_fn = fn_info.jit_function
    module, qualname = jit_fn.fn.__module__, jit_fn.fn.__qualname__
    if "<locals>" in qualname:
        return f"{module}:{qualname} is defined inside a function: a worker cannot import it"
    _, _, target, backend, _ = jit_fn.device_caches[compile_kwargs["device"]]
    constexprs = compile_kwargs["constants"]
    attrs = compile_kwargs["configs"][0]
    options = _options_of(compile_kwargs, backend)
    key = launch_cache_key(jit_fn, compile_kwargs["signature"], constexprs, attrs, options, backend)
    refs = {k: JitRef(v.fn.__module__, v.fn.__qualname__) if isinstance(v, JITFunction) else v
            for k, v in constexprs.items()}
    job = KernelJob(module, qualname, dict(compile_kwargs["signature"]), refs, dict(attrs), dict(options.__dict__),
                    (target.backend, target.arch, target.warp_size), key, jit_fn.fn.__name__)
    try:
        pickle.dumps(job)
    except Exception as e:  # noqa: BLE001  (any value that does not pickle: the launch compiles it itself)
        return f"{job.label}: its specialisation does not pickle ({type(e).__name__})"
    return job


class _SkippedLaunch:
    """Stands in Triton's in-memory kernel cache for a specialisation already recorded, for the rest of the
    pass: its later launches (every layer's) find it and launch nothing, without the hook's cost. These four
    are what JITFunction.run asks of a cached kernel (no `result`: it is no pending compile)."""
    function = packed_metadata = None

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any) -> None:
        return None


@dataclass
class Recording:
    jobs: dict[str, KernelJob] = field(default_factory=dict)  # by launch cache key: distinct specialisations
    met: int = 0  # (kernel, in-memory key) pairs the hook met: each specialisation's first launch
    not_recordable: list[str] = field(default_factory=list)  # why a specialisation could not become a job
    step_errors: list[str] = field(default_factory=list)
    _stubs: list[tuple[dict, Any]] = field(default_factory=list)  # (kernel cache, key) of each _SkippedLaunch

    def hook(self, *, key=None, fn=None, compile=None, **_: Any) -> bool:
        self.met += 1
        try:
            job = job_from_hook(fn, compile)
        except Exception as e:  # noqa: BLE001  (a Triton whose hook carries other fields: left to the launch)
            job = f"{getattr(fn, 'name', fn)}: {type(e).__name__}: {e}"
        try:
            kernels = fn.jit_function.device_caches[compile["device"]][0]
            kernels[key] = _SkippedLaunch()
            self._stubs.append((kernels, key))
        except Exception:  # noqa: BLE001  (then every launch of it comes to this hook again: slower, as right)
            pass
        if isinstance(job, str):
            self.not_recordable.append(job)
        else:
            self.jobs.setdefault(job.expected_hash, job)
        return True  # skip: neither compile nor launch

    def remove_stubs(self) -> None:
        for kernels, key in self._stubs:
            if isinstance(kernels.get(key), _SkippedLaunch):
                del kernels[key]
        self._stubs.clear()


def record_kernels(steps: Sequence[Callable[[], Any]], knobs: Any) -> Recording:
    """Run each step with every Triton launch recorded and skipped (module docstring, pass 1)."""
    recording = Recording()
    previous = knobs.jit_cache_hook
    knobs.jit_cache_hook = recording.hook
    try:
        with _in_memory_caches_set_aside():
            try:
                for i, step in enumerate(steps):
                    try:
                        with ValuesOff():
                            step()
                    except Exception as e:  # noqa: BLE001  (the step's later kernels are left to the capture)
                        recording.step_errors.append(f"step {i + 1}: {type(e).__name__}: {e}"[:300])
            finally:
                recording.remove_stubs()
    finally:
        knobs.jit_cache_hook = previous
    return recording


@dataclass(frozen=True)
class CompileAheadReport:
    steps: int  # the step functions recorded
    distinct: int  # distinct specialisations their Triton launches need
    cached: int  # of those, already in the on-disk cache
    compiled: int  # compiled by the workers under the launch's key
    failed: int  # sent to the workers but not compiled under the launch's key
    unrecorded: int  # specialisations that could not become a job
    workers: int
    record_seconds: float
    compile_seconds: float
    problems: tuple[str, ...] = ()  # what was left to the launches, and why (steps stopped early included)

    def summary(self, what: str) -> str:
        line = (f"compiled {self.compiled} Triton kernels ahead for {what} in {self.compile_seconds:.2f} s "
                f"({self.workers} processes; {self.distinct} distinct specialisations over {self.steps} steps, "
                f"recorded in {self.record_seconds:.2f} s; {self.cached} already cached)")
        if self.problems:
            line += (f"; left to be compiled where launched ({self.failed} failed, {self.unrecorded} not "
                     "recordable, or a step stopped early): " + "; ".join(self.problems[:3]))
        return line


def compile_ahead(steps: Sequence[Callable[[], Any]], pool: CompilePool, what: str = "the decode graphs",
                  knobs: Any = None) -> CompileAheadReport | None:
    """Record the Triton kernels `steps` launch, compile the ones not cached in `pool`, log what was done.
    Returns None where Triton has no compile hook (nothing done)."""
    knobs = knobs if knobs is not None else _triton_runtime_knobs()
    if knobs is None or not hasattr(knobs, "jit_cache_hook") or not steps:
        return None
    try:
        report = _record_and_compile(steps, pool, knobs)
    except Exception as e:  # noqa: BLE001  (never fails the start: the capture compiles as it did without this)
        logger.warning("compiling the Triton kernels of %s ahead failed, the capture compiles them: %s: %s", what,
                       type(e).__name__, e)
        return None
    logger.log(logging.WARNING if report.problems else logging.INFO, report.summary(what))
    return report


def _record_and_compile(steps: Sequence[Callable[[], Any]], pool: CompilePool, knobs: Any) -> CompileAheadReport:
    t0 = time.perf_counter()
    recording = record_kernels(steps, knobs)
    t1 = time.perf_counter()
    todo = [job for key, job in recording.jobs.items() if not _in_disk_cache(key, job.name)]
    results = pool.compile(todo) if todo else []
    compiled = [r for r in results if r.matched]
    problems = [*recording.step_errors, *dict.fromkeys(recording.not_recordable),
                *(f"{r.job.label}: {r.error or 'compiled under another cache key than the launch computes'}"
                  for r in results if not r.matched)]
    return CompileAheadReport(len(steps), len(recording.jobs), len(recording.jobs) - len(todo),
                              len(compiled), len(results) - len(compiled), len(set(recording.not_recordable)),
                              pool.workers, t1 - t0, time.perf_counter() - t1, tuple(problems))


class CompileCounter:
    """Counts, while inside, what triton.compile did: compiled a kernel, or loaded it from the on-disk cache
    (Triton's compilation listener; the jit_cache_hook cannot tell the two apart). Counts nothing without
    Triton or its listener."""

    def __init__(self) -> None:
        self.compiled = self.loaded = 0
        self._knobs = self._previous = None

    def __enter__(self) -> "CompileCounter":
        try:
            from triton import knobs
        except ImportError:
            return self
        if hasattr(getattr(knobs, "compilation", None), "listener"):
            self._knobs, self._previous = knobs.compilation, knobs.compilation.listener
            knobs.compilation.listener = self._listen
        return self

    def _listen(self, **kwargs: Any) -> None:
        if kwargs.get("cache_hit"):
            self.loaded += 1
        else:
            self.compiled += 1
        if self._previous is not None:
            self._previous(**kwargs)

    def __exit__(self, *exc: Any) -> None:
        if self._knobs is not None:
            self._knobs.listener = self._previous


def _triton_runtime_knobs():
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)
