"""What the few-rows GEMVs compile to on sm_90, without a GPU: registers, shared memory, and the innermost loop's
SASS (instructions a thread a weight byte, and the opcode mix), for the first FP8 GEMV (kernels/fp8_gemv.py), the
streaming FP8 GEMV (kernels/fp8_stream.py), the bf16 GEMV (kernels/gemv.py) and the GGUF Q4_K / Q6_K / Q8_0
integer-dot GEMVs (kernels/gguf_int8_q4k.py, gguf_int8_q6k_q80.py; code bytes only, not their headers and scales)
at the 8B's one-row tiles, and Q4_K's 4-row kernel; the decode attention kernel (kernels/decode_attention.py)
over a bf16 and an FP8 KV cache at llama-3.2-1b's heads, as a batch that fills the GPU launches it (K/V bytes), and
at the 8B's one row with its output quantized for a GGUF o_proj and not; the split GEMM
(kernels/split_gemm.py), W8A16 and W8A8, whether its K loop copies asynchronously and on which MMA; and the
activations' FP8 quantization (kernels/fp8_tokens.py), alone and with the norm or the SwiGLU, for spills.

Why: a bandwidth-bound kernel that is not at the bandwidth is often issuing too many instructions a byte or
re-laying data out through shared memory; both show in the SASS, which Triton's bundled ptxas and nvdisasm
produce on any machine. Pointers, strides, N and K are compiled as multiples of 16, as the JIT specializes them
at the real shapes. Static counts, not timings: a loop's instructions run once per K step per thread, or, where
the compiler unrolled the loop (the GGUF kernels' dp4a count says so), once per that many K steps, and the counts
are divided by it.

    PYTHONPATH=src python3 benchmarks/kernels/fp8_sass.py [--out DIR]   (DIR keeps the .sass and .ttgir files)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ostinato.kernels import (decode_attention, fp8_gemv, fp8_linear, fp8_stream, gemv, gguf_int8_q4k,
                              gguf_int8_q6k_q80, split_gemm)
from ostinato.kernels.decode_plan import DecodeTuning

TARGET = GPUTarget("cuda", 90, 32)
# Integer arguments the JIT sees as multiples of 16 (and so specializes: without it, loads from offsets built on
# them lose their alignment, and the split GEMM its asynchronous copies).
SIZES = ("N", "K", "n_words", "row_words", "n_pos", "row_len", "K_PER_SPLIT")
_NVIDIA_BIN = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")


def _compile(fn, signature: dict, constants: dict, num_warps: int = 4, num_stages: int = 1):
    sig = dict(signature, **{name: "constexpr" for name in constants})
    aligned = [n for n, t in signature.items() if t.startswith("*") or n.startswith("stride") or n in SIZES]
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(n),): v for n, v in constants.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(_NVIDIA_BIN, name), *args], capture_output=True, text=True, check=True).stdout


def _innermost_loop(sass: str) -> collections.Counter:
    """Opcodes between the shortest backward branch's target label and the branch (the K loop)."""
    lines = sass.splitlines()
    loops = []
    for i, line in enumerate(lines):
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            back = [j for j in range(i + 1, len(lines)) if f"`({label.group(1)})" in lines[j] and "BRA" in lines[j]]
            if back and back[0] - i > 4:
                loops.append((i, back[0]))
    start, end = min(loops, key=lambda span: span[1] - span[0])
    ops = collections.Counter()
    for line in lines[start:end + 1]:
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if op:
            ops[op.group(1)] += 1
    return ops


def _disassemble(name: str, compiled, out_dir: str) -> tuple[str, str]:
    """(SASS, registers a thread) of a compiled kernel, its .cubin, .ttgir and .sass kept in out_dir as `name`."""
    path = os.path.join(out_dir, name.replace(" ", "_"))
    with open(path + ".cubin", "wb") as f:
        f.write(compiled.asm["cubin"])
    with open(path + ".ttgir", "w") as f:
        f.write(compiled.asm["ttgir"])
    sass = _tool("nvdisasm", "-c", path + ".cubin")
    with open(path + ".sass", "w") as f:
        f.write(sass)
    return sass, re.search(r"REG:(\d+)", _tool("cuobjdump", "-res-usage", path + ".cubin")).group(1)


def report(name: str, compiled, weight_bytes_per_step: int, threads: int, out_dir: str,
           dp4a_per_step: int | None = None) -> None:
    """Print the compiled kernel's registers, shared memory and innermost loop. dp4a_per_step: the dp4a (IDP) a
    thread issues in one K step, from which the loop's unrolling is read (None: taken as not unrolled)."""
    sass, regs = _disassemble(name, compiled, out_dir)
    ops = _innermost_loop(sass)
    unrolled = max(1, ops["IDP"] // dp4a_per_step) if dp4a_per_step else 1
    total = sum(ops.values())
    per_byte = total / unrolled / (weight_bytes_per_step / threads)
    note = f", {unrolled} K steps" if unrolled > 1 else ""
    print(f"{name:44s} regs {regs:>3s}  smem {compiled.metadata.shared:6d} B  loop {total:4d} instr{note} "
          f"({per_byte:.2f} a byte read)  {dict(ops.most_common(9))}")


FP8_GEMV_SIG = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*bf16",
                "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
                "stride_om": "i32"}
STREAM_SIG = {"x_ptr": "*bf16", "x64_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*fp32", "b_ptr": "*fp32",
              "out_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "normed_ptr": "*bf16", "counter_ptr": "*i32",
              "M": "i32", "N": "i32", "K": "i32", "stride_x64": "i32", "stride_wn": "i32", "stride_sn": "i32",
              "stride_om": "i32", "stride_rm": "i32", "stride_nm": "i32", "eps": "fp32"}
GEMV_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "res_ptr": "*bf16",
            "nw_ptr": "*bf16", "res_out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
            "stride_wn": "i32", "stride_om": "i32", "stride_rm": "i32", "stride_rom": "i32", "eps": "fp32"}
Q4K_ONE_ROW_SIG = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "sx_ptr": "*fp32", "cx_ptr": "*fp32", "w_ptr": "*i32",
                   "b_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32", "n_words": "i32", "row_words": "i32"}
Q4K_SIG = dict(Q4K_ONE_ROW_SIG, stride_om="i32")
Q8_SIG = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "w_ptr": "*i32", "b_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32",
          "n_words": "i32", "row_len": "i32", "stride_om": "i32"}
Q6K_SIG = {"xq_ptr": "*i32", "dx_ptr": "*fp32", "s16_ptr": "*fp32", "w_ptr": "*i32", "b8_ptr": "*u8",
           "b_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32", "n_pos": "i32", "row_words": "i32",
           "stride_om": "i32"}

DECODE_POINTERS = {"q_ptr": "*bf16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "out_ptr": "*bf16",
                   "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "counters_ptr": "*i32",
                   "q_weight_ptr": "*bf16", "k_weight_ptr": "*bf16", "cos_sin_ptr": "*bf16", "positions_ptr": "*i64",
                   "slot_mapping_ptr": "*i64", "xq_ptr": "*i32", "dx_ptr": "*fp32", "sx_ptr": "*fp32",
                   "cx_ptr": "*fp32", "s16_ptr": "*fp32"}


def decode_signature(cache: str) -> dict:
    """The decode kernel's arguments: pointers as DECODE_POINTERS and `cache` for K and V, the rest int32 but for
    the two float scalars."""
    sig = {}
    for name in decode_attention._decode_split_kernel.arg_names:
        if name in ("k_cache_ptr", "v_cache_ptr"):
            sig[name] = cache
        elif name in DECODE_POINTERS:
            sig[name] = DECODE_POINTERS[name]
        elif name in ("scale_log2e", "eps"):
            sig[name] = "fp32"
        elif not name.isupper():
            sig[name] = "i32"
    return sig


def report_decode_attention(out_dir: str) -> None:
    """The decode kernel as a step at batch 64 launches it on llama-3.2-1b (32 heads on 8 KV heads of 64, RoPE in
    the kernel, one slice a sequence): its K/V loop over a bf16 cache and over an FP8 one."""
    tuning = DecodeTuning()
    meta = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, GROUP_PAD=16, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_SIZE=16,
                BLOCK_N=tuning.block_n, SPLIT=False, MERGE_GROUP=4, MERGE_CHUNK=1, SPLITS_PAD=1,
                DOT_PRECISION="tf32", UPCAST_DOT=False, ROPE=True, QK_NORM=False, EMULATE_BF16=False, PDL=True,
                PREFETCH=True, QUANT_OUT=False)
    for cache, itemsize in (("*bf16", 2), ("*fp8e4nv", 1)):
        compiled = _compile(decode_attention._decode_split_kernel, decode_signature(cache), meta,
                            num_warps=tuning.num_warps, num_stages=tuning.num_stages)
        kv_bytes = 2 * tuning.block_n * meta["HEAD_DIM"] * itemsize
        report(f"decode attention, {cache[1:]} KV, 1B heads", compiled, kv_bytes, 32 * tuning.num_warps, out_dir)


def report_decode_quantized_output(out_dir: str) -> None:
    """The decode kernel as the 8B's one-row step launches it (32 heads on 8 KV heads of 128, 32 slices), its output
    stored in bf16 and written quantized for a GGUF o_proj (DecodeTuning.quantize_output, kernels/decode_output.py):
    registers, shared memory, instructions in all, spills."""
    tuning, splits = DecodeTuning(), 32
    splits_pad = triton.next_power_of_2(tuning.merge_slices(splits))
    meta = dict(NUM_HEADS=32, NUM_KV_HEADS=8, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16,
                BLOCK_N=tuning.block_n, SPLIT=True, MERGE_GROUP=4, SPLITS_PAD=splits_pad,
                MERGE_CHUNK=max(1, min(splits_pad, tuning.merge_chunk_elems // (4 * 128))), DOT_PRECISION="tf32",
                UPCAST_DOT=False, ROPE=True, QK_NORM=False, EMULATE_BF16=False, PDL=True, PREFETCH=True)
    num_warps, num_stages = tuning.launch_for(splits, 8, 132)
    for quantized in (False, True):
        compiled = _compile(decode_attention._decode_split_kernel, decode_signature("*bf16"),
                            dict(meta, QUANT_OUT=quantized), num_warps=num_warps, num_stages=num_stages)
        sass, regs = _disassemble(f"decode_8B_one_row{'_quantized' if quantized else ''}", compiled, out_dir)
        instructions = len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))
        print(f"decode attention, 8B one row, output {'quantized' if quantized else 'bf16':9s} regs {regs:>3s}  "
              f"smem {compiled.metadata.shared:6d} B  {instructions} instr  spills {sass.count(' STL')} stores, "
              f"{sass.count(' LDL')} loads")


SPLIT_POINTERS = {"xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16",
                  "part_ptr": "*fp32", "counters_ptr": "*i32"}
# What tells a pipelined tensor-core loop from one that is not: asynchronous copies to shared memory (LDGSTS), the
# FP8 (QGMMA) or 16-bit (HGMMA) warpgroup MMAs, conversions from E4M3, byte stores to shared memory, spills.
GEMM_OPS = ("LDGSTS", "QGMMA", "HGMMA", "F2FP.F16.E4M3", "STS.U8", "STL", "LDL")


def report_split_gemm(out_dir: str) -> None:
    """The split GEMM (kernels/split_gemm.py) at the tiles the FP8 rule gives the 8B's projections, K split in
    parallel: W8A16 at 16 rows and W8A8 at 64 (FP8 activations). Whole-kernel opcode counts, not a loop's: the K
    loop is software-pipelined and its prologue holds copies too."""
    w8a16, w8a8 = (fp8_linear.choose_fp8_path(m, 6144, 4096, False, cuda=True) for m in (16, 64))
    for name, x, rows, tiles in (("W8A16, 16 rows", "*bf16", 16, w8a16), ("W8A8, 64 rows", "*fp8e4nv", 64, w8a8.tiles)):
        kernel = split_gemm._split_gemm_kernel
        sig = {a: dict(SPLIT_POINTERS, x_ptr=x).get(a, "i32") for a in kernel.arg_names
               if not a.isupper() or a in ("M", "N", "K", "K_PER_SPLIT", "SPLITS")}
        compiled = _compile(kernel, sig, dict(
            ROW_TILE=rows, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, HAS_SCALE=True, HAS_X_SCALE=x != "*bf16",
            HAS_BIAS=False, PARALLEL=True, PREFETCH=False, DOT_PRECISION="tf32", UPCAST_DOT=False,
            ROWWISE_DOT=False, PDL=True, BLOCK_SCALES=False, SCALE_BN=1, SCALE_BK=1), num_warps=tiles.num_warps,
            num_stages=tiles.num_stages)
        sass, regs = _disassemble(f"split_gemm_{'w8a8' if x != '*bf16' else 'w8a16'}", compiled, out_dir)
        ops = {op: len(re.findall(rf"\b{re.escape(op)}\S*", sass)) for op in GEMM_OPS}
        print(f"split GEMM {tiles.block_n}x{tiles.block_k} w{tiles.num_warps}, {name:15s} regs {regs:>3s}  smem "
              f"{compiled.metadata.shared:6d} B  {ops}")


def report_fp8_tokens(out_dir: str) -> None:
    """The activations' per-token FP8 quantization (kernels/fp8_tokens.py) as the 8B's W8A8 projections launch it:
    x alone and with the norm folded in (4096 wide), with the SwiGLU (14,336 wide): the row in registers, so
    registers and spills are what to watch."""
    from ostinato.kernels import fp8_tokens

    sig = {a: "*bf16" for a in ("x_ptr", "r_ptr", "w_ptr", "res_out_ptr")}
    sig.update(q_ptr="*fp8e4nv", s_ptr="*fp32", stride_xm="i32", stride_rm="i32", stride_qm="i32", eps="fp32")
    for name, k, glu, norm in (("x", 4096, False, False), ("norm folded in", 4096, False, True),
                               ("SwiGLU folded in", 14336, True, False)):
        block, warps = fp8_tokens.row_tile(k)
        compiled = _compile(fp8_tokens._quantize_tokens_kernel, sig, dict(
            K=k, BLOCK_K=block, GLU=glu, NORM=norm, HAS_RESIDUAL=norm, EMULATE_BF16=False,
            FP8_LIMIT=fp8_linear.FP8_MAX, FLOOR=fp8_linear.SCALE_FLOOR, PDL=True), num_warps=warps)
        sass, regs = _disassemble(f"fp8_tokens_{name}", compiled, out_dir)
        spills = len(re.findall(r"\bSTL", sass)) + len(re.findall(r"\bLDL", sass))
        print(f"FP8 token quantization, {name:17s} K {k:5d} w{warps:<2d} regs {regs:>3s}  spill instructions {spills}")


# The streaming GEMV's scale arguments for per-row scales.
PER_ROW = dict(BLOCK_SCALES=False, SCALE_BN=1, WORDS_PER_BLOCK=1, UNIFORM=False, EVEN_J=True, NORM_AFTER=False,
               BLOCK_H=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for the .sass / .ttgir files (default: a temporary one)")
    args = ap.parse_args()
    out_dir = args.out or tempfile.mkdtemp(prefix="fp8_sass_")
    os.makedirs(out_dir, exist_ok=True)
    tile = 8 * 1024  # the 8B's one-row tiles: 8 rows by 1024 inputs a K step
    report("bf16 GEMV 8x1024", _compile(gemv._gemv_kernel, GEMV_SIG, dict(
        M_PAD=1, BLOCK_N=8, BLOCK_K=1024, HAS_BIAS=False, PEEL_FIRST=False, PDL=True, X_MODE=0, HAS_RESIDUAL=False,
        K_PAD=1, EMULATE_BF16=False, GLU=False), num_stages=3), 2 * tile, 128, out_dir)
    report("first FP8 GEMV 8x1024", _compile(fp8_gemv._fp8_gemv_kernel, FP8_GEMV_SIG, dict(
        M_PAD=1, BLOCK_N=8, BLOCK_K=1024, K_TILES=1, EVEN_K=True, HAS_BIAS=False, BLOCK_SCALES=False, SCALE_BN=1,
        SCALE_BK=1, PDL=True), num_stages=3), tile, 128, out_dir)
    for prefetch in (1, 2):
        for asm in (True, False):
            report(f"stream FP8 GEMV 8x1024 p{prefetch}{'' if asm else ' (no PTX cvt)'}",
                   _compile(fp8_stream._fp8_stream_kernel, STREAM_SIG, dict(
                       ROWS=1, BLOCK_N=8, BLOCK_J=256, PREFETCH=prefetch, HAS_BIAS=False, GLU=False, ASM=asm,
                       EMULATE_BF16=False, PDL=True, **PER_ROW)), tile, 128, out_dir)
    for uniform in (True, False):
        report(f"stream FP8 GEMV 8x1024 p1, 128x128 blocks{'' if uniform else ', scales a row'}",
               _compile(fp8_stream._fp8_stream_kernel, STREAM_SIG, dict(
                   ROWS=1, BLOCK_N=8, BLOCK_J=256, PREFETCH=1, HAS_BIAS=False, GLU=False, ASM=True,
                   EMULATE_BF16=False, PDL=True, BLOCK_SCALES=True, SCALE_BN=128, WORDS_PER_BLOCK=32,
                   UNIFORM=uniform, EVEN_J=True, NORM_AFTER=False, BLOCK_H=1)), tile, 128, out_dir)
    report("stream FP8 GEMV 8x1024 p1, SwiGLU", _compile(fp8_stream._fp8_stream_kernel, STREAM_SIG, dict(
        ROWS=1, BLOCK_N=8, BLOCK_J=256, PREFETCH=1, HAS_BIAS=False, GLU=True, ASM=True, EMULATE_BF16=False, PDL=True,
        **PER_ROW)), tile, 128, out_dir)
    report("stream FP8 GEMV 8x1024 p1, then the norm", _compile(fp8_stream._fp8_stream_kernel, STREAM_SIG, dict(
        ROWS=1, BLOCK_N=8, BLOCK_J=256, PREFETCH=1, HAS_BIAS=False, GLU=False, ASM=True, EMULATE_BF16=False, PDL=True,
        **dict(PER_ROW, NORM_AFTER=True, BLOCK_H=4096))), tile, 128, out_dir)
    report("stream FP8 GEMV 4x1024 p1, 4 rows", _compile(fp8_stream._fp8_stream_kernel, STREAM_SIG, dict(
        ROWS=4, BLOCK_N=4, BLOCK_J=256, PREFETCH=1, HAS_BIAS=False, GLU=False, ASM=True, EMULATE_BF16=False,
        PDL=True, **PER_ROW)), tile // 2, 128, out_dir)
    q4k, q6k = gguf_int8_q4k.Q4kTiles(), gguf_int8_q6k_q80.q6k_tiles(1)
    q4k_meta = dict(BLOCK_N=q4k.block_n, BLOCK_J=q4k.block_j, EVEN=True, HAS_BIAS=False, PDL=True, ASM=True)
    q4k_step = (q4k.block_n * q4k.block_j * 4, 32 * q4k.num_warps, out_dir)
    words_a_thread = q4k.block_n * q4k.block_j // (32 * q4k.num_warps)
    report(f"GGUF Q4_K int8 dot {q4k.block_n}x{q4k.block_j} words", _compile(
        gguf_int8_q4k._q4k_one_row_kernel, Q4K_ONE_ROW_SIG, q4k_meta, num_warps=q4k.num_warps), *q4k_step,
        dp4a_per_step=2 * words_a_thread)  # a word's low and high nibbles
    report(f"GGUF Q4_K int8 dot {q4k.block_n}x{q4k.block_j} words, 4 rows", _compile(
        gguf_int8_q4k._q4k_rows_kernel, Q4K_SIG, dict(q4k_meta, ROWS=4), num_warps=q4k.num_warps), *q4k_step,
        dp4a_per_step=8 * words_a_thread)
    report(f"GGUF Q6_K int8 dot {q6k.block_n}x{q6k.block_j} positions", _compile(
        gguf_int8_q6k_q80._q6k_row_kernel, Q6K_SIG, dict(ROWS=1, BLOCK_N=q6k.block_n, BLOCK_J=q6k.block_j,
                                                        EVEN=True, HAS_BIAS=False, PDL=True, ASM=True),
        num_warps=q6k.num_warps),
        q6k.block_n * q6k.block_j * 12, 32 * q6k.num_warps, out_dir,
        dp4a_per_step=4 * q6k.block_n * q6k.block_j // (32 * q6k.num_warps))  # a position's four quarters
    q8 = gguf_int8_q6k_q80.q8_tiles(1)
    report(f"GGUF Q8_0 int8 dot {q8.block_n}x{q8.block_j} words", _compile(
        gguf_int8_q6k_q80._q80_row_kernel, Q8_SIG, dict(ROWS=1, BLOCK_N=q8.block_n, BLOCK_J=q8.block_j, EVEN=True,
                                                       QUADS=True, HAS_BIAS=False, PDL=True, ASM=True),
        num_warps=q8.num_warps),
        q8.block_n * q8.block_j * 4, 32 * q8.num_warps, out_dir,
        dp4a_per_step=q8.block_n * q8.block_j // (32 * q8.num_warps))
    report_decode_attention(out_dir)
    report_decode_quantized_output(out_dir)
    report_split_gemm(out_dir)
    report_fp8_tokens(out_dir)
    print(f"(files in {out_dir})")


if __name__ == "__main__":
    main()
