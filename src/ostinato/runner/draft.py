"""The draft model of `--speculative-method draft`: a second, smaller model of the same vocabulary proposes each
verify row's k tokens by k decode steps of its own, before the model's verify forward (runner/spec_verify.py).

Its KV cache is a pool of its own with the model's block ids: block b of the draft's pool holds the same
positions of the same sequence as block b of the model's. So the scheduler's block bookkeeping (allocation,
trim of rejected proposals' blocks, freeing, preemption, prefix caching) covers both caches at once, and the
draft needs none of its own; the KV budget pays for both (KVSpec.extra_block_bytes). What the draft computes
each step (engine/speculative.py keeps the scheduler's side of it):
- the step's prompt chunks, K/V only, so its cache holds every prompt (recomputes after a preemption too);
- for each verify row: its draft_prefix and its last token, in the same forward as the prompt chunks, whose
  logits at the last token give the first proposal; then one step per further proposal, each feeding the
  proposal before it. A row with k proposals writes the positions of its last token and of its first k - 1
  proposals; rejected ones are overwritten by the next step, as in the model's cache.

Each proposal is drawn from q, the draft's distribution under the row's own settings (temperature, top-k,
top-p: sampler.distribution; the argmax on greedy rows) with noise keyed apart from the model's draws
(DRAFT_KEY_SALT), and q goes to the verify step for rejection sampling.

Where the steps run: through the prefill path (`prefill_forward`), a prefill-graph replay of the draft's own
captured graphs on a GPU when a step fits one (a step of B one-token rows is a B-token prefill step, up to
--prefill-graph-max-seqs rows), eager otherwise. Each step's proposals are read to the host to build the next
step's inputs: k small syncs per verify step. Capturing the draft's k steps as one graph of the decode kind
(runner/graphs.py) would remove those; it needs the proposals fed on the device, which this module's
`_step_chunks` is the seam for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from ostinato.config import ModelConfig
from ostinato.contract import ScheduledSeq, SchedulerOutput
from ostinato.runner.inputs import to_device
from ostinato.runner.kv_setup import KVSpec, make_prefill_graphs
from ostinato.runner.memory import kv_block_bytes
from ostinato.runner.prefill_graphs import PrefillGraphs
from ostinato.runner.sampler import distribution, draw_from, row_key, uniform
from ostinato.runner.sampling_state import BLOCKS, filtered_rows, read_settings, write_settings
from ostinato.runner.spec_verify import prefill_forward

logger = logging.getLogger(__name__)

# XORed into a row's sampling key for the draft's draws: its noise must be independent of the model's accept
# and residual draws at the same counters (runner/spec_verify.py).
DRAFT_KEY_SALT = 0x2545F4914F6CDD1D


def draft_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block of the draft's KV pool takes (charged beside the model's in the KV budget)."""
    return kv_block_bytes(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype.itemsize)


@dataclass(frozen=True)
class DraftProposals:
    """A step's proposals: `out` with every placeholder filled, and q [proposals, vocab] float32, the
    distribution each proposal was drawn from, in the order of out's verify rows and their proposals (None when
    every row is greedy: the verify step then needs only the tokens)."""

    out: SchedulerOutput
    q: torch.Tensor | None


class DraftModel:
    """The draft model with its KV pool of num_blocks blocks (+ the scratch block, num_blocks, as the model's)."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, engine_seed: int):
        self.model, self.config = model, config
        self.block_size, self.scratch_block, self.device = block_size, num_blocks, device
        self.engine_seed = engine_seed
        pool = torch.zeros(config.num_layers, 2, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim,
                           dtype=dtype, device=device)
        model.bind_kv_caches([(pool[i, 0], pool[i, 1]) for i in range(config.num_layers)])
        self.prefill_graphs: PrefillGraphs | None = None  # capture_graphs() sets them on a GPU
        # `ostinato bench spec --draft-acceptance` (tools/bench/spec.py, ForcedAcceptance): sees each step
        # (observe(out)) and may replace each draft step's tokens (override(seqs, j, drawn)); None in service.
        self.override = None

    def capture_graphs(self, kv_spec: KVSpec, backend) -> None:
        """The draft's own prefill graphs, at the model's captured token counts (a draft step of B rows is a
        B-token prefill step). They are the graphs of a prefill-only step: no decode rows ride in them."""
        graph = replace(kv_spec.graph_config, mixed_step="two-replays")
        spec = replace(kv_spec, model=self.model, model_config=self.config, graph_config=graph)
        graphs = make_prefill_graphs(spec, self.scratch_block, graph.prefill_sizes, progress=False, backend=backend)
        report = graphs.capture()
        if graphs.enabled:
            logger.info("captured %d prefill graphs of the draft model (its steps) in %.2f s", len(report.sizes),
                        report.seconds)
        self.prefill_graphs = graphs

    def propose(self, out: SchedulerOutput) -> DraftProposals:
        """Run the draft over the step (see the module docstring) and fill the verify rows' placeholders."""
        if self.override is not None:
            self.override.observe(out)
        verify = [s for s in out.seqs if s.verify]
        k = [len(s.token_ids) - 1 for s in verify]
        first = SchedulerOutput("prefill", tuple(_first_chunk(s) for s in out.seqs))
        hidden = prefill_forward(self.model, self.prefill_graphs, first, self.block_size, self.scratch_block,
                                 self.device)
        ends = np.cumsum([len(s.token_ids) for s in first.seqs]) - 1
        verify_ends = [int(e) for e, s in zip(ends, out.seqs) if s.verify]
        active = [i for i in range(len(verify)) if k[i] > 0]
        if not active:
            return DraftProposals(out, None)
        needs_q = any(not verify[i].sampling_params.greedy for i in active)
        logits = self.model.compute_logits(hidden[to_device([verify_ends[i] for i in active], torch.int64,
                                                            self.device)])
        proposals: list[list[int]] = [[] for _ in verify]
        qs: list[torch.Tensor] = []
        q_at: dict[tuple[int, int], int] = {}  # (verify row, proposal index) -> row of the concatenated qs
        j = 0
        while True:
            tokens, q = self._draw([verify[i] for i in active], logits, j, needs_q)
            if q is not None:
                q_at.update({(i, j): sum(len(t) for t in qs) + r for r, i in enumerate(active)})
                qs.append(q)
            for i, t in zip(active, tokens):
                proposals[i].append(t)
            j += 1
            active = [i for i in active if k[i] > j]
            if not active:
                break
            hidden = prefill_forward(self.model, self.prefill_graphs, self._step_chunks(verify, active, proposals),
                                     self.block_size, self.scratch_block, self.device)
            logits = self.model.compute_logits(hidden[:len(active)])
        filled = iter(proposals)
        seqs = tuple(replace(s, token_ids=(s.token_ids[0], *next(filled))) if s.verify else s for s in out.seqs)
        q = None
        if needs_q:
            order = [q_at[(i, p)] for i in range(len(verify)) for p in range(k[i])]
            q = torch.cat(qs)[to_device(order, torch.int64, self.device)]
        return DraftProposals(replace(out, seqs=seqs), q)

    def _step_chunks(self, verify: list[ScheduledSeq], active: list[int], proposals: list[list[int]]
                     ) -> SchedulerOutput:
        """A further draft step: each active row feeds its newest proposal, at the position after the last."""
        return SchedulerOutput("prefill", tuple(
            replace(verify[i], token_ids=(proposals[i][-1],), start_pos=verify[i].start_pos + len(proposals[i]),
                    verify=False, samples=True, draft_prefix=()) for i in active))

    def _draw(self, seqs: list[ScheduledSeq], logits: torch.Tensor, j: int, needs_q: bool
              ) -> tuple[list[int], torch.Tensor | None]:
        drawn, q = draw_proposals(seqs, logits, j, needs_q, self.engine_seed, self.device)
        if self.override is not None:
            drawn = self.override(seqs, j, drawn)
        return drawn, q


def draw_proposals(seqs: list[ScheduledSeq], logits: torch.Tensor, j: int, needs_q: bool, engine_seed: int,
                   device: torch.device) -> tuple[list[int], torch.Tensor | None]:
    """Proposal j + 1 of each verify row from the draft's logits [rows, vocab], drawn at the counter the model's
    position j draws at with the row's key salted (DRAFT_KEY_SALT), read to the host; and q, the distribution
    it came from (None unless needs_q: greedy rows take the argmax)."""
    rows = np.zeros((len(seqs), BLOCKS), dtype=np.int32)
    for row, seq in zip(rows, seqs):
        p = seq.sampling_params
        write_settings(row, p, row_key(p.seed, engine_seed, seq.seq_id) ^ DRAFT_KEY_SALT, seq.num_generated + j)
    batch = read_settings(to_device(rows, torch.int32, device), None, bool(filtered_rows(rows).any()))
    q = distribution(logits, batch) if needs_q else None
    tokens = draw_from(q, uniform(batch.key, batch.counter)) if q is not None else logits.argmax(dim=-1)
    return tokens.tolist(), q


def _first_chunk(seq: ScheduledSeq) -> ScheduledSeq:
    """The draft's part of a step's chunk in its first forward: a prompt chunk as it is (K/V only), a verify
    row's draft_prefix and last token (its logits give the first proposal)."""
    if not seq.verify:
        return replace(seq, samples=False)
    prefix = seq.draft_prefix
    return replace(seq, token_ids=(*prefix, seq.token_ids[0]), start_pos=seq.start_pos - len(prefix), verify=False,
                   samples=True, draft_prefix=())
