"""Decode attention alone on the GPU: µs per layer and achieved HBM bandwidth, checked against a reference.

Each case builds one KV cache per layer (the model's layer count, so that reads come from HBM as in a real
step, not from L2), random block tables over shuffled blocks, and captures one CUDA graph that runs the
backend's decode over every layer; the figure is the median replay / layers. Bytes = K and V of every
context token of every kv head (q and out are negligible). The first layer's output is compared with a
float32 torch reference at each case.

    PYTHONPATH=src python3 benchmarks/kernels/decode_attention.py [--sweep] [--rope] [--pdl]
        [--attn NAME:FIELD=V,...] [--cases 1x512,16x512] [--shapes qwen3-0.6b] [--json out.json]

Runs against whatever `ostinato` PYTHONPATH names, so the same file measures an older tree ("before");
--sweep (needs kernels/decode_attention.py) also times other decode tunings;
--rope also times the step from the qkv projection: the q/k-norm + RoPE kernel (writing K/V) then decode,
against decode_with_rope (all three in the decode kernel); --attn adds DecodeTuning variants
(name:field=value). --pdl also times every variant as a decode step launches it: decode_with_rope
(q/k norm, RoPE and the K/V write in the kernel) with programmatic dependent launch, so each layer's kernel
starts while the one before finishes and reads its first K/V tile before its wait (kernels/decode_attention.py,
PREFETCH). Its bytes are the same K/V; the figure is what attention costs a step where its neighbours let it
overlap them (in a step the neighbours are projections, not attention).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import HBM_READ_BYTES_PER_S, parse_attention_variants, time_graph  # noqa: E402

from ostinato.attention.base import AttentionMetadata  # noqa: E402
from ostinato.attention.triton_paged import TritonPagedBackend  # noqa: E402
SHAPES = {  # name: (layers, heads, kv heads, head_dim)
    "qwen3-0.6b": (28, 16, 8, 128),
    "llama-3.2-1b": (16, 32, 8, 64),
    "llama-3.1-8b": (32, 32, 8, 128),
}
CASES = [(1, 512), (16, 512), (64, 512), (1, 4096), (1, 32768), (16, 4096), (256, 512)]  # (batch, context)
BLOCK = 16


def reference(q, k_cache, v_cache, tables, lens, scale):
    outs = []
    for s in range(q.shape[0]):
        ctx = int(lens[s])
        toks = torch.arange(ctx, device=q.device)
        blocks = tables[s, toks // BLOCK].long()
        k = k_cache[blocks, toks % BLOCK].float()  # [ctx, Hkv, D]
        v = v_cache[blocks, toks % BLOCK].float()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = (torch.einsum("hd,khd->hk", q[s].float(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hk,khd->hd", p, v))
    return torch.stack(outs)


def make_inputs(shape, bs, ctx, max_model_len):
    layers, heads, kv, dim = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    nblk = math.ceil(ctx / BLOCK)
    width = math.ceil(max_model_len / BLOCK)
    num_blocks = bs * nblk + 1
    caches = [(torch.randn(num_blocks, BLOCK, kv, dim, device="cuda", generator=gen, dtype=torch.bfloat16),
               torch.randn(num_blocks, BLOCK, kv, dim, device="cuda", generator=gen, dtype=torch.bfloat16))
              for _ in range(layers)]
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=gen)[: bs * nblk].view(bs, nblk).to(torch.int32)
    tables = torch.full((bs, width), num_blocks - 1, dtype=torch.int32, device="cuda")
    tables[:, :nblk] = perm
    lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(bs, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(bs, dtype=torch.int64, device="cuda"),
                             block_tables=tables, context_lens=lens)
    return caches, q, meta


def measure(backend, inputs, shape, iters=30):
    caches, q, meta = inputs
    tables, lens = meta.block_tables, meta.context_lens
    layers, heads, kv, dim = shape
    bs, ctx = q.shape[0], int(lens[0])
    scale = dim ** -0.5
    out = backend.decode(q, caches[0][0], caches[0][1], meta, scale)  # compile outside the capture
    ref = reference(q, caches[0][0], caches[0][1], tables, lens, scale)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    us = time_graph(lambda i: backend.decode(q, caches[i][0], caches[i][1], meta, scale), layers, iters)
    return figures(us, bs * ctx * kv * dim * 2 * 2, err)


def figures(us, kv_bytes, err):
    """A case's row: µs per layer, and the K/V bytes it read over that time against the HBM ceiling."""
    return {"us_per_layer": us, "GBps": kv_bytes / us / 1e3, "hbm_share": kv_bytes / us / 1e-6 / HBM_READ_BYTES_PER_S,
            "floor_us": kv_bytes / HBM_READ_BYTES_PER_S * 1e6, "rel_err": err}


def measure_with_rope(backend, inputs, shape, fused_rope, iters=30):
    """µs per layer of what a decode layer runs from the qkv projection to the attention output: the
    q/k-norm + RoPE kernel writing K/V, then decode (fused_rope False), or decode_with_rope (True). q/k
    RMSNorm as Qwen3 when the shape is qwen3's. rel_err: fused against unfused on the first layer."""
    from ostinato.kernels import fused
    from ostinato.model.layers import RotaryEmbedding

    caches, q, meta = inputs
    layers, heads, kv, dim = shape
    bs, ctx = q.shape[0], int(meta.context_lens[0])
    gen = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(bs, heads + 2 * kv, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    with torch.device("cuda"):
        rope = RotaryEmbedding(dim, max(ctx + 1, 4096), 1e6, None)
    rope.rebuild(torch.device("cuda"), torch.bfloat16)
    weights = (torch.ones(dim, device="cuda", dtype=torch.bfloat16),) * 2 if heads == 16 else (None, None)
    positions = meta.context_lens.long() - 1
    slots = meta.block_tables[torch.arange(bs, device="cuda"), positions // BLOCK].long() * BLOCK + positions % BLOCK
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots, block_tables=meta.block_tables,
                             context_lens=meta.context_lens)
    scale = dim ** -0.5

    def layer(i, fused_rope=fused_rope):
        k_cache, v_cache = caches[i]
        if fused_rope:
            return backend.decode_with_rope(qkv, *weights, rope.cos_sin_cache, positions, 1e-6, k_cache, v_cache,
                                            meta, scale)
        q_rot = fused.qk_norm_rope_write_kv(qkv, *weights, rope.cos_sin_cache, positions, heads, kv, 1e-6,
                                            k_cache, v_cache, slots)
        return backend.decode(q_rot, k_cache, v_cache, meta, scale)

    a, b = layer(0, True).float(), layer(0, False).float()
    err = ((a - b).norm() / b.norm()).item()
    us = time_graph(layer, layers, iters)
    return figures(us, bs * ctx * kv * dim * 2 * 2, err)


def backend_with(**fields):
    from ostinato.kernels.decode_attention import DecodeTuning
    from ostinato.attention.triton_paged import TritonAttentionTuning

    return TritonPagedBackend(TritonAttentionTuning(decode=DecodeTuning(**fields)))


def report(r):
    print(f"{r['shape']:13s} bs {r['batch']:4d} ctx {r['context']:6d} {r['variant']:22s} {r['us_per_layer']:8.2f} "
          f"us/layer {r['GBps']:7.0f} GB/s ({100 * r['hbm_share']:5.1f}% HBM, floor {r['floor_us']:.2f} us) "
          f"err {r['rel_err']:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=2048, help="block-table width (as the engine's)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--rope", action="store_true",
                    help="time q/k-norm + RoPE + K/V write + decode: two launches vs decode_with_rope (one)")
    ap.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES), help="BATCHxCONTEXT,...")
    ap.add_argument("--attn", nargs="*", default=[], metavar="NAME:FIELD=V,...", help="DecodeTuning variants")
    ap.add_argument("--pdl", action="store_true", help="also time each variant as a step launches it (RoPE, PDL)")
    args = ap.parse_args()
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    variants = {"default": TritonPagedBackend()}
    fields_of = {"default": {}}
    for vname, fields in parse_attention_variants(args.attn).items():
        variants[vname], fields_of[vname] = backend_with(**fields), fields
    if args.sweep:
        from ostinato.kernels.decode_attention import DecodeTuning
        from ostinato.attention.triton_paged import TritonAttentionTuning

        for bn in (32, 64):
            for stages in (1, 3):
                for pps in (2, 4):
                    tuning = DecodeTuning(block_n=bn, num_stages=stages, programs_per_sm=pps)
                    variants[f"bn{bn}_st{stages}_pps{pps}"] = TritonPagedBackend(TritonAttentionTuning(decode=tuning))
    rows = []
    for name in args.shapes.split(","):
        for bs, ctx in cases:
            mml = max(args.max_model_len, ctx + BLOCK)
            inputs = make_inputs(SHAPES[name], bs, ctx, mml)
            if args.rope:
                for fused_rope in (False, True):
                    r = measure_with_rope(variants["default"], inputs, SHAPES[name], fused_rope)
                    vname = "decode_with_rope" if fused_rope else "rope kernel+decode"
                    r.update(shape=name, batch=bs, context=ctx, variant=vname, max_model_len=mml)
                    rows.append(r)
                    print(f"{name:13s} bs {bs:4d} ctx {ctx:6d} {vname:18s} {r['us_per_layer']:8.2f} us/layer "
                          f"(fused vs unfused rel err {r['rel_err']:.1e})", flush=True)
            for vname, backend in variants.items():
                if vname.startswith("bn") and ((bs, ctx) not in ((1, 512), (64, 512), (16, 512), (1, 32768))
                                               or name == "llama-3.1-8b"):
                    continue
                r = measure(backend, inputs, SHAPES[name])
                r.update(shape=name, batch=bs, context=ctx, variant=vname, max_model_len=mml)
                rows.append(r)
                report(r)
                if args.pdl and vname in fields_of:
                    r = measure_with_rope(backend_with(**fields_of[vname], pdl=True), inputs, SHAPES[name], True)
                    r.update(shape=name, batch=bs, context=ctx, variant=f"{vname}+rope+pdl", max_model_len=mml)
                    rows.append(r)
                    report(r)
            del inputs
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
