"""When prefill attention splits its key range, and how many ways (host side; no torch, no triton).

The kernels are in kernels/prefill_attention.py; attention/triton_paged.py's prefill runs the split
kernel when plan_prefill's split count is above 1 and its one-pass kernel otherwise.

Two ways to plan (plan_prefill)
    host figures  meta.query_lens and meta.context_lens_host given (the eager prefill path): the scan's
                  work and longest context are the step's own.
    shapes only   either of them None (a prefill captured in a CUDA graph at a fixed token count): the
                  work is bounded as if all num_tokens were one sequence (the fewest programs) at the block
                  table's full width, and the one-pass kernel's grid takes num_tokens as max_query_len.
                  Nothing then depends on a value that changes between replays: the same graph serves any
                  lengths and tables of that shape.

Choosing the split count (choose_prefill_splits)
    1 (no split: the one-pass kernel runs, triton_paged.py's dispatch) when the (query block, kv head)
    programs alone number programs_per_sm per SM. Otherwise: the keys all programs scan unsplit, shared
    among that many programs, give a slice length, and the longest program's scan is cut into slices of
    at most that length, so the longest scan no longer sets the step's time. Never a slice under
    min_split_keys (splitting a short scan costs more than it saves), never more than max_splits. One count
    serves the whole launch (grid axis 2): a short sequence beside a long one gets empty slices that return
    at once. On a GPU of 132 SMs (528 programs wanted) with 8 kv heads and group 4 (BLOCK_Q 16): 96 new
    tokens after 8000 cached split 12 ways, with 32 one-token rows at context 256 beside them 10 ways; 224
    after 8000 5 ways, 480 after 7967 3 ways, 2016 after 6431 not at all; one new token after 8000, 31 ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ostinato.errors import ConfigError

if TYPE_CHECKING:
    from ostinato.kernels.attention_metadata import AttentionMetadata


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class PrefillSplitTuning:
    """Launch settings and split policy of the split prefill (see the module docstring).

    block_m: rows per program (BLOCK_Q queries x the kv head's query heads, padded to a power of two).
    block_n: keys per inner-loop tile. programs_per_sm: split until the launch has this many programs per SM.
    min_split_keys: no slice shorter than this many keys (splitting a short context costs more than it saves).
    max_splits: at most this many slices. splits: force this count (tests, measurements); None chooses.
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4
    min_split_keys: int = 256
    max_splits: int = 32
    splits: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ConfigError(f"split prefill {name} must be a power of two >= 16, got {value}")
        for name in ("num_warps", "num_stages", "programs_per_sm", "min_split_keys", "max_splits"):
            if getattr(self, name) < 1:
                raise ConfigError(f"split prefill {name} must be >= 1, got {getattr(self, name)}")
        if self.splits is not None and self.splits < 1:
            raise ConfigError(f"split prefill splits must be >= 1 or None, got {self.splits}")


@dataclass(frozen=True)
class PrefillPlan:
    """How one prefill launch runs. splits == 1: the one-pass kernel (kernels/prefill_one_pass.py).
    max_query_len: the bound the one-pass kernel's grid uses (num_tokens when only shapes may be used)."""

    block_q: int
    splits: int
    max_query_len: int
    from_shapes_only: bool


def choose_prefill_splits(tuning: PrefillSplitTuning, programs: int, work_keys: int, max_kv_len: int,
                          num_sms: int) -> int:
    """Slices per (query block, kv head) program. programs: how many there are unsplit; work_keys: the keys
    they scan together; max_kv_len: the longest one's scan. See "Choosing the split count" (module docstring)."""
    if tuning.splits is not None:
        return tuning.splits
    wanted = tuning.programs_per_sm * num_sms
    if programs >= wanted:
        return 1  # the GPU is full already: waves even out the scans' lengths, and no reduce is needed
    keys_per_slice = _cdiv(max(work_keys, 1), wanted)
    return max(1, min(_cdiv(max_kv_len, keys_per_slice), max_kv_len // tuning.min_split_keys,
                      tuning.max_splits))


def _keys_scanned(query_len: int, context_len: int, block_q: int) -> int:
    """Keys the query blocks of one sequence scan together: block b reads up to its last query's position."""
    blocks = _cdiv(query_len, block_q)
    return blocks * (context_len - query_len) + block_q * blocks * (blocks - 1) // 2 + query_len


def plan_prefill(tuning: PrefillSplitTuning, meta: AttentionMetadata, num_tokens: int, group: int,
                 num_kv_heads: int, block_size: int, num_sms: int) -> PrefillPlan:
    from_shapes_only = meta.query_lens is None or meta.context_lens_host is None
    max_query_len = num_tokens if from_shapes_only else max(meta.max_query_len, 1)
    # BLOCK_Q: block_m rows (>= 16, the smallest tl.dot tile), even for a short chunk: a tile per chunk
    # length would compile a kernel variant per length class inside users' steps; rows are cheap here.
    block_q = max(1, tuning.block_m // _next_power_of_2(group))
    if from_shapes_only:
        # Bounds: every token in one sequence (the case with the fewest programs) at the table's full width.
        max_kv_len = meta.block_tables.shape[1] * block_size
        query_blocks = _cdiv(num_tokens, block_q)
        work_keys = query_blocks * max_kv_len
    else:
        max_kv_len = max(meta.context_lens_host, default=0)
        query_blocks = sum(_cdiv(q, block_q) for q in meta.query_lens)
        work_keys = sum(_keys_scanned(q, c, block_q) for q, c in zip(meta.query_lens, meta.context_lens_host))
    splits = choose_prefill_splits(tuning, query_blocks * num_kv_heads, work_keys * num_kv_heads, max_kv_len,
                                   num_sms)
    return PrefillPlan(block_q, splits, max_query_len, from_shapes_only)
