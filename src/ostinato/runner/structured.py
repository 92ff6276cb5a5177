"""Grammar masks on the device: the constrained rows' logits masked to what their grammar allows, and their
tokens drawn again from the masked logits.

The engine fills the bitmasks on the CPU (engine/grammar.py) and hands the runner a `GrammarMasks` callable with
the step. The runner calls it once the step's forward is launched, so the filling (which first waits for the
token the previous step sampled: the matchers must have accepted it) runs while the GPU computes this step. The
masks then go to the device and are applied eagerly after the decode graph's replay, on its static logits, and the
constrained rows are drawn again with their own sampling settings (the graph's draw for those rows is replaced).
Rows without a grammar keep the graph's draw: a batch without a constrained row never reaches this module.
The bitmask application is xgrammar's (a Triton kernel on a GPU, its CPU kernel elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ostinato.runner.inputs import to_device
from ostinato.runner.sampler import sample_rows

# masks(seq_ids of the step's rows, in row order) -> (positions of the constrained rows among them, their
# bitmask [k, ceil(vocab / 32)] int32 on the CPU), or None when no row is constrained.
GrammarMasks = Callable[[Sequence[int]], "tuple[list[int], torch.Tensor] | None"]


def mask_logits(logits: torch.Tensor, seq_ids: Sequence[int], masks: GrammarMasks) -> torch.Tensor | bool | None:
    """Set the logits [n, vocab] of the constrained rows among `seq_ids` to -inf outside their grammar, in place;
    returns those rows' positions as a device index, True when every row is constrained (no index needed), or None
    when none is."""
    found = masks(seq_ids)
    if found is None:
        return None
    from xgrammar import apply_token_bitmask_inplace

    positions, bitmask = found
    bitmask = bitmask.to(logits.device, non_blocking=True)
    vocab = logits.shape[1]
    if len(positions) == logits.shape[0]:  # every row constrained: no gather, no index to copy over
        apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        return True
    index = to_device(positions, torch.int64, logits.device)
    rows = logits.index_select(0, index)
    apply_token_bitmask_inplace(rows, bitmask, vocab_size=vocab)
    logits.index_copy_(0, index, rows)
    return index


def constrain_decode(logits: torch.Tensor, rows: torch.Tensor, sampled: torch.Tensor, seq_ids: Sequence[int],
                     masks: GrammarMasks, batch_invariant: bool = False) -> None:
    """After a decode replay: mask the constrained rows' logits [n, vocab] (in place, so that the eager finish and
    the logprobs see them masked) and draw those rows again into sampled[:n], each on its own settings (rows:
    the step's device rows; batch_invariant: as sample_rows)."""
    index = mask_logits(logits, seq_ids, masks)
    if index is None:
        return
    if index is True:  # every row: drawn again in place, without copying the [n, vocab] logits
        sample_rows(logits, rows, sampled, batch_invariant)
        return
    tokens = torch.empty(index.shape[0], dtype=torch.int64, device=logits.device)
    sample_rows(logits.index_select(0, index), rows.index_select(0, index), tokens, batch_invariant)
    sampled.index_copy_(0, index, tokens)
