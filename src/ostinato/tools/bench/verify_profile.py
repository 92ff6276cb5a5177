"""`ostinato bench verify --profile-k K`: where one verify step's time goes, under torch.profiler.

A speculative step is synchronous (the next proposals need its tokens), so its host work is not hidden behind
the GPU as a decode step's is. The profile labels the verify step's phases (runner/spec_verify.py: the forward,
the logits, the settings rows, the sampler, the read-back with its sync, the acceptance) and reports, per step,
each phase's host time and the device kernels with their GPU time, so a run shows which phase to cut.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

# (attribute owner under the verifier, method) -> the label it is profiled under. The prefill path's phases,
# then the decode-graph path's (SpecVerifier.replay_flattened; its flattening is labelled in `labelled`).
PREFILL_PHASES = (("verifier", "hidden", "verify: forward"), ("model", "compute_logits", "verify: logits"),
                  ("verifier", "settings", "verify: settings rows"), ("sampler", "__call__", "verify: sampler"))
DECODE_GRAPH_PHASES = (("verifier", "replay_flattened", "verify: decode-graph step"),
                       ("batch", "load_transient", "verify: rows to the device"),
                       ("decode_graphs", "replay_filled", "verify: decode-graph replay"))
PHASES = PREFILL_PHASES + DECODE_GRAPH_PHASES
DECODE_GRAPH_LABELS = tuple(p[2] for p in DECODE_GRAPH_PHASES) + ("verify: flatten rows",)
HOST_LABELS = (("verify: step", "verify: to_host (sync)", "verify: accept") + tuple(p[2] for p in PREFILL_PHASES)
               + DECODE_GRAPH_LABELS)


@contextlib.contextmanager
def labelled(verifier):
    """The verifier's phases wrapped in torch.profiler.record_function labels (this bench's copy only)."""
    import torch

    from ostinato.runner import sampler as sampler_module, spec_verify

    decode_step = verifier.decode_step
    owners = {"verifier": verifier, "model": verifier.model, "sampler": verifier.sampler,
              "decode_graphs": verifier.decode_graphs, "batch": None if decode_step is None else decode_step.batch}
    saved_accept, saved_to_host = spec_verify.accept, sampler_module.SamplerOutput.to_host
    saved_flatten = spec_verify.flatten_verify_rows

    def wrap(fn, label):
        def labelled_fn(*a, **k):
            with torch.profiler.record_function(label):
                return fn(*a, **k)
        return labelled_fn

    patched = []
    for owner_name, method, label in PHASES:
        owner = owners[owner_name]
        if owner is None:  # no decode graphs: that path never runs
            continue
        if method == "__call__":  # a call on the instance looks the method up on its class: wrap a bound copy
            verifier.sampler = _Labelled(owner, wrap(owner.__call__, label))
            patched.append((verifier, "sampler", owner))
            continue
        patched.append((owner, method, owner.__dict__.get(method)))
        setattr(owner, method, wrap(getattr(owner, method), label))
    spec_verify.accept = wrap(saved_accept, "verify: accept")
    spec_verify.flatten_verify_rows = wrap(saved_flatten, "verify: flatten rows")
    sampler_module.SamplerOutput.to_host = wrap(saved_to_host, "verify: to_host (sync)")
    try:
        yield
    finally:
        spec_verify.accept, sampler_module.SamplerOutput.to_host = saved_accept, saved_to_host
        spec_verify.flatten_verify_rows = saved_flatten
        for owner, name, old in reversed(patched):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


class _Labelled:
    """A callable standing in for the sampler: its calls labelled, anything else from the sampler."""

    def __init__(self, inner, call):
        self._inner, self._call = inner, call

    def __call__(self, *a, **k):
        return self._call(*a, **k)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def profile_verify(verifier, out, steps: int) -> dict:
    """{"host_us": label -> host µs per step, "kernels": kernel name -> {"us", "calls"} per step} over `steps`
    verify steps of `out` (after two unprofiled ones)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    for _ in range(2):
        verifier.launch(out).result()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with labelled(verifier), profile(activities=activities) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("verify: step"):
                verifier.launch(out).result()
    host: dict[str, float] = defaultdict(float)
    kernels: dict[str, dict[str, float]] = defaultdict(lambda: {"us": 0.0, "calls": 0.0})
    for event in prof.events():
        if event.name in HOST_LABELS and event.device_type == torch.autograd.DeviceType.CPU:
            host[event.name] += event.time_range.elapsed_us() / steps
        elif cuda and event.device_type == torch.autograd.DeviceType.CUDA and event.name not in HOST_LABELS:
            # (a label's range on the GPU side spans the kernels it launched: counting it would count them twice)
            k = kernels[event.name]
            k["us"] += event.time_range.elapsed_us() / steps
            k["calls"] += 1 / steps
    return {"host_us": dict(host), "kernels": dict(kernels)}


def print_profile(k: int, profiled: dict) -> None:
    print(f"k {k}: host time per verify step (wall, includes waits)")
    for label in HOST_LABELS:
        if label in profiled["host_us"]:
            print(f"  {label:<26} {profiled['host_us'][label]:9.1f} us")
    kernels = sorted(profiled["kernels"].items(), key=lambda kv: -kv[1]["us"])
    if kernels:
        total = sum(v["us"] for _, v in kernels)
        print(f"  device kernels: {total:.1f} us a step in {sum(v['calls'] for _, v in kernels):.0f} launches; top:")
        for name, v in kernels[:15]:
            print(f"    {v['us']:8.1f} us  x{v['calls']:<5.1f} {name[:90]}")
