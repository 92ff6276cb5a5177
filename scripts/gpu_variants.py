"""Variants of one decode step, in one process: where the batch-1 time goes, and which tunings beat the default.

The same DecodeStep (forward and in-graph sampling, PDL as the engine resolves it) is captured once per variant
and batch size, then the graphs are replayed in alternating rounds, so that clocks and process-to-process
noise (up to 9% between two `ostinato bench` runs) hit every variant alike; the spread within a process is
well under 1%. Two kinds of variant:

- ablations (`no-attention`, `no-norms`, `no-silu`; one projection: `no-qkv`, `no-o`, `no-gate-up`, `no-down`):
  that work replaced by nothing (no kernel; its output is an uninitialised or aliased tensor of the right
  shape). The step is then wrong; its time says what that class of kernel costs the step, with PDL's overlap
  counted, which the profiler's per-kernel times cannot. A projection's line also gives its weight bytes over
  that saving: its bandwidth in the step;
- `no-norm-fold`: the RMSNorms launched apart from the GEMVs after them (kernels/gemv.py's fold off): what the
  fold saves; `fold-glu` / `no-glu-fold`: the SwiGLU activation folded into the gate_up projection
  everywhere a Triton kernel takes it / nowhere (gemv.choose_glu_fold on / off);
- `pdl-off-P`: projection P (qkv, o, gate-up, down) launched without PDL, the rest as the engine does;
  `skinny-pdl-on`: every few-rows kernel launch with PDL (skinny.keeps_pdl turns it off for the folded gate_up
  above 8 rows);
- tunings (`attn-...`, `gemv-...`, `skinny-...`): the decode attention's launch settings (kernels/decode_plan.py,
  DecodeTuning), the small-batch linear's tiles (kernels/gemv.py), or the rows it leaves to cuBLAS on the
  tensor-core kernel for a few rows (kernels/skinny.py), changed before capture. Their logits are
  compared with the default's (`rel diff`): a tuning changes summation order, never what is computed.
  `--attn NAME:FIELD=V,...` adds any DecodeTuning; `--base-tree DIR` adds another tree's decode attention
  kernel (`base-attention`), given this tree's tuning values for the fields that tree knows.

    PYTHONPATH=src python3 scripts/gpu_variants.py /tmp/ck-llama-3.2-1b --batches 1 16 [--only attn-]
    PYTHONPATH=src python3 scripts/gpu_variants.py CK --batches 1 16 64 --only no-attention --base-tree .base \
        --attn w2:num_warps=2      (.base: `git archive REV src | tar -x -C .base`; --only none: no fixed ones)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import types
from unittest import mock

import torch
import triton

from ostinato.kernels import decode_attention as triton_decode
from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.model import gemv, skinny
from ostinato.kernels.split_counters import SplitCounters
from ostinato.tools.bench.decode import rows_loaded

from gpu_pdl import capture, time_replays  # noqa: E402  (scripts/ is on sys.path when run as a script)
from gpu_timing import parse_attention_variants  # noqa: E402


@contextlib.contextmanager
def attention_tuning(runner, **fields):
    backend = runner.backend
    saved = backend.tuning
    backend.tuning = dataclasses.replace(saved, decode=dataclasses.replace(saved.decode, **fields))
    try:
        yield
    finally:
        backend.tuning = saved


@contextlib.contextmanager
def kernels_replaced(runner, **fns):
    saved = runner.model.kernels
    runner.model.kernels = dataclasses.replace(saved, **fns)
    try:
        yield
    finally:
        runner.model.kernels = saved


@contextlib.contextmanager
def no_attention(runner):
    backend = runner.backend
    saved = backend.decode_with_rope

    def skipped(heads, q_weight, k_weight, cos_sin_cache, positions, eps, k_cache, v_cache, meta, scale):
        num_kv = k_cache.shape[2]
        return heads.new_empty(heads.shape[0], heads.shape[1] - 2 * num_kv, heads.shape[2])

    backend.decode_with_rope = skipped
    try:
        yield
    finally:
        backend.decode_with_rope = saved


@contextlib.contextmanager
def gemv_tiles(change):
    rule = gemv.choose_gemv_tiles

    def changed(m, n, k, pdl=False):
        tiles = rule(m, n, k, pdl)
        return None if tiles is None else change(tiles, m, n, k)

    gemv.choose_gemv_tiles = changed
    try:
        yield
    finally:
        gemv.choose_gemv_tiles = rule


@contextlib.contextmanager
def gemv_rows(max_rows: int, block_k: int | None = None):
    """The GEMV (and with it the norm fold and the SwiGLU fold) for 2..max_rows rows wherever the rule gives it
    batch 1 at that projection, with batch 1's tiles (block_k replaced where given): the few-rows kernel and
    cuBLAS take those rows on main, with the norm before qkv and gate_up launched apart."""
    rule = gemv.choose_gemv_tiles

    def changed(m, n, k, pdl=False):
        if 2 <= m <= max_rows:
            tiles = rule(1, n, k, pdl)
            if tiles is not None:
                return tiles if block_k is None else dataclasses.replace(tiles, block_k=block_k)
        return rule(m, n, k, pdl)

    gemv.choose_gemv_tiles = changed
    try:
        yield
    finally:
        gemv.choose_gemv_tiles = rule


def whole_k(tiles, m, n, k):
    """Every weight byte of a program requested before the PDL wait: one K step covering K (up to 4096)."""
    if k > 4096:
        return tiles
    return dataclasses.replace(tiles, block_k=max(tiles.block_k, 1 << (k - 1).bit_length()), peel_first=True)


def glu_fold(on: bool = True):
    """kernels/gemv.py's choose_glu_fold on (or off) at every shape: the SwiGLU activation out of the gate_up
    projection's GEMV or few-rows kernel wherever one of them takes it, no activation kernel there (or always
    the activation kernel: no-glu-fold)."""
    return mock.patch.object(gemv, "choose_glu_fold", lambda m, n, k, pdl=False: on)


@contextlib.contextmanager
def skinny_rule(rule):
    """kernels/skinny.py's rule (choose_skinny_tiles) replaced by `rule(m, n, k)` before capture."""
    saved = skinny.choose_skinny_tiles
    skinny.choose_skinny_tiles = lambda m, n, k, pdl=False: rule(m, n, k) if 2 <= m <= skinny.MAX_ROWS else None
    try:
        yield
    finally:
        skinny.choose_skinny_tiles = saved


def skinny_rows(tiles):
    """Every projection of 2-16 rows that the GEMV does not take on the kernel with these tiles, whatever the rule
    says (it takes only the shapes where it was measured to beat cuBLAS); tiles None: all on cuBLAS (rule off)."""
    return skinny_rule(lambda m, n, k: tiles)


def skinny_only(runner, which: str):
    """One projection (PROJECTIONS) of 2-16 rows on the kernel, with the rule's tiles for that row count, every
    other on cuBLAS (picked by the projection's shape, distinct within each public model): against skinny-off,
    what the kernel does for that projection alone."""
    shape = tuple(projection_layers(runner, which)[0].weight.shape)  # (N, K)
    return skinny_rule(lambda m, n, k: skinny.tiles_for_rows(m) if (n, k) == shape else None)


@contextlib.contextmanager
def skinny_split(runner, which: str, split: int, counters: SplitCounters):
    """skinny_only with the projection's K cut into `split` slices (SkinnyTiles.split_k), every launch given
    `counters`, as a decoder that owned them would pass them (no rule picks a split yet, so the decoder has none).
    The counters must outlive every graph captured here: a graph bakes in their address, and once freed their
    memory goes to other tensors, which the kernel's atomics then corrupt (the tenth session's version made
    them here and freed them on exit: an illegal address at the next replay, and figures not to trust)."""
    real = skinny.skinny_linear
    with skinny_only(runner, which):
        rule = skinny.choose_skinny_tiles  # skinny_only's
        skinny.choose_skinny_tiles = lambda m, n, k, pdl=False: (
            None if (t := rule(m, n, k, pdl)) is None else dataclasses.replace(t, split_k=split))
        skinny.skinny_linear = functools.partial(real, counters=counters)
        try:
            yield
        finally:
            skinny.skinny_linear = real


@contextlib.contextmanager
def base_tree_attention(runner, tree: str):
    """Decode attention from another source tree (`git archive REV src | tar -x -C TREE`), in this process: the
    tree's ostinato package is copied as `ostinato_base` (its kernels import each other relatively) and its
    paged_decode replaces this tree's with the same counters and inputs, and this tree's tuning values for
    the fields its DecodeTuning has (a field only this tree has, e.g. split_num_stages, is dropped)."""
    import importlib
    import shutil
    import sys

    pkg_root = f"/tmp/ostinato_base_pkg-{os.path.basename(os.path.abspath(tree))}"  # a warm machine keeps /tmp
    if not os.path.isdir(os.path.join(pkg_root, "ostinato_base")):
        shutil.copytree(os.path.join(tree, "src", "ostinato"), os.path.join(pkg_root, "ostinato_base"))
    if pkg_root not in sys.path:
        sys.path.insert(0, pkg_root)
    old = importlib.import_module("ostinato_base.attention.triton_decode")
    backend = runner.backend
    saved = backend.decode_with_rope

    def base_decode_with_rope(heads, q_weight, k_weight, cos_sin_cache, positions, eps, k_cache, v_cache, meta,
                              scale):
        num_kv = k_cache.shape[2]
        group = (heads.shape[1] - 2 * num_kv) // num_kv
        known = {f.name for f in dataclasses.fields(old.DecodeTuning)}
        tuning = old.DecodeTuning(**{k: v for k, v in dataclasses.asdict(backend.tuning.decode).items() if k in known})
        rope = old.DecodeRope(q_weight, k_weight, cos_sin_cache, positions, meta.slot_mapping, eps)
        return old.paged_decode(heads.contiguous(), k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                group, tuning, backend.split_counters, rope)

    backend.decode_with_rope = base_decode_with_rope
    try:
        yield
    finally:
        backend.decode_with_rope = saved


def merge_tile_padded(pad: int):
    """The split launch's merge compiled for at least `pad` slices (SPLITS_PAD, and the merge chunk with it, as a
    launch of `pad` slices compiles them) while the grid keeps the rule's split count: whether a lead that forced
    more slices comes from the extra (empty) programs or from the compiled kernel. triton.next_power_of_2 is
    seen by paged_decode alone through this patch; the groups it also pads (<= 4 here) stay as they are."""
    real = triton.next_power_of_2
    shim = types.SimpleNamespace(next_power_of_2=lambda n: max(pad, real(n)) if n > 4 else real(n))
    return mock.patch.object(triton_decode, "triton", shim)


def attention_maxnreg(regs: int):
    """The decode attention compiled with at most `regs` registers a thread (ptxas .maxnreg): more programs
    resident on an SM, where the default's register count limits them."""
    real = triton_decode.launch_options
    return mock.patch.object(triton_decode, "launch_options", lambda pdl: {**real(pdl), "maxnreg": regs})


def print_attention_kernels() -> None:
    """Registers, spills, shared memory and the programs an SM can hold (H100/H200 limits: 64K registers, 64
    warps, 227 KB shared, 32 blocks) of every compiled split kernel, with the constexprs that tell them apart."""
    fn = triton_decode._decode_split_kernel
    shown = ("GROUP", "HEAD_DIM", "BLOCK_N", "SPLIT", "MERGE", "SPLITS_PAD", "MERGE_CHUNK", "ROPE", "PDL")
    for caches in fn.device_caches.values():
        for kernel in caches[0].values():
            kernel._init_handles()
            consts = {}
            for path, value in getattr(kernel.src, "constants", {}).items():
                idx = path[0] if isinstance(path, tuple) else path
                name = fn.arg_names[idx] if isinstance(idx, int) else idx
                if name in shown:
                    consts[name] = value
            warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
            regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
            per_sm = min(32, 64 // warps, 65536 // (regs_per_warp * warps), 232448 // max(shared, 1))
            print(f"attention kernel {consts}: warps {warps}, stages {kernel.metadata.num_stages}, regs "
                  f"{kernel.n_regs}, spills {kernel.n_spills}, shared {shared} B -> {per_sm} programs an SM",
                  flush=True)


PROJECTIONS = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"), "gate-up": ("mlp", "gate_up_proj"),
               "down": ("mlp", "down_proj")}
# The variants that remove work (their logits are wrong by design, so not compared); no-norm-fold and no-glu-fold
# are tunings, compared like the rest.
ABLATIONS = {"no-attention", "no-norms", "no-silu", *(f"no-{which}" for which in PROJECTIONS)}


def projection_layers(runner, which: str) -> list[torch.nn.Linear]:
    """That projection's module in every layer, first layer first (PROJECTIONS: which -> (module, attribute))."""
    module, attr = PROJECTIONS[which]
    return [getattr(getattr(layer, module), attr) for layer in runner.model.model.layers]


def no_projection(runner, which: str):
    """Ablation: one projection of every layer replaced by nothing (an uninitialised [T, N] output). The norm a
    GEMV folds (qkv, gate_up) stays, launched as its own kernel, so the saving is the projection's cost in the
    step less one norm launch's; layers x weight bytes over the saving is the projection's in-step bandwidth."""
    targets = {id(layer) for layer in projection_layers(runner, which)}
    saved = runner.model.kernels

    def linear(x, layer, **kw):
        if id(layer) in targets:
            return x.new_empty(x.shape[0], layer.weight.shape[0])
        return saved.linear(x, layer, **kw)

    def norm_linear(x, residual, weight, eps, layer):
        if id(layer) not in targets:
            return saved.norm_linear(x, residual, weight, eps, layer) if saved.norm_linear else None
        if residual is None:
            normed, residual = saved.rms_norm(x, weight, eps), x
        else:
            normed, residual = saved.fused_add_rms_norm(x, residual, weight, eps)
        return normed.new_empty(normed.shape[0], layer.weight.shape[0]), residual

    return kernels_replaced(runner, linear=linear, norm_linear=norm_linear)


def projection_without_pdl(runner, which: str):
    """One projection of every layer launched without programmatic dependent launch (the rest as the engine
    launches them): its programs then start only once the kernel before has finished. For the lead that the
    SwiGLU fold loses at 16 rows because down_proj's programs, launched early, wait on SMs the folded gate_up
    still holds (docs/PERFORMANCE.md, eleventh session). Only where the projection goes through kernels.linear:
    a GEMV with the norm folded in (qkv and gate_up at batch 1) keeps its PDL launch."""
    targets = {id(layer) for layer in projection_layers(runner, which)}
    saved = runner.model.kernels

    def linear(x, layer, **kw):
        if id(layer) in targets:
            return gemv.small_batch_linear(x, layer, **{**kw, "pdl": False})
        return saved.linear(x, layer, **kw)

    return kernels_replaced(runner, linear=linear)


def projection_bytes(runner, which: str) -> int:
    return sum(layer.weight.nbytes for layer in projection_layers(runner, which))


def norm_fold(runner, pick, peel: bool):
    """The RMSNorm folded into the GEMV after it for the projections `pick(layer)` accepts, the others' norms
    launched apart. peel: as kernels/gemv.py folds (small_batch_norm_linear: the first K step always peeled);
    else with the plain GEMV's tiles, which peel only at K <= 3072 (how the seventh session tried the 8B)."""
    pdl = runner.model.kernels.name.endswith("pdl")

    def folded(x, residual, weight, eps, layer):
        if not pick(layer):
            return None
        if peel:
            return gemv.small_batch_norm_linear(x, residual, weight, eps, layer, pdl=pdl)
        tiles = gemv._layer_tiles(x, layer, pdl)
        if tiles is None or x.shape[1] > gemv.NORM_FOLD_MAX_K:
            return None
        return gemv.gemv_norm_linear(x, residual, weight, eps, layer.weight, layer.bias, tiles, pdl=pdl)

    return kernels_replaced(runner, norm_linear=folded)


def variants(runner):
    def silu_alias(gate_up, **_):
        return gate_up[:, : gate_up.shape[1] // 2]

    qkv = {id(layer.self_attn.qkv_proj) for layer in runner.model.model.layers}
    split_counters = SplitCounters()  # one for the run: graphs captured with it replay until the run ends
    return {
        "default": contextlib.nullcontext,
        "no-attention": lambda: no_attention(runner),
        "no-norms": lambda: kernels_replaced(runner, rms_norm=lambda x, w, eps, **_: x,
                                             fused_add_rms_norm=lambda x, r, w, eps, **_: (x, r), norm_linear=None),
        "no-silu": lambda: kernels_replaced(runner, silu_and_mul=silu_alias),
        **{f"no-{which}": (lambda which=which: no_projection(runner, which)) for which in PROJECTIONS},
        **{f"pdl-off-{which}": (lambda which=which: projection_without_pdl(runner, which)) for which in PROJECTIONS},
        # The norms launched apart from the projections after them (kernels/gemv.py's fold off).
        "no-norm-fold": lambda: kernels_replaced(runner, norm_linear=None),
        "fold-glu": glu_fold,
        "no-glu-fold": lambda: glu_fold(False),
        # The fold for qkv_proj alone or for every projection it can take, with the first K step peeled (as
        # kernels/gemv.py folds; fold-all-peel is the default) or with the plain GEMV's tiles (no peel at K 4096).
        "fold-qkv": lambda: norm_fold(runner, lambda layer: id(layer) in qkv, peel=False),
        "fold-qkv-peel": lambda: norm_fold(runner, lambda layer: id(layer) in qkv, peel=True),
        "fold-all": lambda: norm_fold(runner, lambda layer: True, peel=False),
        "fold-all-peel": lambda: norm_fold(runner, lambda layer: True, peel=True),
        "attn-splits1": lambda: attention_tuning(runner, splits=1),
        "attn-splits4": lambda: attention_tuning(runner, splits=4),
        "attn-splits8": lambda: attention_tuning(runner, splits=8),
        "attn-splits16": lambda: attention_tuning(runner, splits=16),
        "attn-bn32": lambda: attention_tuning(runner, block_n=32),
        "attn-bn16": lambda: attention_tuning(runner, block_n=16),
        "attn-bn128": lambda: attention_tuning(runner, block_n=128),
        "attn-bn32-pps8": lambda: attention_tuning(runner, block_n=32, programs_per_sm=8),
        "attn-warps2": lambda: attention_tuning(runner, num_warps=2),
        "attn-warps8": lambda: attention_tuning(runner, num_warps=8),
        "attn-stages1": lambda: attention_tuning(runner, num_stages=1),
        # The decode attention's PDL trigger (griddepcontrol.launch_dependents) always after its K/V loop, or
        # always first thing (DecodeTuning.late_trigger_programs). (The GEMV's and few-rows kernel's trigger
        # after their K loops cost 45-284 us a step, round 9c.)
        "attn-trigger-late": lambda: attention_tuning(runner, late_trigger_programs=0),
        "attn-trigger-early": lambda: attention_tuning(runner, late_trigger_programs=1 << 30),
        "attn-pad32": lambda: merge_tile_padded(32),
        "attn-pad16": lambda: merge_tile_padded(16),
        **{f"attn-maxnreg{regs}": (lambda regs=regs: attention_maxnreg(regs)) for regs in (64, 96, 128)},
        "skinny-off": lambda: skinny_rows(None),
        # Every few-rows launch with PDL where the step uses it (skinny.keeps_pdl turns it off for the folded
        # gate_up above 8 rows): what that choice is worth.
        "skinny-pdl-on": lambda: mock.patch.object(skinny, "keeps_pdl", lambda m, glu: True),
        **{f"skinny-only-{which}": (lambda which=which: skinny_only(runner, which)) for which in PROJECTIONS},
        **{f"skinny-k{split}-{which}": (lambda which=which, split=split: skinny_split(runner, which, split,
                                                                                  split_counters))
           for which in PROJECTIONS for split in (2, 4, 8)},
        "skinny-16x256s4": lambda: skinny_rows(skinny.SkinnyTiles(16, 256, num_stages=4)),
        "skinny-16x512s3": lambda: skinny_rows(skinny.SkinnyTiles(16, 512, num_stages=3)),
        "skinny-32x256s3": lambda: skinny_rows(skinny.SkinnyTiles(32, 256, num_stages=3)),
        "gemv-whole-k": lambda: gemv_tiles(whole_k),
        "gemv-bn-half": lambda: gemv_tiles(lambda t, m, n, k: dataclasses.replace(t, block_n=max(1, t.block_n // 2))),
        "gemv-bn-double": lambda: gemv_tiles(lambda t, m, n, k: dataclasses.replace(t, block_n=t.block_n * 2)),
        "gemv-warps8": lambda: gemv_tiles(lambda t, m, n, k: dataclasses.replace(t, num_warps=8)),
        "gemv-warps2": lambda: gemv_tiles(lambda t, m, n, k: dataclasses.replace(t, num_warps=2)),
        "gemv-bk512": lambda: gemv_tiles(lambda t, m, n, k: dataclasses.replace(t, block_k=512)),
        "gemv-rows2": lambda: gemv_rows(2),
        "gemv-rows2-bk512": lambda: gemv_rows(2, 512),
        "gemv-rows4-bk512": lambda: gemv_rows(4, 512),
        "gemv-rows4-bk256": lambda: gemv_rows(4, 256),
    }


@contextlib.contextmanager
def stacked(makes):
    """Several variants applied together, entered in order (a later one sees the earlier ones' replacements)."""
    with contextlib.ExitStack() as stack:
        for make in makes:
            stack.enter_context(make())
        yield


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--only", nargs="*", default=None,
                    help="name prefixes of the variants to run (default: all); A+B: the variants A and B (full names, "
                         "attn:NAME and base-attention too) applied together, e.g. fold-glu+skinny-16x512s3")
    ap.add_argument("--attn", nargs="*", default=[], metavar="NAME:FIELD=V,...",
                    help="more decode-attention tunings, e.g. s1w2:num_stages=1,num_warps=2")
    ap.add_argument("--base-tree", default=None, help="also time this source tree's decode attention (base-attention)")
    ap.add_argument("--kernel-stats", action="store_true",
                    help="at the end, registers and programs an SM of every compiled decode attention kernel")
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=args.max_model_len, enforce_eager=True,
                                  gpu_memory_utilization=args.gpu_memory_utilization))
    runner = engine.runner
    known = variants(runner)
    chosen = {name: make for name, make in known.items()
              if name == "default" or args.only is None or any(name.startswith(p) for p in args.only)}
    for name, fields in parse_attention_variants(args.attn).items():
        known[f"attn:{name}"] = chosen[f"attn:{name}"] = lambda fields=fields: attention_tuning(runner, **fields)
    if args.base_tree:
        known["base-attention"] = chosen["base-attention"] = lambda: base_tree_attention(runner, args.base_tree)
    for combo in [p for p in args.only or [] if "+" in p]:  # --attn and --base-tree variants combine too
        unknown = [part for part in combo.split("+") if part not in known]
        if unknown:
            raise SystemExit(f"--only {combo}: no variant named {', '.join(unknown)} (full names, not prefixes)")
        chosen[combo] = lambda parts=[known[part] for part in combo.split("+")]: stacked(parts)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model}: context {args.context}, table {args.max_model_len}, {args.rounds} rounds x "
          f"{args.replays} replays, ms per step (median of rounds, min-max)", flush=True)
    with torch.inference_mode():
        for bs in args.batches:
            with rows_loaded(runner, bs, args.context, gen) as batch:
                rows = batch.copy_to_device(bs)
                graphs = {}
                for name, make in chosen.items():
                    try:
                        with make():
                            graphs[name] = capture(runner.decode_step, rows)
                    except Exception as exc:  # a tuning the kernel cannot take: say so, go on
                        print(f"bs {bs:>4}  {name:16s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                logits = {}  # the step returns its logits [bs, vocab]
                for name, (graph, out) in graphs.items():
                    graph.replay()
                    torch.cuda.synchronize()
                    logits[name] = out[:bs].float().clone()
                times = {name: [] for name in graphs}
                for _ in range(args.rounds):
                    for name, (graph, _) in graphs.items():
                        times[name].append(time_replays(graph, args.replays))
                base = statistics.median(times["default"])
                for name in graphs:
                    med = statistics.median(times[name])
                    diff = ""
                    if name not in ABLATIONS:  # an ablation's step is wrong by design
                        ref = logits["default"]
                        diff = f"  rel diff {((logits[name] - ref).abs().max() / ref.abs().max()).item():.1e}"
                    if name.startswith("no-") and name[3:] in PROJECTIONS and med < base:
                        nbytes = projection_bytes(runner, name[3:])  # GB/s: bytes per us / 1e3
                        diff = f"  {nbytes / 1e6:.0f} MB: {nbytes / ((base - med) * 1e3) / 1e3:.0f} GB/s in the step"
                    print(f"bs {bs:>4}  {name:16s} {med:.4f}  ({min(times[name]):.4f}-{max(times[name]):.4f})  "
                          f"x{med / base:.3f}  {1000 * (med - base):+7.1f} us{diff}", flush=True)
                del graphs
    if args.kernel_stats:
        print_attention_kernels()


if __name__ == "__main__":
    main()
