"""Where the runner runs and with which kernels: the device --device names, the attention backend and its
launch policy (--attention-backend, --pdl, --batch-invariant), and how the start-up log states PDL's outcome."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ostinato.attention.base import AttentionBackend
from ostinato.errors import ConfigError

if TYPE_CHECKING:
    from ostinato.kernels.decode_plan import DecodeTuning


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    return torch.device(name)


def make_backend(name: str, device: torch.device, pdl: str = "off", decode_tuning: DecodeTuning | None = None,
                 batch_invariant: bool = False, verify_rows: bool = False) -> AttentionBackend:
    """The attention backend; it also carries the launch policy of the decoder's Triton kernels (`pdl`, --pdl:
    model/decoder.py reads it), because only the Triton backend's kernels keep PDL's contract (kernels/pdl.py).
    decode_tuning (RunnerConfig.decode_tuning): the Triton decode attention's launch settings; --pdl sets its
    `pdl` field. batch_invariant (--batch-invariant): the backend's invariant settings, which the decoder's kernel
    choice follows too. verify_rows (speculative decoding): decode steps carry several rows of one sequence,
    row j attending to the K/V rows 0 .. j - 1 write in the same layer (runner/spec_verify.py), so K/V are written
    by the RoPE kernel before the attention: the fused decode_with_rope writes a row's own K/V inside the
    attention launch, where the other rows' programs may already have read that slot."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda":
            raise ConfigError("--attention-backend triton needs a CUDA device; use --attention-backend torch")
        from ostinato.kernels.decode_plan import DecodeTuning
        from ostinato.attention.triton_paged import TritonAttentionTuning, TritonPagedBackend, batch_invariant_tuning
        from ostinato.kernels.pdl import resolve_pdl

        # PDL changes when a kernel starts, never what it computes, so the batch-invariant set takes it too.
        on = resolve_pdl(pdl, device)
        decode = replace(decode_tuning or DecodeTuning(), pdl=on)
        if verify_rows:
            decode = replace(decode, apply_rope=False)
        tuning = TritonAttentionTuning(decode=decode)
        return TritonPagedBackend(batch_invariant_tuning(tuning) if batch_invariant else tuning)
    if pdl == "on":
        raise ConfigError(f"--pdl on needs --attention-backend triton (the {name} backend's kernels are torch's); "
                          "use --pdl auto or off")
    from ostinato.attention.torch_ref import TorchRefBackend

    return TorchRefBackend(batch_invariant)


def pdl_status(mode: str, on: bool, device: torch.device) -> str:
    """How the start-up log states --pdl's outcome."""
    if on:
        return "programmatic dependent launch on"
    if mode == "off":
        return "programmatic dependent launch off: --pdl off"
    from ostinato.kernels.pdl import pdl_unsupported_reason

    reason = pdl_unsupported_reason(device) or "the attention backend's kernels are torch's"
    return f"programmatic dependent launch off: {reason}"
