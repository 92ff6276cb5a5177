"""How a CUDA-graph runner (runner/graphs.py) words a failed capture and judges a replay against the eager step."""

from __future__ import annotations

import torch

from ostinato.runner.graph_backends import first_line
from ostinato.runner.memory import capture_oom_message

# Text CUDA / torch use when a captured region synchronizes with the host or touches a capturing stream.
_HOST_SYNC_MARKERS = ("stream is capturing", "graph capture", "during capture", "cudaerrorstreamcapture",
                      "operation not permitted when stream")
_HOST_SYNC_HINT = (
    "This usually means the step synchronizes with the host inside the captured region: .item(), .cpu(), "
    ".tolist(), printing a tensor, a Python branch on a tensor value, or an op whose output shape depends "
    "on the data (nonzero, masked_select, unique). Move that out of the step."
)


def describe_capture_failure(size: int, error: BaseException) -> str:
    """The message for a failed capture: size, original error, and a hint when the cause is known."""
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    if isinstance(error, oom):
        return capture_oom_message(size, first_line(error))
    msg = f"capturing the CUDA graph for batch size {size} failed: {first_line(error)}."
    if any(marker in str(error).lower() for marker in _HOST_SYNC_MARKERS):
        msg += " " + _HOST_SYNC_HINT
    for note in getattr(error, "__notes__", ()):  # what the backend knows (runner/graph_backends.py)
        msg += " " + note
    return msg


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for graph-vs-eager agreement. The same kernels run both ways, but a padded buffer
    width can change a kernel's reduction order, so allow a few units of the dtype's precision."""
    return {torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}.get(dtype, (1e-3, 1e-3))


def default_compare(graph_out: torch.Tensor, eager_out: torch.Tensor) -> str | None:
    """None when the graph's output matches eager's, else what differs.

    Floating outputs: allclose with a dtype-dependent tolerance, and the argmax over the last dim (the
    sampled token under greedy decoding) equal in every row unless eager itself has a tie there within
    that tolerance. Other dtypes (e.g. sampled token ids): exactly equal.
    """
    if graph_out.shape != eager_out.shape:
        return f"shape {tuple(graph_out.shape)} != eager {tuple(eager_out.shape)}"
    if not graph_out.is_floating_point():
        if torch.equal(graph_out, eager_out):
            return None
        if graph_out.ndim == 0:
            return f"value {graph_out.item()} != eager {eager_out.item()}"
        rows = (graph_out != eager_out).reshape(graph_out.shape[0], -1).any(-1).nonzero().flatten()
        return f"values differ from eager in rows {rows.tolist()[:8]}"
    rtol, atol = _tolerance(eager_out.dtype)
    g, e = graph_out.float(), eager_out.float()
    if not torch.allclose(g, e, rtol=rtol, atol=atol):
        diff = (g - e).abs().nan_to_num(nan=float("inf"))
        return f"max abs diff {diff.max().item():.4g} from eager (rtol={rtol}, atol={atol})"
    if g.ndim == 0 or g.shape[-1] == 0:
        return None
    g_top, e_top = g.argmax(-1), e.argmax(-1)
    flipped = g_top != e_top
    if flipped.any():
        e_best = e.gather(-1, e_top.unsqueeze(-1)).squeeze(-1)
        e_at_graph_top = e.gather(-1, g_top.unsqueeze(-1)).squeeze(-1)
        not_a_tie = flipped & (e_best - e_at_graph_top > atol + rtol * e_best.abs())
        if not_a_tie.any():
            return f"argmax over the last dim differs from eager at {int(not_a_tie.sum())} positions"
    return None
