"""Where the split-KV decode (kernels/decode_attention.py) puts its output: the merge of a split launch's partials,
and the store of a kv head's GROUP query heads, either as the model dtype or quantized for o_proj.

Why quantized here: a GGUF o_proj that takes integer dot products (kernels/gguf_int8_dot.py) reads its input as
int8 codes per 32 values, which a kernel of its own would otherwise make from the attention's output: a launch
on the path of every layer of a one-row step, and one that stands between the attention and o_proj, so that
o_proj's first weight tiles (requested before its PDL wait) could not overlap the attention. A kv head's heads
are GROUP x head_dim consecutive values of the output row, whole 32-blocks where head_dim is a multiple of 32,
so the program that writes them quantizes them as the quantizing kernel would: the output rounded to the model
dtype first, as stored, then the same arithmetic (gguf_int8_dot.store_quantized).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ostinato.kernels.gguf_int8_dot import store_quantized
from ostinato.kernels.rounding import round_like


@triton.jit
def store_heads(out, out_ptr, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, seq, kv_head, stride_os, stride_oh,
                ROWS: tl.constexpr, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEAD_DIM_PAD: tl.constexpr, QUANT_OUT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """out [ROWS, HEAD_DIM_PAD] float32, heads kv_head * GROUP + (0 .. GROUP - 1) of row seq (rows past GROUP
    padding): stored to out_ptr [num_seqs, NUM_HEADS, HEAD_DIM] in its dtype, or with QUANT_OUT (HEAD_DIM ==
    HEAD_DIM_PAD, a multiple of 32) rounded to that dtype and stored quantized as gguf_int8_dot.quantize_x stores
    the row [num_seqs, NUM_HEADS * HEAD_DIM] (out_ptr unwritten)."""
    if QUANT_OUT:
        BLOCKS: tl.constexpr = ROWS * HEAD_DIM // 32
        local = tl.arange(0, BLOCKS)
        b = kv_head * (GROUP * HEAD_DIM // 32) + local  # the row's 32-blocks these heads hold
        word = b[:, None] * 8 + tl.arange(0, 8)[None, :]
        y = tl.reshape(round_like(out, out_ptr, EMULATE_BF16), [BLOCKS, 8, 4])
        store_quantized(y, seq, b, local < GROUP * HEAD_DIM // 32, word, NUM_HEADS * HEAD_DIM, xq_ptr, dx_ptr,
                        sx_ptr, cx_ptr, s16_ptr, BLOCKS)
    else:
        offs_g = tl.arange(0, ROWS)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        heads = kv_head * GROUP + offs_g
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def merge_partials(part_out_ptr, part_max_ptr, part_sum_ptr, seq, kv_head, num_active, num_splits,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, MERGE_GROUP: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr,
                   SPLITS_PAD: tl.constexpr):
    """The output [MERGE_GROUP, HEAD_DIM_PAD] float32 of row seq's heads of kv_head (store_heads stores it), from
    the num_active partials (max, sum, unnormalised output) of those heads, all loaded at once: [MERGE_GROUP,
    SPLITS_PAD] maxima and sums, then [MERGE_GROUP, MERGE_CHUNK, HEAD_DIM_PAD] outputs per chunk of slices
    (DecodeTuning.merge_chunk_elems: 32 slices at GROUP 2, head_dim 128). Loads are .cg (L2, not this SM's L1):
    the partials were written by other SMs during this launch."""
    offs_g = tl.arange(0, MERGE_GROUP)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + offs_g  # [MERGE_GROUP]
    g_mask = offs_g < GROUP
    base = (seq * NUM_HEADS + heads) * num_splits  # [MERGE_GROUP] first partial of each head
    gs_mask = g_mask[:, None] & (offs_s < num_active)[None, :]
    # The first chunk's outputs are requested with the maxima and sums: one round trip to L2 where the active
    # slices fit in one chunk (batch 1 at short contexts, where this merge is on the step's critical path).
    offs_c = tl.arange(0, MERGE_CHUNK)
    gc_mask = g_mask[:, None] & (offs_c < num_active)[None, :]  # [MERGE_GROUP, MERGE_CHUNK]
    idx = base[:, None] + offs_c[None, :]
    o = tl.load(part_out_ptr + idx[:, :, None] * HEAD_DIM_PAD + offs_d[None, None, :], mask=gc_mask[:, :, None],
                other=0.0, cache_modifier=".cg")  # [MERGE_GROUP, MERGE_CHUNK, HEAD_DIM_PAD]
    m_c = tl.load(part_max_ptr + idx, mask=gc_mask, other=float("-inf"), cache_modifier=".cg")
    m_s = tl.load(part_max_ptr + base[:, None] + offs_s[None, :], mask=gs_mask, other=float("-inf"),
                  cache_modifier=".cg")  # [MERGE_GROUP, SPLITS_PAD]
    l_s = tl.load(part_sum_ptr + base[:, None] + offs_s[None, :], mask=gs_mask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_s, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # context 0 (or a padded head): weights 0, not NaN
    total = tl.sum(l_s * tl.exp2(m_s - m_max[:, None]), 1)  # [MERGE_GROUP]
    acc = tl.sum(o * tl.exp2(m_c - m_max[:, None])[:, :, None], 1)  # [MERGE_GROUP, HEAD_DIM_PAD]; 0 where masked
    for s0 in range(MERGE_CHUNK, num_active, MERGE_CHUNK):
        chunk = s0 + offs_c  # [MERGE_CHUNK] slice indices
        gc_mask = g_mask[:, None] & (chunk < num_active)[None, :]
        idx = base[:, None] + chunk[None, :]
        m_c = tl.load(part_max_ptr + idx, mask=gc_mask, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2(m_c - m_max[:, None])  # [MERGE_GROUP, MERGE_CHUNK]; 0 where masked
        o = tl.load(part_out_ptr + idx[:, :, None] * HEAD_DIM_PAD + offs_d[None, None, :],
                    mask=gc_mask[:, :, None], other=0.0, cache_modifier=".cg")  # [G, CHUNK, HEAD_DIM_PAD]
        acc += tl.sum(o * w[:, :, None], 1)
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]
