"""The decode step the graphs capture: unpack the persistent rows, run the model, sample in the graph.

`DecodeStep(batch)` takes the one static input (`DecodeLayout`), returns the logits [B, vocab] (the graph's
static output, which the self-check compares with eager and logprobs read) and writes the sampled token
ids into `sampled` (greedy, temperature and seeded rows; top-k / top-p rows are re-drawn after the replay,
see runner/sampler.py). The same object runs eager on CPU, above the largest captured size, and in bench.

The logits processors (penalties, logit_bias, bad words, min_tokens, min_p: runner/logits_processors.py) are
work most steps do not need, so the step comes in two variants, captured as two graph sets: `run(batch,
processors=False)` launches none of their work, `processors=True` runs them before the draw. A step replays
the second only while some row uses one (DecodeBatch.uses_processors, a host count kept at join and leave),
which is exact: the processors' tables change only for rows that use them, so skipping them on a batch where
none does changes nothing. The variant with them is captured at fewer sizes (`processor_sizes`): a batch that
uses them pads up to the next of those, and only such batches pay for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ostinato.kernels import unpack as unpack_kernel
from ostinato.runner.decode_batch import BLOCKS, POS, TOKEN, DecodeBatch, DecodeLayout, resolve_placeholders
from ostinato.runner.graphs import CudaGraphRunner, GraphBackend, default_compare
from ostinato.runner.logits_processors import LogitsProcessors
from ostinato.runner.sampler import sample_rows

# logits_fn(input_ids, positions, slot_mapping, block_tables, context_lens) -> [B, vocab] logits
LogitsFn = Callable[..., torch.Tensor]


class DecodeStep:
    def __init__(self, logits_fn: LogitsFn, layout: DecodeLayout, device: torch.device, engine_seed: int,
                 vocab_size: int | None = None, batch_invariant: bool = False):
        self.logits_fn = logits_fn
        self.batch_invariant = batch_invariant  # --batch-invariant: draws independent of the batch (sample_rows)
        self.layout = layout
        # The rows' logits processors (penalties, logit_bias, ...); None without a vocabulary (no row uses any).
        self.processors = LogitsProcessors(layout.rows, vocab_size, device) if vocab_size else None
        self.batch = DecodeBatch(layout, device, engine_seed, self.processors)
        self.sampled = torch.zeros(layout.rows, dtype=torch.int64, device=device)  # written by every step

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """The step eagerly, with the processors only when some row uses them (bench, tests)."""
        return self.run(batch, self.batch.uses_processors)

    def run(self, batch: torch.Tensor, processors: bool) -> torch.Tensor:
        """The step; `processors`: run the rows' logits processors (fixed per graph set, never per row)."""
        # Placeholders are read here, before this step overwrites `sampled`.
        ids, positions, slots, context_lens = self.unpack(batch)
        logits = self.logits_fn(ids, positions, slots, batch[:, BLOCKS:], context_lens)
        self.sample(logits, batch, processors)
        return logits

    def unpack(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(input ids with placeholders resolved, positions, slot mapping, context lengths) of the rows: one
        Triton kernel on a GPU (kernels/unpack.py), DecodeLayout.unpack and resolve_placeholders elsewhere."""
        if unpack_kernel.available_for(batch):
            return unpack_kernel.unpack(batch, self.sampled, self.layout.block_size, TOKEN, POS, BLOCKS)
        u = self.layout.unpack(batch)
        return (resolve_placeholders(u["input_ids"], self.sampled), u["positions"], u["slot_mapping"],
                u["context_lens"])

    def sample(self, logits: torch.Tensor, rows: torch.Tensor, processors: bool = True) -> None:
        """Draw the rows' tokens from logits [B, vocab] into sampled[:B]; rows: the packed decode rows [>= B,
        width] holding their settings. The decode graph and a mixed step (runner.py, _launch_mixed) both draw
        through here (sample_rows, as prefill steps do). The rows' logits processors run first, on the tokens
        they feed (their last outputs, read before `sampled` is overwritten); processors=False: no row uses
        any, and none of their work is launched."""
        b = logits.shape[0]
        if processors and self.processors is not None:
            fed = resolve_placeholders(rows[:b, TOKEN].long(), self.sampled)
            self.processors.process_logits(logits, rows, fed)
        sample_rows(logits, rows, self.sampled[:b], self.batch_invariant)

    def graph_runner(self, sizes: tuple[int, ...], enforce_eager: bool, fallback: str, progress: bool,
                     backend: GraphBackend | None, processors: bool = False, pool=None) -> CudaGraphRunner:
        """Graphs over one variant of this step, reading the batch's device rows as their static input (pool:
        the memory pool both variants share)."""
        return CudaGraphRunner(functools.partial(self.run, processors=processors), self.layout.static_inputs(),
                               sizes, self.batch.device, fallback=fallback, enforce_eager=enforce_eager,
                               progress=progress, backend=backend, buffers={"batch": self.batch.dev}, pool=pool,
                               step_name="decode step with logits processors" if processors else "decode step")

    def sampled_rows(self, size: int) -> torch.Tensor:
        return self.sampled[:size]


def processor_sizes(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes the variant with the logits processors is captured at: the powers of two among `sizes` and the
    largest. A quarter of the default set's capture time and graphs, for at most twice the rows of padding on
    the steps that use a processor."""
    return tuple(s for s in sorted(set(sizes)) if s & (s - 1) == 0 or s == max(sizes))


def compare_step(graph: tuple[torch.Tensor, torch.Tensor], eager: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """Self-check of a step on greedy rows: logits as default_compare judges them, and the tokens sampled in
    the graph equal to eager's on every row where the logits' argmax is not a tie (default_compare allows
    those), and always equal to the graph's own argmax."""
    (g_logits, g_tokens), (e_logits, e_tokens) = graph, eager
    mismatch = default_compare(g_logits, e_logits)
    if mismatch is not None:
        return mismatch
    if not torch.equal(g_tokens, g_logits.float().argmax(-1)):
        return "the tokens sampled in the graph are not the argmax of its logits (greedy rows)"
    same_top = g_logits.float().argmax(-1) == e_logits.float().argmax(-1)
    if not torch.equal(g_tokens[same_top], e_tokens[same_top]):
        return "the tokens sampled in the graph differ from eager's"
    return None
