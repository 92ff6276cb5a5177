"""Tensor parallelism inside the model: which part of each weight a rank holds, and the layers that join
the parts with one collective (torch.distributed; NCCL on GPU, gloo on CPU).

Megatron's split, with two collectives per layer and one at each end:

    qkv_proj, gate_up_proj   column-parallel: a rank holds its heads' rows (q | k | v) and its slice of the
                             intermediate rows (gate | up); no communication
    o_proj, down_proj        row-parallel: a rank holds the matching input columns; the partial outputs are
                             summed with one all-reduce (bias added once, on rank 0, before the sum)
    embed_tokens             vocab-parallel: a rank holds ceil(V / tp) rows, looks up the ids it owns, zeroes
                             the rest; one all-reduce
    lm_head                  vocab-parallel: a rank's logits for its rows; one all-gather gives every rank
                             the full [N, V] logits, so every rank samples the same tokens

Query heads are split evenly. KV heads are split when there are at least as many as ranks, else each KV head
is replicated on tp / Hkv ranks (a rank then holds one KV head: the one its query heads read). Every
collective is issued in the same order on every rank and reads no tensor value on the host, so the decode
step stays capturable in one CUDA graph per rank (NCCL collectives are capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.config import ModelConfig
from ostinato.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group. `group` is the torch.distributed process group the
    model's collectives use (None for a single rank: the layers then do no communication)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place. Capturable with NCCL."""
        if self.world_size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, world_size * C], rank r's columns at [r * C, (r + 1) * C)."""
        if self.world_size == 1:
            return x
        n, c = x.shape
        out = torch.empty(self.world_size * n, c, dtype=x.dtype, device=x.device)  # rank-major rows
        _all_gather(out, x.contiguous(), group=self.group)
        return out.view(self.world_size, n, c).permute(1, 0, 2).reshape(n, self.world_size * c)


SINGLE_RANK = TPGroup()

# torch >= 2.12 names it all_gather_single (all_gather_into_tensor warns there); torch 2.11 has only the latter.
_all_gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


# ---- what a rank holds ---------------------------------------------------------------------------------

def check_tp_size(config: ModelConfig, tp: int) -> None:
    """Raises ConfigError when the model's shapes cannot be split over `tp` ranks, naming what divides."""
    if tp < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {tp}")
    problems = []
    if config.num_heads % tp:
        problems.append(f"num_attention_heads {config.num_heads}")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size {config.intermediate_size}")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"num_key_value_heads {kv} (nor does it divide the size)")
    if problems:
        sizes = [s for s in range(1, config.num_heads + 1) if config.num_heads % s == 0
                 and config.intermediate_size % s == 0 and (kv % s == 0 or s % kv == 0)]
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide {', '.join(problems)}; "
                          f"this model splits over {sizes} ranks")


def local_heads(config: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds."""
    return config.num_heads // tp, max(1, config.num_kv_heads // tp)


def first_kv_head(config: ModelConfig, tp: int, rank: int) -> int:
    """The first KV head rank `rank` holds; with fewer KV heads than ranks, the one its query heads read."""
    if config.num_kv_heads >= tp:
        return rank * (config.num_kv_heads // tp)
    return rank * config.num_kv_heads // tp


def vocab_rows_per_rank(vocab_size: int, tp: int) -> int:
    """Rows of the embedding / lm_head each rank holds (the last rank's tail is zero padding)."""
    return -(-vocab_size // tp)


def rank_view(config: ModelConfig, tp: int) -> ModelConfig:
    """The config as one rank's KV cache and attention see it: its own query and KV heads."""
    from dataclasses import replace

    heads, kv_heads = local_heads(config, tp)
    return replace(config, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=config.intermediate_size // tp)


@dataclass(frozen=True)
class Placement:
    """Where (part of) one checkpoint tensor goes on this rank: `param`, rows [dest_start, dest_start + n)
    (the whole parameter when dest_start is None), from the checkpoint tensor's range [src_start, src_end)
    along dimension `src_dim` (the whole tensor when src_dim is None), whose full size there is `src_total`."""

    param: str
    dest_start: int | None = None
    src_dim: int | None = None
    src_start: int = 0
    src_end: int = 0
    src_total: int = 0

    def read(self, f, name: str) -> torch.Tensor:
        """The part of checkpoint tensor `name` this rank needs, read from open safetensors file `f` (only that
        part is read from disk). Raises CheckpointError when the tensor's size along the split dimension is
        not the one config.json implies (a slice would silently take the wrong rows)."""
        if self.src_dim is None:
            return f.get_tensor(name)
        part = f.get_slice(name)
        shape = tuple(part.get_shape())
        if len(shape) <= self.src_dim or shape[self.src_dim] != self.src_total:
            expected = tuple(self.src_total if i == self.src_dim else n for i, n in enumerate(shape))
            raise CheckpointError(f"tensor {name} has shape {shape}, the model built from config.json expects "
                                  f"{expected}; config.json does not match the weights")
        if self.src_dim == 0:
            return part[self.src_start:self.src_end]
        return part[:, self.src_start:self.src_end]


def placements(config: ModelConfig, tp: TPGroup) -> dict[str, tuple[str, Placement]]:
    """HF projection / module name -> (our module name, Placement template) for every split weight; names
    not listed are replicated whole. Fused modules (qkv_proj, gate_up_proj) take their parts by row."""
    n, r = tp.world_size, tp.rank
    d = config.head_dim
    heads, kv_heads = local_heads(config, n)
    kv0 = first_kv_head(config, n, r)
    inter = config.intermediate_size // n
    vocab = vocab_rows_per_rank(config.vocab_size, n)
    q_rows, kv_rows = heads * d, kv_heads * d
    q_all, kv_all, v_all = config.num_heads * d, config.num_kv_heads * d, config.vocab_size
    vocab_part = (r * vocab, min(v_all, (r + 1) * vocab), v_all)
    return {
        "q_proj": ("qkv_proj", Placement("", 0, 0, r * q_rows, (r + 1) * q_rows, q_all)),
        "k_proj": ("qkv_proj", Placement("", q_rows, 0, kv0 * d, kv0 * d + kv_rows, kv_all)),
        "v_proj": ("qkv_proj", Placement("", q_rows + kv_rows, 0, kv0 * d, kv0 * d + kv_rows, kv_all)),
        "gate_proj": ("gate_up_proj", Placement("", 0, 0, r * inter, (r + 1) * inter, config.intermediate_size)),
        "up_proj": ("gate_up_proj", Placement("", inter, 0, r * inter, (r + 1) * inter, config.intermediate_size)),
        "o_proj": ("o_proj", Placement("", None, 1, r * q_rows, (r + 1) * q_rows, q_all)),
        "down_proj": ("down_proj", Placement("", None, 1, r * inter, (r + 1) * inter, config.intermediate_size)),
        "embed_tokens": ("embed_tokens", Placement("", 0, 0, *vocab_part)),
        "lm_head": ("lm_head", Placement("", 0, 0, *vocab_part)),
    }


def placement_of(hf_name: str, table: dict[str, tuple[str, Placement]], tp: TPGroup) -> Placement:
    """The Placement of checkpoint tensor `hf_name` (e.g. model.layers.0.self_attn.q_proj.weight)."""
    module_path, _, leaf = hf_name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    if module not in table:
        return Placement(hf_name)
    ours, p = table[module]
    name = f"{prefix}{ours}.{leaf}"
    if tp.world_size == 1 and p.dest_start is None:
        return Placement(name)
    if leaf == "bias" and p.src_dim == 1:
        return Placement(name)  # a row-parallel bias is whole on every rank (only rank 0 adds it)
    return Placement(name, p.dest_start, p.src_dim, p.src_start, p.src_end, p.src_total)


# ---- layers ----------------------------------------------------------------------------------------------

class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r @ W_r^T (+ bias once): input features split across ranks, one all-reduce.
    With one rank it is a plain nn.Linear (same kernels, same numbers)."""

    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__(in_features_per_rank, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(F.linear(x, self.weight, bias))  # [T, out]


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows are split across ranks: each looks up the ids it owns, zeroes the others'
    rows, and an all-reduce assembles every row. With one rank, a plain nn.Embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        self.rows = vocab_rows_per_rank(vocab_size, tp.world_size)
        super().__init__(self.rows, hidden_size)
        self.tp = tp
        self.first = tp.rank * self.rows

    def reset_parameters(self) -> None:
        # The loaders build the model on the meta device, where there is nothing to draw; nn.Embedding's normal_
        # there goes through torch._refs, whose first call imports torch._dynamo: seconds of every start-up.
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(ids)
        local = ids - self.first  # [T]
        foreign = (local < 0) | (local >= self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight)  # [T, hidden]
        out.masked_fill_(foreign[:, None], 0)
        return self.tp.all_reduce(out)


class VocabParallelLMHead(nn.Linear):
    """The output projection with its vocabulary rows split like VocabParallelEmbedding's (so a tied head
    shares that weight); one all-gather hands every rank the full [N, vocab] logits."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup):
        super().__init__(hidden_size, vocab_rows_per_rank(vocab_size, tp.world_size), bias=False)
        self.tp = tp
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.assemble(super().forward(hidden))

    def assemble(self, local_logits: torch.Tensor) -> torch.Tensor:
        """This rank's [N, rows] logits (any dtype) -> the full [N, vocab] on every rank: one all-gather."""
        logits = self.tp.gather_columns(local_logits)  # [N, tp * rows]
        return logits[:, :self.vocab_size] if logits.shape[1] != self.vocab_size else logits
