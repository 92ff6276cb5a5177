"""The persistent decode batch: one packed int32 row per running sequence, kept for the engine's life.

The graph's static input is declared here once (`DecodeLayout`): one [rows, C] int32 tensor whose columns
are the input token, its position, the sampling counter, the temperature (a float32 bit pattern), the
sampling key (two int32 halves of an int64), top-k, top-p (float32 bits) and the block table. The columns
before the block table are the sequence's sampling state (runner/sampling_state.py): written at join, read
by its prefill draw (`joined_sampling`) and its decode draws (`sampling`, or the kernels in place). Capture,
replay, the start-up self-check, `verify` and `bench` all go through it; the step unpacks it inside the
graph (context length = position + 1, slot = block_table[position // block_size] * block_size + offset).

`DecodeBatch` holds that tensor twice, pinned on the host and on the device, plus a `DecodeRows` (which
sequence holds which row). A row is written when its sequence joins (after its prefill), gets one block
id when the sequence crosses a block boundary, and is replaced by the last row when its sequence leaves.
Each step is then one copy of the occupied prefix (padded to the graph size) to the device, and after the
step one vectorized advance of positions and counters. Nothing per step is O(sequence length) and nothing
is allocated.

The token a row feeds next is not known on the host when the step after is prepared (overlapped
scheduling), so `advance` writes a placeholder: -(r + 1) means "the token the previous decode step sampled
in row r", which the step resolves on the device from its `sampled` buffer (runner/decode_step.py). A
placeholder moves with its row when rows condense, so it stays right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ostinato.contract import DecodeRows, ScheduledSeq
from ostinato.runner.graphs import StaticInput
from ostinato.runner.inputs import kv_slots, to_device
from ostinato.runner.logits_processors import LogitsProcessors, row_flags
from ostinato.runner.sampler import row_key
from ostinato.runner.sampling_state import (  # noqa: F401  (the row's columns, read from here too)
    BLOCKS, CTR, FLAGS, KEY_HI, KEY_LO, POS, ROW_COLUMNS, SLOT, TEMP, TOKEN, TOP_K, TOP_P, SamplingBatch,
    filtered_rows, filters, read_settings, write_settings)


@dataclass(frozen=True)
class DecodeLayout:
    """The shape of a decode row and how the step reads it. Pad rows point at the scratch block."""

    rows: int  # largest batch (max_num_seqs, >= the largest capture size)
    blocks_per_seq: int  # ceil(max_model_len / block_size)
    block_size: int
    scratch_block: int

    @property
    def width(self) -> int:
        return BLOCKS + self.blocks_per_seq

    def static_inputs(self) -> list[StaticInput]:
        """The graph's one static input. Pad value unused: DecodeBatch keeps pad rows filled itself."""
        return [StaticInput("batch", (self.rows, self.width), torch.int32, 0)]

    def pad_row(self) -> torch.Tensor:
        """A row that computes nothing real: position 0 in the scratch block, greedy."""
        row = torch.zeros(self.width, dtype=torch.int32)
        row[BLOCKS:] = self.scratch_block
        return row

    def unpack(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """Device tensors the model needs, from [B, width] int32. Capturable. (The sampler reads its settings
        from the rows themselves: sampling_state.sampling_inputs, or the sampling kernels on a GPU.)"""
        positions = batch[:, POS].long()
        block_tables = batch[:, BLOCKS:]
        return {
            "input_ids": batch[:, TOKEN].long(), "positions": positions,
            "slot_mapping": kv_slots(block_tables, positions, self.block_size), "block_tables": block_tables,
            "context_lens": batch[:, POS] + 1,
        }

    def pack(self, input_ids, positions, block_tables, temperature=None, keys=None, counters=None) -> torch.Tensor:
        """Rows built from whole tensors (self-check, bench, tests): [n, width] int32 on their device."""
        n = len(input_ids)
        dev = input_ids.device
        out = self.pad_row().to(dev).repeat(n, 1)
        out[:, TOKEN] = input_ids.to(torch.int32)
        out[:, POS] = positions.to(torch.int32)
        out[:, BLOCKS:BLOCKS + block_tables.shape[1]] = block_tables.to(torch.int32)
        if temperature is not None:
            out[:, TEMP] = temperature.to(torch.float32).view(torch.int32)
        if keys is not None:
            keys = keys.to(torch.int64)
            out[:, KEY_LO] = (keys & 0xFFFFFFFF).to(torch.int32)  # wraps to the int32 bit pattern
            out[:, KEY_HI] = (keys >> 32).to(torch.int32)
        if counters is not None:
            out[:, CTR] = counters.to(torch.int32)
        return out


# Rows whose whole width is at most this many bytes (size x width x 4) go to the device in one copy, straight
# into the device rows: the packed copy of the used columns needs a second copy on the device (a kernel, and
# its launch on the host), which costs more than moving 64 KB over PCIe (~3 us). This way a step's host time
# for the copy is a fraction of the packed copy's (benchmarks/step/step_gap.py).
WHOLE_ROWS_MAX_BYTES = 64 * 1024


def resolve_placeholders(input_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Input ids with each placeholder -(r + 1) (DecodeBatch.advance, join) replaced by sampled[r], the token
    the previous decode step sampled in row r. Device ops only (capturable)."""
    return torch.where(input_ids >= 0, input_ids, sampled.gather(0, (-input_ids - 1).clamp_(min=0)))


class DecodeBatch:
    """The running sequences' decode rows, on the host (pinned) and on the device."""

    def __init__(self, layout: DecodeLayout, device: torch.device, engine_seed: int,
                 processors: LogitsProcessors | None = None):
        self.layout = layout
        self.processors = processors  # the rows' logits processors' tables (None: no row may use any)
        self.device = device
        self.engine_seed = engine_seed
        pin = device.type == "cuda" and torch.cuda.is_available()
        self._pad = layout.pad_row()
        self.host = self._pad.repeat(layout.rows, 1)
        if pin:
            self.host = self.host.pin_memory()
        # On CPU the step reads the host rows directly: there is no copy to make. On a GPU the rows go
        # through two pinned staging buffers in turn, so the host can change rows (next step) while the
        # copy of the step before may still be pending.
        self.dev = self.host.to(device) if device.type != "cpu" else self.host
        flat = layout.rows * layout.width
        self._staging = [torch.empty(flat, dtype=torch.int32).pin_memory() for _ in range(2)] if pin else []
        self._dev_staging = torch.empty(flat, dtype=torch.int32, device=device) if pin else None
        self._turn = 0
        self._whole_row_views: dict[tuple[int, int], tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}
        # Columns any row has used since the batch was last empty: only those are copied. A block table is
        # max_model_len / block_size wide (2,560 at 40k tokens); the rows rarely use more than a few hundred.
        # A device row's columns past its own blocks may hold an earlier row's ids: never read.
        self._width_used = BLOCKS + 1
        # Host writes go through numpy views of the same memory: a few rows change per step, and a numpy
        # op on them costs about a microsecond where a torch op costs ten.
        self.np = self.host.numpy()
        self.np_f = self.np.view(np.float32)  # the float columns
        self._pad_np = self._pad.numpy()
        self._placeholders = -np.arange(1, layout.rows + 1, dtype=np.int32)  # row r feeds sampled[r]
        self.rows = DecodeRows()
        self._num_blocks: list[int] = []  # per row: block ids in its table
        self._num_logprobs: list[int | None] = []  # per row, as its request asked
        self._num_filtered = 0  # rows with top-k or top-p
        self._num_processor_rows = 0  # rows with a logits processor on (FLAGS != 0)
        self._num_logprob_rows = 0
        self._transient_rows = 0  # rows the last load_transient wrote (back to padding at the next)

    def __len__(self) -> int:
        return len(self.rows)

    # ---- rows change only here ---------------------------------------------------------------------
    def join(self, seq: ScheduledSeq, first_token: int | None = None) -> int:
        """A prefilled sequence becomes a decode row; returns the row. It feeds `first_token` next, or, when
        None, a placeholder for sampled[row] (the caller writes the token it sampled there on the device
        before the next decode step, which resolves placeholders first)."""
        row = self.rows.add(seq.seq_id)
        if row >= self.layout.rows:
            raise RuntimeError(f"decode batch full ({self.layout.rows} rows): the scheduler admitted too many")
        p = seq.sampling_params
        h = self.np[row]
        h[TOKEN] = self._placeholders[row] if first_token is None else first_token
        h[POS] = seq.context_len
        # The counter of the row's next draw: its first decode token (the prefill draw is seq.num_generated).
        flags, slot = row_flags(seq.logits_spec), 0
        if flags:
            assert self.processors is not None, "a decode batch without logits processors' tables"
            slot = self.processors.join(seq.logits_spec, seq.history, seq.num_generated)
            self._num_processor_rows += 1
        settings = write_settings(h, p, row_key(p.seed, self.engine_seed, seq.seq_id), seq.num_generated + 1,
                                  flags, slot)
        table = seq.block_table
        h[BLOCKS:BLOCKS + len(table)] = table
        self._width_used = max(self._width_used, BLOCKS + len(table))
        self._num_blocks.append(len(table))
        self._num_logprobs.append(p.logprobs)
        self._num_filtered += settings.filtered
        self._num_logprob_rows += p.logprobs is not None
        return row

    def leave(self, seq_id: int) -> None:
        """Drop a sequence's row (finished, aborted, preempted); the last row moves into the hole."""
        moved = self.rows.remove(seq_id)
        if moved is None:
            return  # never joined (e.g. aborted before its prefill)
        hole, last = moved
        h = self.np
        self._num_filtered -= bool(filters(h[hole, TOP_K], self.np_f[hole, TOP_P]))
        self._num_logprob_rows -= self._num_logprobs[hole] is not None
        if h[hole, FLAGS]:
            self.processors.leave(int(h[hole, SLOT]))
            self._num_processor_rows -= 1
        if hole != last:
            h[hole] = h[last]
            self._num_blocks[hole] = self._num_blocks[last]
            self._num_logprobs[hole] = self._num_logprobs[last]
        h[last] = self._pad_np
        self._num_blocks.pop()
        self._num_logprobs.pop()
        if not self._num_blocks:
            self._width_used = BLOCKS + 1

    def add_block(self, seq_id: int, block: int) -> None:
        row = self.rows.row_of[seq_id]
        self.np[row, BLOCKS + self._num_blocks[row]] = block
        self._num_blocks[row] += 1
        self._width_used = max(self._width_used, BLOCKS + self._num_blocks[row])

    # ---- the step ----------------------------------------------------------------------------------
    def apply(self, left, new_blocks) -> None:
        """A step's row changes from the scheduler (SchedulerOutput.left, .new_blocks): leave, then grow."""
        for seq_id in left:
            self.leave(seq_id)
        for seq_id, block in new_blocks:
            self.add_block(seq_id, block)

    def copy_to_device(self, size: int) -> torch.Tensor:
        """Rows [0, size) to the device (rows past len(self) are pad rows); returns them."""
        if self._staging and size * self.layout.width * 4 <= WHOLE_ROWS_MAX_BYTES:
            staging_np, staging, dev_rows = self._whole_rows(size)
            self._turn ^= 1
            staging_np[:] = self.np[:size]
            dev_rows.copy_(staging, non_blocking=True)
            return dev_rows
        if self._staging:
            # Packed [size, width used] through pinned memory, then into the strided device rows.
            w = self._width_used
            staging = self._staging[self._turn][: size * w].view(size, w)
            self._turn ^= 1
            staging.numpy()[:] = self.np[:size, :w]
            packed = self._dev_staging[: size * w].view(size, w)
            packed.copy_(staging, non_blocking=True)
            self.dev[:size, :w].copy_(packed)
        return self.dev[:size]

    def load_transient(self, rows: np.ndarray, size: int) -> torch.Tensor:
        """Rows that no sequence holds (a speculative verify step's, runner/verify_rows.py) as rows [0, n),
        rows [n, size) padding, copied to the device for one step; returns the device rows [0, size). Only while
        no sequence holds a row: a speculative engine's steps never decode, so its rows are free."""
        assert not len(self.rows), "load_transient is for a batch no sequence holds rows of"
        n, width = rows.shape
        self.np[:n, :width] = rows
        if self._transient_rows > n:  # the last step's rows past this one's are padding again
            self.np[n:self._transient_rows] = self._pad_np
        self._transient_rows = n
        self._width_used = max(self._width_used, width)
        return self.copy_to_device(size)

    def _whole_rows(self, size: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """(numpy view of this turn's staging rows, the same as a tensor, the device rows) for `size` rows at full
        width, made once: each view a torch op makes costs the host a microsecond or more a step."""
        key = (self._turn, size)
        views = self._whole_row_views.get(key)
        if views is None:
            width = self.layout.width
            staging = self._staging[self._turn][: size * width].view(size, width)
            views = self._whole_row_views[key] = (staging.numpy(), staging, self.dev[:size])
        return views

    def advance(self, n: int, tokens: np.ndarray | None = None) -> None:
        """After a decode step: every row one position on, feeding `tokens` ([n] host) or, by default, a
        placeholder for the token the step sampled in that row."""
        self.np[:n, POS:CTR + 1] += 1
        self.np[:n, TOKEN] = self._placeholders[:n] if tokens is None else tokens

    @property
    def needs_finish(self) -> bool:
        """Whether some row needs sampling work outside the graph (top-k / top-p, logprobs)."""
        return self._num_filtered > 0 or self._num_logprob_rows > 0

    @property
    def uses_processors(self) -> bool:
        """Whether some row runs a logits processor: the step then replays the graphs that run them
        (runner/decode_step.py); otherwise it launches none of their work."""
        return self._num_processor_rows > 0

    def sampling(self, rows: torch.Tensor) -> SamplingBatch:
        """The step's sampling settings, read from its device rows [len(self), width] (no host work per row)."""
        return read_settings(rows, self._num_logprobs if self._num_logprob_rows else None, self._num_filtered > 0)

    def joined_sampling(self, first: int, count: int) -> SamplingBatch:
        """The settings of rows [first, first + count), which sequences just joined at, for the draw their
        prefill makes before they decode: the rows as written, one counter back (one host-to-device copy of
        their setting columns; the device rows are copied at the next decode step as ever)."""
        rows = self.np[first:first + count, :BLOCKS].copy()
        rows[:, CTR] -= 1
        num_logprobs = self._num_logprobs[first:first + count]
        return read_settings(to_device(rows, torch.int32, self.device),
                             num_logprobs if any(k is not None for k in num_logprobs) else None,
                             bool(filtered_rows(rows).any()))

    def reset(self) -> None:
        """Every row back to padding, on the host and the device. Needed after anything wrote the graph's
        static rows directly (the start-up self-check, bench): on CPU they are the host rows themselves, and
        a stale row there would be a live pad row writing K/V into a real block."""
        assert not len(self.rows), "reset() is for an idle engine"
        self.np[:] = self._pad_np
        self._num_processor_rows = 0
        self._transient_rows = 0
        if self.processors is not None:
            self.processors.reset()
        self._width_used = BLOCKS + 1
        if self.dev is not self.host:
            self.dev.copy_(self.host)

    def block_table(self, seq_id: int) -> list[int]:
        """A row's block ids (tests and debugging)."""
        row = self.rows.row_of[seq_id]
        return self.np[row, BLOCKS:BLOCKS + self._num_blocks[row]].tolist()

    def row(self, seq_id: int) -> torch.Tensor:
        return self.host[self.rows.row_of[seq_id]]

