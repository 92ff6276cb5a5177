"""Start-up self-check of the prefill graphs (runner/prefill_graphs.py): every captured size replayed against
the captured function run eagerly on the same padded buffers, and (fp32) against the unpadded eager prefill."""

from __future__ import annotations

import math

import numpy as np
import torch

from ostinato.contract import ScheduledSeq, SchedulerOutput
from ostinato.sampling_params import SamplingParams
from ostinato.runner.graphs import default_compare
from ostinato.runner.inputs import build_prefill_inputs
from ostinato.runner.prefill_graphs import INPUTS, PrefillGraphs


def check_prefill_graphs(graphs: PrefillGraphs, model: torch.nn.Module, num_blocks: int, vocab_size: int,
                         compare=default_compare) -> None:
    """Replay every captured size against the eager prefill path (runner/inputs.py) on the same chunks and
    compare the logits of their tokens (up to 32 rows, the sampled ones included); a mismatch disables the
    graphs like a failed capture (fallback policy). Each size holds two chunks that leave it partly padding:
    the first after a cached prefix that ends inside a block (written by an eager prefill first), the second
    from position 0. Runs at start-up, before any sequence holds KV, so it may write any real block; the
    replays are not counted in the stats."""
    bs = graphs.block_size
    params = SamplingParams(temperature=0.0, max_tokens=1)
    gen = torch.Generator().manual_seed(0)
    room = max(1, num_blocks * bs // 2)  # tokens of each half of the pool
    previous = 0
    for size in graphs.captured_sizes:
        n = max(1, min(max(size * 3 // 4, previous + 1), room))  # padded (more so when the pool is small)
        previous = size
        q0, q1 = (n + 1) // 2, n // 2
        prefix = max(0, min(3 * bs + bs // 2, room - q0))
        ids = torch.randint(0, vocab_size, (prefix + n,), generator=gen).tolist()
        first = tuple(range(math.ceil((prefix + q0) / bs)))
        second = tuple(range(len(first), len(first) + math.ceil(q1 / bs)))
        if prefix:
            _eager_hidden(model, (ScheduledSeq(0, tuple(ids[:prefix]), 0, first, params, 0, samples=False),), graphs)
        seqs = [ScheduledSeq(0, tuple(ids[prefix:prefix + q0]), prefix, first, params, 0)]
        if q1 and graphs.max_seqs >= 2 and second[-1] < num_blocks:
            seqs.append(ScheduledSeq(1, tuple(ids[prefix + q0:]), 0, second, params, 0))
        seqs = tuple(seqs)
        eager_hidden = _eager_hidden(model, seqs, graphs)
        real, last_rows = graphs.fill(seqs, size)
        rows = sorted(set(np.linspace(0, real - 1, min(real, 32)).round().astype(int).tolist()) | set(last_rows))
        rows_dev = torch.tensor(rows, device=graphs.device)
        # (1) The replay against the captured function run eagerly on the same filled buffers, at the same
        # padded size: the same kernels on the same shapes, so any difference is the capture's fault.
        same_inputs = graphs.forward(**{name: graphs.tokens[i][:size] for i, name in enumerate(INPUTS)})
        replayed = model.compute_logits(graphs.graphs.replay_filled(real, size)[rows_dev])
        mismatch = compare(replayed, model.compute_logits(same_inputs[rows_dev]))
        # (2) Against the eager prefill path (runner/inputs.py), unpadded: the padding must not change the real
        # rows. In fp32 that holds to rounding; in 16-bit dtypes the padded GEMMs run at another M and cuBLAS
        # picks other kernels (another summation order), so there it is left to the fp32 tests.
        if mismatch is None and eager_hidden.dtype == torch.float32:
            mismatch = compare(replayed, model.compute_logits(eager_hidden[rows_dev]))
        if mismatch is not None:
            graphs.graphs.disable(size, f"prefill graph self-check failed for {size} tokens (chunks of {q0} and "
                                  f"{real - q0} tokens, the first after a cached prefix of {prefix}): {mismatch}. The "
                                  "replay computes something else than the eager prefill. --skip-graph-check skips "
                                  "this check, --prefill-graph-tokens none turns prefill graphs off.")
            break
    graphs.forget_counts()


def _eager_hidden(model: torch.nn.Module, seqs: tuple[ScheduledSeq, ...], graphs: PrefillGraphs) -> torch.Tensor:
    inp = build_prefill_inputs(SchedulerOutput("prefill", seqs), graphs.block_size, graphs.scratch_block,
                               graphs.device)
    return model(inp.input_ids, inp.positions, inp.meta)
