"""The verify step of speculative decoding: one forward over every verify row's k + 1 tokens (and the step's
prompt chunks), every position of a verify row sampled, and the longest run of accepted proposals kept.

Two forwards (SpecVerifier). A step of verify rows only, the steady state, is flattened into decode rows
(runner/verify_rows.py: row j of a chunk at position start + j, its counter num_generated + j) and replays the
decode graph of their count, which samples inside as a decode step does: the decode kernels, one replay, no
eager sampling. Any other step takes the prefill path (runner/prefill_graphs.py when it fits a captured token
count, else eager): a verify row is a chunk whose start position is its cached context, which chunked prefill
attends already (the query tokens see the paged cache before them and each other causally), so prompt chunks
ride in the same forward. Both attend exactly causally and draw each position with the same settings and
counter, so they keep the same tokens (up to the last bits of the logits, which the two kernel sets sum in other
orders).

Acceptance, one rule for greedy, sampled and seeded rows. Position j of a row (j = 0 .. k) is drawn as the
row's next-but-j decode draw would be: its own settings, counter num_generated + j (runner/sampler.py). The
row keeps the drawn tokens up to and including the first that differs from the proposal at its position (the
last one, drawn after every proposal matched, is the bonus token). With a one-hot draft (prompt lookup) this is
Leviathan et al.'s rejection sampling: the proposal x is accepted with probability p(x) = min(1, p(x) / q(x)),
and on rejection the token drawn is distributed as p restricted to the tokens other than x, renormalised, which
is the residual max(0, p - q) / (1 - p(x)). Greedy rows accept exactly the proposals equal to the argmax. And
since the draws use the counters a plain decode would, a seeded row gets the tokens it gets without
speculation wherever the logits are the same (docs/ARCHITECTURE.md, "Speculative decoding").

With a draft model (runner/draft.py) the proposals come with their distribution q, and a sampled row's
proposed positions take Leviathan et al.'s rule with that q (`rejection_sample`, run as the draw's `adjust`):
the proposal x is kept when u * q(x) < p(x) (u: the position's own uniform, as above), else the token is drawn
from max(0, p - q), renormalised (with noise keyed apart, RESIDUAL_KEY_SALT). A rejected position's token is
never x (its residual mass is 0), so `accept` keeps the same run. Greedy rows keep the argmax rule.
"""

from __future__ import annotations

import numpy as np
import torch

from ostinato.contract import ScheduledSeq, SchedulerOutput, SpecCounts, StepResult
from ostinato.runner.inputs import build_prefill_inputs, to_device
from ostinato.runner.pending import PendingStep, from_host, plain_result
from ostinato.sampling_params import GREEDY_TEMPERATURE
from ostinato.runner.sampler import Sampler, distribution, draw_from, finish_sampling, row_key, uniform
from ostinato.runner.sampling_state import (BLOCKS, CTR, SamplingBatch, filtered_rows, read_settings,
                                            write_settings)
from ostinato.runner.verify_rows import flatten_verify_rows, num_verify_rows

# XORed into a row's key for the residual draw of a rejected draft proposal: independent of the accept test's
# uniform at the same counter.
RESIDUAL_KEY_SALT = 0x6A09E667F3BCC909


def logit_rows(seqs: tuple[ScheduledSeq, ...]) -> tuple[list[int], list[ScheduledSeq]]:
    """(the forward's rows whose logits are sampled, the chunks they belong to, in order): every row of a verify
    chunk, the last row of a prompt chunk that samples. Chunks lie consecutively from row 0, in step order, in
    both the eager and the graph layout (runner/inputs.py, write_prefill_chunks)."""
    rows, sampled, offset = [], [], 0
    for seq in seqs:
        q = len(seq.token_ids)
        if seq.verify:
            rows.extend(range(offset, offset + q))
        elif seq.samples:
            rows.append(offset + q - 1)
        if seq.verify or seq.samples:
            sampled.append(seq)
        offset += q
    return rows, sampled


def sampled_hidden(hidden: torch.Tensor, rows: list[int], device: torch.device) -> torch.Tensor:
    """The hidden states of the logit rows (logit_rows' order). When they are rows 0 .. len - 1 (every chunk a
    verify row, all of whose positions sample: a speculative engine's steady state), a view: no index tensor
    to build and copy to the device. Else a gather."""
    if rows[-1] == len(rows) - 1:  # strictly ascending from >= 0 and ending at len - 1: exactly 0 .. len - 1
        return hidden[: len(rows)]
    return hidden[to_device(rows, torch.int64, device)]


def accept(seqs: list[ScheduledSeq], drawn: list[int]) -> tuple[list[int], list[int], SpecCounts]:
    """(indices into `drawn` that are kept, their seq ids, the step's counts). drawn: the sampled token of every
    logit row (logit_rows' order). A verify row keeps its draws up to and including the first that differs from
    the proposal at its position; a prompt chunk keeps its one draw."""
    kept, ids = [], []
    rows = proposed = accepted = 0
    i = 0
    for seq in seqs:
        if not seq.verify:
            kept.append(i)
            ids.append(seq.seq_id)
            i += 1
            continue
        proposals = seq.token_ids[1:]
        a = 0
        while a < len(proposals) and drawn[i + a] == proposals[a]:
            a += 1
        kept.extend(range(i, i + a + 1))
        ids.extend([seq.seq_id] * (a + 1))
        rows += bool(proposals)
        proposed += len(proposals)
        accepted += a
        i += len(seq.token_ids)
    return kept, ids, SpecCounts(rows, proposed, accepted)


def prefill_forward(model, prefill_graphs, out: SchedulerOutput, block_size: int, scratch_block: int,
                    device: torch.device) -> torch.Tensor:
    """A prefill-shaped step's final hidden states [tokens, hidden], its chunks' rows consecutive from row 0: a
    replay of prefill_graphs when the step fits one, else eager. The verify forward and the draft's steps."""
    replayed = prefill_graphs.run(out) if prefill_graphs is not None else None
    if replayed is not None:
        return replayed[0]
    inp = build_prefill_inputs(out, block_size, scratch_block, device)
    return model(inp.input_ids, inp.positions, inp.meta)


def proposed_rows(seqs: list[ScheduledSeq]) -> tuple[list[int], list[int]]:
    """(the logit rows (logit_rows' order) that test a proposal, the proposal each tests), verify row after
    verify row: row j of a verify chunk tests its proposal j + 1."""
    rows, proposals, offset = [], [], 0
    for seq in seqs:
        q = len(seq.token_ids) if seq.verify else 1
        if seq.verify:
            rows.extend(range(offset, offset + q - 1))
            proposals.extend(seq.token_ids[1:])
        offset += q
    return rows, proposals


def rejection_sample(tokens: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor,
                     proposals: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """tokens [R] (the draw of every logit row) with the sampled rows' proposed positions rows [P] redrawn by
    rejection sampling against the draft's q [P, vocab] (the module docstring): the proposal where
    u * q(x) < p(x), else a draw from max(0, p - q). p: the position's distribution (sampler.distribution,
    under the row's settings). Greedy rows keep their argmax. Device work only."""
    sub = SamplingBatch(len(rows), batch.rows[rows], batch.any_filtered, None, None)
    p = distribution(logits[rows], sub)  # [P, V]
    x = proposals[:, None]
    keep = uniform(sub.key, sub.counter) * q.gather(1, x).squeeze(1) < p.gather(1, x).squeeze(1)
    residual = (p - q).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q up to rounding: nothing is ever rejected there
    residual = torch.where(empty, p, residual)
    redrawn = draw_from(residual, uniform(sub.key ^ RESIDUAL_KEY_SALT, sub.counter))
    drawn = torch.where(keep, proposals, redrawn)
    greedy = sub.temperature < GREEDY_TEMPERATURE
    out = tokens.clone()
    out[rows] = torch.where(greedy, tokens[rows], drawn)
    return out


class SpecVerifier:
    """Runs a speculative engine's steps (every step: verify rows and prompt chunks, no decode rows). drafter:
    the draft model (runner/draft.py) that fills the proposals first; None for prompt lookup.

    Two paths (`steps_by_path` counts them). "decode graph": a step of verify rows only whose rows, flattened
    (runner/verify_rows.py), fit a captured decode graph replays it, sampling inside; the decode kernels and
    one replay, where the prefill path launches its own kernels and samples eagerly. "prefill": every other
    step (prompt chunks beside the verify rows, more rows than the largest graph, decode graphs off)."""

    def __init__(self, model, prefill_graphs, block_size: int, scratch_block: int, device: torch.device,
                 engine_seed: int, drafter=None, decode_step=None, decode_graphs=None):
        self.model, self.prefill_graphs = model, prefill_graphs
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.engine_seed = engine_seed
        self.sampler = Sampler(device, engine_seed)
        self.drafter = drafter
        self.decode_step, self.decode_graphs = decode_step, decode_graphs  # the decode graphs' DecodeStep
        self.steps_by_path = {"decode graph": 0, "prefill": 0}
        # Steps of up to this many flattened rows take the decode-graph path with the decode step run eagerly
        # where no graph holds them: `bench host` sets it, to time that path's host work on a CPU. 0 otherwise.
        self.eager_decode_rows = 0

    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Run the step and read its tokens (a speculative step is synchronous: the next proposals need them)."""
        assert not out.num_decode, "a speculative step has verify rows, not decode rows"
        if not out.seqs:
            return PendingStep(StepResult([], [], []))
        q = None
        if self.drafter is not None:
            proposals = self.drafter.propose(out)
            out, q = proposals.out, proposals.q
        size = self.graph_size(out)
        if size is not None:
            self.steps_by_path["decode graph"] += 1
            seqs = list(out.seqs)
            drawn = self.replay_flattened(seqs, size, q)
        else:
            self.steps_by_path["prefill"] += 1
            rows, seqs = logit_rows(out.seqs)
            hidden = self.hidden(out)
            if not seqs:  # only prompt chunks that write K/V
                return PendingStep(StepResult([], [], []))
            logits = self.model.compute_logits(sampled_hidden(hidden, rows, self.device))
            drawn = self.draw(logits, seqs, q)
        kept, ids, counts = accept(seqs, drawn.token_ids)
        return PendingStep(StepResult(ids, [drawn.token_ids[i] for i in kept], [drawn.tokens[i] for i in kept],
                                      spec=counts))

    def graph_size(self, out: SchedulerOutput) -> int | None:
        """The decode graph the step's flattened rows replay, or None when it takes the prefill path."""
        if self.decode_graphs is None:
            return None
        n = num_verify_rows(out.seqs)
        if n is None:
            return None
        size = self.decode_graphs.graph_size(n)
        return n if size is None and n <= self.eager_decode_rows else size

    def replay_flattened(self, seqs: list[ScheduledSeq], size: int, q: torch.Tensor | None) -> StepResult:
        """Every verify row's positions as decode rows, one decode-graph replay of `size` rows that draws them
        (as decode draws: each row's settings and counter), then the eager finish where a row asks for one
        (top-k / top-p, logprobs, a draft's rejection sampling), read to the host. Seq ids are not filled in."""
        flat = flatten_verify_rows(tuple(seqs), self.engine_seed, self.scratch_block)
        n = len(flat)
        rows = self.decode_step.batch.load_transient(flat.rows, size)
        logits = self.decode_graphs.replay_filled(n)  # [n, vocab]; the tokens drawn into decode_step.sampled
        tokens = self.decode_step.sampled[:n]
        if q is None and flat.num_logprobs is None and not flat.any_filtered:
            return plain_result([0] * n, tokens.tolist())
        batch = read_settings(rows[:n], flat.num_logprobs, flat.any_filtered)
        adjust = None if q is None else self.rejection(logits, seqs, batch, q)
        return from_host([0] * n, finish_sampling(logits, tokens.clone(), batch, adjust).to_host())

    def draw(self, logits: torch.Tensor, seqs: list[ScheduledSeq], q: torch.Tensor | None = None) -> StepResult:
        """Every logit row's token (logits [rows, vocab], logit_rows' order), drawn with its chunk's settings and
        the counter of its position, read to the host (with logprobs where asked). Seq ids are not filled in.
        q: the draft's distribution of every proposal (proposed_rows' order), None for one-hot proposals."""
        batch = self.settings(seqs)
        adjust = None if q is None else self.rejection(logits, seqs, batch, q)
        return from_host([0] * logits.shape[0], self.sampler(logits, batch, adjust).to_host())

    def rejection(self, logits: torch.Tensor, seqs: list[ScheduledSeq], batch: SamplingBatch, q: torch.Tensor):
        """The sampler's `adjust` that applies the draft's rejection sampling to the proposed positions."""
        rows, proposals = proposed_rows(seqs)
        rows_d = to_device(rows, torch.int64, self.device)
        proposals_d = to_device(proposals, torch.int64, self.device)
        return lambda tokens: rejection_sample(tokens, logits, batch, rows_d, proposals_d, q)

    def hidden(self, out: SchedulerOutput) -> torch.Tensor:
        """The forward's final hidden states [tokens, hidden]: a prefill-graph replay, else eager."""
        return prefill_forward(self.model, self.prefill_graphs, out, self.block_size, self.scratch_block,
                               self.device)

    def settings(self, seqs: list[ScheduledSeq]):
        """The sampling rows of every logit row: a chunk's settings, its counter stepping one per position."""
        counts = [len(s.token_ids) if s.verify else 1 for s in seqs]
        per_seq = np.zeros((len(seqs), BLOCKS), dtype=np.int32)
        num_logprobs: list[int | None] = []
        counters: list[int] = []
        for row, seq, q in zip(per_seq, seqs, counts):
            p = seq.sampling_params
            write_settings(row, p, row_key(p.seed, self.engine_seed, seq.seq_id), seq.num_generated)
            num_logprobs += [p.logprobs] * q
            counters += range(seq.num_generated, seq.num_generated + q)
        rows = per_seq.repeat(counts, axis=0)  # one numpy call for every position's row, not a few per sequence
        rows[:, CTR] = counters
        return read_settings(to_device(rows, torch.int32, self.device), num_logprobs, bool(filtered_rows(rows).any()))
