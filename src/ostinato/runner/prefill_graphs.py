"""Prefill steps as CUDA-graph replays at fixed token counts (a chunk beside running decodes).

An eager forward of the 8B costs ~11 ms of host-side launches whatever its size up to ~500 tokens, while its
GPU work at 100-250 tokens is ~4-6 ms; so a mixed step (decode replay + eager chunk) stalled the running
decodes on launches. Here a prefill step of n tokens in k sequences replays the graph of the smallest captured
token count T >= n, when k <= max_seqs; any other step runs eager, as before, and is counted.

Static inputs, filled by three host-to-device copies per step (nothing else is copied or allocated):
    tokens        [3, T_max] int64: input ids, positions, slot mapping; the graph of T reads [:, :T]
    lengths       [2 * S + 3] int32: query_start_loc[0..S] (S + 1 entries), then context_lens[0..S]
    block_tables  [S + 1, W] int32, W = ceil(max_model_len / block_size)
with S = max_seqs. Sequence slots 0..k-1 hold the step's chunks (their tokens are rows [0, n), in the order
of the eager path), slots k..S-1 are empty (no new tokens, context 0), and slot S is the padding sequence:
it owns rows [n, T), which sit at positions 0..T-n-1 in the scratch block (its block-table row is the scratch
block throughout, set once), so padded tokens write K/V only there and attend only over there: every row
of the output is finite, and the padded rows are never read. The graph itself closes query_start_loc with T
and sets the padding sequence's context to T - query_start_loc[S] (device ops, T fixed per graph), so a
graph is consistent whatever the buffers hold, at warm-up and capture too.

Why the attention kernel is graph-safe here (kernels/prefill_one_pass.py, `_prefill_kernel`): its grid is
(cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads) and we pass max_query_len = T and num_seqs = S + 1,
both fixed per graph; a program reads its sequence's query length and context from the device tensors and
returns at once when its query tile starts past that sequence's length (`q_block * BLOCK_Q >= q_len`), so
empty slots and short sequences cost one early exit. The metadata carries no host lengths (query_lens and
context_lens_host are None), and max_context_len is the static bound max_model_len; a backend that plans its
launch from host figures must plan from shapes when they are None (the split-KV prefill does: its
"shapes only" plan, whose grid covers every token up to query_start_loc[num_seqs] = T). The torch backend's
prefill reads lengths on the host (.tolist()): it cannot be captured, so on a GPU prefill graphs need the
Triton backend (the runner turns them off otherwise). On CPU, RecordingGraphBackend runs this very code
without capture (tests).

Mixed steps (run_mixed, --mixed-step one-replay): the step's n decode rows come first, one token each (rows
0..n-1 of `tokens`, their input ids possibly placeholders for the decode step's `sampled`, resolved inside
the graph), and the chunks' sequences start at row n. Two more buffers, filled only then: decode_tables
[D, blocks_per_seq] and decode_contexts [D] (D = min(max_num_seqs, T) rows in the graph of T tokens), which
the decode kernel reads for rows 0..D-1 (AttentionMetadata.decode_rows); a context of 0 marks a row that is
not a decode row, and every fill zeroes the rows the previous one used. The start-up self-check is in
runner/prefill_graph_check.py.

Graph memory: every size shares one pool (largest captured first), so it is about the activations of the
largest T; start-up charges it to the KV budget like the decode graphs' (runner/kv_setup.py) and reports it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ostinato.attention.base import AttentionMetadata
from ostinato.contract import ScheduledSeq, SchedulerOutput
from ostinato.errors import CudaGraphCaptureError
from ostinato.runner.decode_batch import BLOCKS, POS, TOKEN, resolve_placeholders
from ostinato.runner.graphs import CaptureReport, CudaGraphRunner, GraphBackend, StaticInput
from ostinato.runner.inputs import kv_slots, write_prefill_chunks

logger = logging.getLogger(__name__)

INPUTS = ("input_ids", "positions", "slot_mapping")  # the rows of `tokens`, in order


@dataclass(frozen=True)
class PrefillGraphStats:
    """Counters since start-up. Every prefill step (a mixed step's chunks included) is a replay or eager."""

    captured_sizes: tuple[int, ...]
    graph_steps: int
    eager_steps: int  # graphs off, or a step above the largest size / with more than max_seqs sequences
    padded_tokens: int  # tokens of replays computed only to fill the graph
    replays_by_size: dict[int, int] = field(default_factory=dict)
    mixed_steps: int = 0  # replays that carried the step's decode rows too (run_mixed: one forward for both)


class PrefillGraphs:
    """Captured prefill forwards (the model up to its final hidden states; logits stay outside) over static
    buffers; see the module docstring for the layout. `run(out)` replays a step that fits, else returns None
    and counts the step as eager (the runner then runs its eager path)."""

    def __init__(self, model: torch.nn.Module, sizes: Sequence[int], max_seqs: int, blocks_per_seq: int,
                 block_size: int, scratch_block: int, max_model_len: int, device: torch.device,
                 fallback: str = "error", enforce_eager: bool = False, progress: bool = False,
                 backend: GraphBackend | None = None, decode_rows: int = 0, sampled: torch.Tensor | None = None):
        self.model = model
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.device = device
        sizes = tuple(sorted(set(sizes)))
        enforce_eager = enforce_eager or not sizes
        t_max = max(sizes, default=1)
        # The padding sequence reads up to T_max positions through its block-table row: the width covers both
        # a real sequence (blocks_per_seq) and T_max tokens (a graph may be longer than max_model_len).
        width = max(blocks_per_seq, math.ceil(t_max / block_size))
        self._scratch_slot = int(kv_slots(np.array([scratch_block]), np.zeros(1, dtype=np.int64), block_size)[0])
        self.tokens = torch.zeros(3, t_max, dtype=torch.int64, device=device)
        self.tokens[2].fill_(self._scratch_slot)  # warm-up and capture write K/V only into the scratch block
        self.lengths = torch.zeros(2 * max_seqs + 3, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_seqs + 1, width), scratch_block, dtype=torch.int32, device=device)
        # Host mirrors, rewritten in place each step (then copied through fresh pinned memory: the caching host
        # allocator keeps it until its copy ran, so a step needs no wait for the one before).
        self._tokens_np = np.zeros((3, t_max), dtype=np.int64)
        self._tokens_np[2] = self._scratch_slot
        self._lengths_np = np.zeros(2 * max_seqs + 3, dtype=np.int32)
        self._tables_np = np.full((max_seqs, width), scratch_block, dtype=np.int32)
        # Padded tokens: positions only feed RoPE (the attention mask counts query rows), so any position below
        # max_model_len will do; their slots walk the scratch block.
        self._pad_positions = np.arange(t_max, dtype=np.int64) % max_model_len
        self._pad_slots = kv_slots(np.full(width, scratch_block, dtype=np.int64), np.arange(t_max), block_size)
        # Mixed steps (run_mixed): up to `decode_rows` decode rows ride first in the token buffers, attended by
        # the decode kernel (AttentionBackend.attend) over these tables and contexts; a context of 0 is no row.
        # Their input tokens may be placeholders -(r + 1) for sampled[r] (DecodeBatch), resolved in forward.
        self.decode_cap = min(decode_rows, t_max)
        self.sampled = sampled
        self.decode_tables = torch.full((max(self.decode_cap, 1), blocks_per_seq), scratch_block, dtype=torch.int32,
                                        device=device)
        self.decode_contexts = torch.zeros(max(self.decode_cap, 1), dtype=torch.int32, device=device)
        self._decode_contexts_np = np.zeros(max(self.decode_cap, 1), dtype=np.int32)
        self._decode_live = 0  # rows whose context on the device is not 0
        pad = {"input_ids": 0, "positions": 0, "slot_mapping": self._scratch_slot}
        self.graphs = CudaGraphRunner(
            self.forward, [StaticInput(name, (t_max,), torch.int64, pad[name]) for name in INPUTS],
            sizes or (1,), device, fallback=fallback, enforce_eager=enforce_eager, progress=progress,
            backend=backend, buffers={name: self.tokens[i] for i, name in enumerate(INPUTS)},
            step_name="prefill step (sizes in tokens)")
        self._eager_steps = 0
        self._mixed_steps = 0
        self._before: PrefillGraphStats | None = None  # counts of the start-up check, not reported

    def forget_counts(self) -> None:
        """From now on, stats() counts from zero (what the start-up check replayed is not a served step)."""
        self._before = self._raw_stats()

    # ---- the captured function --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """[T] inputs -> final hidden states [T, hidden]. Capturable: shapes come from T and S only."""
        t, s = input_ids.shape[0], self.max_seqs
        if self.sampled is not None:  # a decode row's placeholder: the token the last decode step sampled
            input_ids = resolve_placeholders(input_ids, self.sampled)
        # query_start_loc closed by T, and the padding sequence's context T - start: both fixed by the graph.
        starts = self.lengths[: s + 1]
        query_start_loc = torch.cat([starts, starts.new_full((1,), t)])
        contexts = self.lengths[s + 1:]
        context_lens = torch.cat([contexts[:s], t - starts[s:]])
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slot_mapping, block_tables=self.block_tables,
                                 context_lens=context_lens, query_start_loc=query_start_loc,
                                 max_query_len=t, max_context_len=self.max_model_len)
        if self.decode_cap:
            d = min(self.decode_cap, t)
            meta.decode_rows = AttentionMetadata(is_prefill=False, slot_mapping=slot_mapping[:d],
                                                 block_tables=self.decode_tables[:d],
                                                 context_lens=self.decode_contexts[:d],
                                                 max_context_len=self.max_model_len)
        return self.model(input_ids, positions, meta)

    # ---- state -----------------------------------------------------------------------------------------
    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return self.graphs.captured_sizes

    @property
    def enabled(self) -> bool:
        return self.graphs.graphs_enabled and bool(self.graphs.captured_sizes)

    def _raw_stats(self) -> PrefillGraphStats:
        g = self.graphs.stats
        return PrefillGraphStats(g.captured_sizes, g.graph_steps, self._eager_steps, g.padded_rows,
                                 dict(g.replays_by_size), self._mixed_steps)

    def stats(self) -> PrefillGraphStats:
        now, before = self._raw_stats(), self._before
        if before is None:
            return now
        replays = {k: v - before.replays_by_size.get(k, 0) for k, v in now.replays_by_size.items()}
        return PrefillGraphStats(now.captured_sizes, now.graph_steps - before.graph_steps,
                                 now.eager_steps - before.eager_steps, now.padded_tokens - before.padded_tokens,
                                 {k: v for k, v in replays.items() if v}, now.mixed_steps - before.mixed_steps)

    def capture(self) -> CaptureReport:
        try:
            return self.graphs.capture()
        except CudaGraphCaptureError as e:  # its message says "batch size": here it is tokens per prefill step
            raise CudaGraphCaptureError(f"prefill graphs (--prefill-graph-tokens: the size is tokens per step): "
                                        f"{e} --prefill-graph-tokens none keeps decode graphs and runs prefill "
                                        "eager.") from e

    # ---- a step ----------------------------------------------------------------------------------------
    def size_for(self, out: SchedulerOutput, decode_rows: int = 0) -> int | None:
        """The token count a step's chunks (with `decode_rows` decode rows beside them: run_mixed) replay at,
        or None when they do not fit a captured graph."""
        if not self.enabled or len(out.seqs) > self.max_seqs or decode_rows > self.decode_cap:
            return None
        return self.graphs.graph_size(decode_rows + sum(len(s.token_ids) for s in out.seqs))

    def run_mixed(self, out: SchedulerOutput, decode_rows: np.ndarray, size: int) -> tuple[torch.Tensor, list[int]]:
        """Replay the step's decode rows ([n, width] rows of the persistent DecodeBatch, one token each, first)
        and its chunks in one forward at `size` tokens (from size_for(out, n)). Returns (hidden states [n +
        chunk tokens, hidden], a view into the graph's output: rows 0..n-1 are the decode rows'; the rows of
        the sampled chunks' last tokens)."""
        n, last_rows = self.fill(out.seqs, size, decode_rows)
        self._mixed_steps += 1
        return self.graphs.replay_filled(n), last_rows

    def run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[int]] | None:
        """Replay the step's chunks: (hidden [n, hidden], the rows of the last token of each chunk that
        samples). hidden is a view into the graph's static output, valid until the next replay. None (counted
        as an eager step) when the step does not fit a captured graph."""
        size = self.size_for(out)
        if size is None:
            self._eager_steps += 1
            return None
        n, last_rows = self.fill(out.seqs, size)
        return self.graphs.replay_filled(n), last_rows

    def fill(self, seqs: Sequence[ScheduledSeq], size: int, decode_rows: np.ndarray | None = None
             ) -> tuple[int, list[int]]:
        """Write the chunks (after `decode_rows`, DecodeBatch rows, if given) into the static buffers for the
        graph of `size` tokens (three copies, five with decode rows). Returns (real tokens n, rows of the
        sampled chunks' last tokens)."""
        s = self.max_seqs
        tok, lens, tables = self._tokens_np, self._lengths_np, self._tables_np
        chunks = write_prefill_chunks(seqs, self.block_size, tok, first_row=self._fill_decode_rows(decode_rows))
        k, n = len(seqs), chunks.query_starts[-1]
        lens[: s + 1 + s] = 0  # query starts and contexts of empty slots: no tokens, no context
        for i, seq in enumerate(seqs):
            lens[i] = chunks.query_starts[i]
            lens[s + 1 + i] = seq.context_len
            tables[i, : len(seq.block_table)] = seq.block_table
            tables[i, len(seq.block_table):] = self.scratch_block
        lens[k: s + 1] = n  # empty slots and the padding sequence start where the real tokens end
        tok[0, n:size] = 0
        tok[1, n:size] = self._pad_positions[: size - n]
        tok[2, n:size] = self._pad_slots[: size - n]
        self._copy(self.tokens, tok)  # whole (3 x T_max, 12 KiB at 512): one contiguous copy
        self._copy(self.lengths, lens)
        self._copy(self.block_tables[:k], tables[:k])
        return n, chunks.last_rows

    def _fill_decode_rows(self, rows: np.ndarray | None) -> int:
        """Decode rows as the step's first tokens: token (or placeholder), position, slot, and for the decode
        kernel their tables and contexts; every other row's context 0 (none). Returns how many rows."""
        n = 0 if rows is None else len(rows)
        live = max(n, self._decode_live)
        if live == 0:
            return 0
        ctx = self._decode_contexts_np
        ctx[:live] = 0
        if n:
            pos = rows[:, POS].astype(np.int64)
            tables = rows[:, BLOCKS:]
            self._tokens_np[0, :n] = rows[:, TOKEN]
            self._tokens_np[1, :n] = pos
            self._tokens_np[2, :n] = kv_slots(tables, pos, self.block_size)
            ctx[:n] = pos + 1
            # Columns past a row's context are never read.
            used = min(tables.shape[1], int(pos.max()) // self.block_size + 1)
            self._copy(self.decode_tables[:n, :used], tables[:, :used])
        self._copy(self.decode_contexts[:live], ctx[:live])
        self._decode_live = n
        return n

    def _copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        host = torch.from_numpy(np.ascontiguousarray(src))
        if dst.device.type == "cuda":
            host = host.pin_memory()
        dst.copy_(host, non_blocking=dst.device.type == "cuda")
