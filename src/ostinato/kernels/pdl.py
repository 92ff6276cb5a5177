"""Programmatic dependent launch (PDL, sm_90 and newer): a kernel starts while the one before it finishes.

Why: a decode step of a small model is ~230 kernels of 2-6 us each, inside one CUDA graph, and each one
still pays its launch and ramp-up after its predecessor's last block has retired and its writes have been
flushed (the replay minus the kernel sum was a tenth of a step or more, `ostinato bench kernels`). With PDL a
kernel launched with the programmatic-stream-serialization attribute (Triton's `launch_pdl=True`) may start
as soon as every block of its predecessor has called `griddepcontrol.launch_dependents`; it must then call
`griddepcontrol.wait` before it touches anything the predecessor writes, and that wait returns only once the
predecessor has completed and its memory is visible. CUDA-graph capture keeps these as programmatic edges.

The contract every kernel launched with PDL keeps (`pdl_begin` / `pdl_wait` below):
    - it lets its dependent launch (`pdl_begin`): first thing, except the decode attention, whose programs
      trigger after their K/V loop where the launch fills the GPU (kernels/decode_plan.py,
      DecodeTuning.late_trigger_programs: a dependent launched at once onto a full GPU gets only the few SMs
      with room, and runs there). The GEMV's and few-rows kernel's trigger after their K loops was measured and
      lost;
    - before `pdl_wait` it reads only what no kernel of the PDL chain writes, and it writes nothing. That is
      the weights; and the step's inputs (positions, slot mapping, block tables, context lengths, the RoPE
      table), because they are complete before the chain starts: they are copied in or computed by plain
      launches ahead of the embedding lookup, itself a plain launch (a torch op), which starts only after
      they finish and lets the first decoder kernel start only when it has finished. And the K/V of tokens
      before this step's, which no kernel of the step writes (decode attention with RoPE, the one kernel that
      reads K/V before its wait, excludes the slot its own layer writes: kernels/decode_attention.py). Never
      activations;
    - everything else comes after `pdl_wait`, which every program runs (an early return before it is
      allowed only for a program that neither reads nor writes anything after).
Waiting is transitive: a kernel's wait returns after its predecessor completed, and that predecessor did
its work after its own wait, so the whole chain is ordered as without PDL. A kernel launched without the
attribute (cuBLAS, torch ops) waits for its predecessor as usual.

What runs before the wait is the point: the small-batch linear (kernels/gemv.py) loads its first weight tile
there, so a projection's weight read overlaps the norm or attention kernel before it; decode attention loads
its first K/V tile there (with the context length and block table entries that locate it, and the q/k norm
weights), overlapping the qkv projection before it.
"""

from __future__ import annotations

import torch

from ostinato.config import PDL_MODES
from ostinato.errors import ConfigError

from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the helpers' annotations)

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older triton: no PDL (pdl_unsupported_reason says so)
    gdc_launch_dependents = gdc_wait = None


def pdl_unsupported_reason(device: torch.device) -> str | None:
    """Why kernels on `device` cannot be launched with PDL, or None when they can."""
    if triton is None:
        return "triton is not installed"
    if gdc_wait is None:
        return f"triton {triton.__version__} has no grid dependency control (triton.language.extra.cuda.gdc_wait)"
    if device.type != "cuda":
        return f"PDL is a CUDA feature and the device is {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"PDL needs compute capability 9.0 (Hopper) or newer; this GPU is {major}.{minor}"
    return None


def resolve_pdl(mode: str, device: torch.device) -> bool:
    """--pdl auto|on|off -> whether the Triton kernels launch with PDL. auto: where supported; on: an error
    saying why where not."""
    if mode not in PDL_MODES:
        raise ConfigError(f"--pdl must be one of {', '.join(PDL_MODES)}, got {mode!r}")
    if mode == "off":
        return False
    reason = pdl_unsupported_reason(device)
    if reason is not None and mode == "on":
        raise ConfigError(f"--pdl on cannot be honoured: {reason}; use --pdl auto or --pdl off")
    return reason is None


@_jit
def pdl_begin(PDL: tl.constexpr):
    """Let the next kernel launch now (it waits in its own pdl_wait for this one to complete)."""
    if PDL:
        gdc_launch_dependents()


@_jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel has completed and its writes are visible."""
    if PDL:
        gdc_wait()


def launch_options(pdl: bool) -> dict:
    """The Triton launch keyword for PDL; nothing when off, so the interpreter and older triton never see it."""
    return {"launch_pdl": True} if pdl else {}
