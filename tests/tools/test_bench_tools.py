"""The CPU-checkable parts of `bench kernels | peers | throughput` and their plots (the GPU runs are commands)."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

from ostinato import cli
from ostinato.tools.bench import plots as bench_plots
from ostinato.tools.bench.ceilings import Ceilings, engine_ceilings, measure_ceilings
from ostinato.tools.bench.engine import workload_floor_seconds
from ostinato.tools.bench.kernels import OTHER, class_bytes, classify, report_lines, summarize

QWEN3_06B = types.SimpleNamespace(num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, hidden_size=1024,
                                  intermediate_size=3072, vocab_size=151936)


@pytest.mark.parametrize("name,cls", [
    ("_decode_split_kernel", "attention"),
    ("_write_kv_kernel", "kv write"), ("_gemv_kernel", "projections"),
    ("nvjet_tst_64x8_64x16_2x1_v_bz_splitK_TNT", "projections"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)",
     "projections"),
    ("_rms_norm_kernel", "norms"), ("_qk_norm_rope_kernel", "q/k norm + rope"),
    ("_silu_and_mul_kernel", "silu * up"),
    ("_sample_chunk_kernel", "sampling"), ("_sample_pick_kernel", "sampling"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", OTHER),
])
def test_kernel_names_fall_in_their_class(name, cls):
    assert classify(name) == cls


# Triton kernels that a decode step may launch and that belong to no class of their own; bench kernels profiles
# decode steps only, so the prefill kernels fall there too.
UNCLASSED_KERNELS = {"_unpack_kernel", "_prefill_kernel", "_prefill_split_kernel", "_prefill_reduce_kernel"}


def test_every_triton_kernel_of_the_package_has_a_class():
    """A new kernel whose name no class knows would count as 'other' in `bench kernels` (the few-rows
    projection kernel did: 751 us of Qwen3-0.6B's batch-16 step reported as other)."""
    src = Path(__file__).resolve().parents[2] / "src" / "ostinato"
    names = {m for f in src.rglob("*.py") for m in re.findall(r"^def (_\w+_kernel)\(", f.read_text(), re.M)}
    assert "_gemv_kernel" in names and "_skinny_kernel" in names  # the scan finds the package's kernels
    unclassed = sorted(n for n in names - UNCLASSED_KERNELS if classify(n) == OTHER)
    assert not unclassed, f"add these kernels to bench_kernels.KERNEL_CLASSES (or to UNCLASSED_KERNELS): {unclassed}"


def test_class_bytes_count_weights_as_held_and_kv():
    nbytes = class_bytes(QWEN3_06B, 2, batch=64, context=512, weights_read=1_190_000_000)
    # 28 layers x 8 kv heads x 128 x 2 (K and V) x 2 bytes = 114688 bytes per token, 513 tokens per row.
    assert nbytes["attention"] == 64 * 513 * 114688
    assert nbytes["kv write"] == 64 * 114688
    # The projections' floor is what the model holds (FP8 or GGUF blocks), not the shapes at the model's dtype.
    assert nbytes["projections"] == 1_190_000_000


def test_summary_shares_and_gap():
    kernels = {"_decode_split_kernel": {"us": 30.0, "calls": 28}, "_gemv_kernel": {"us": 50.0, "calls": 56},
               "nvjet_x": {"us": 20.0, "calls": 30}, "memcpy": {"us": 5.0, "calls": 1}}
    s = summarize(kernels, {"attention": 3_000_000, "projections": 100_000_000}, replay_us=120.0,
                  read_bytes_per_s=2e12)
    assert s["kernel_us"] == pytest.approx(105.0) and s["gap_us"] == pytest.approx(15.0)
    proj = s["classes"]["projections"]
    assert proj["us"] == pytest.approx(70.0) and proj["kernels"] == 86
    assert proj["GBps"] == pytest.approx(100e6 / 70e-6 / 1e9)
    assert proj["hbm_share"] == pytest.approx(100e6 / 70e-6 / 2e12)  # of the bandwidth measured on the device
    assert s["classes"]["attention"]["share_of_replay"] == pytest.approx(0.25)
    assert s["classes"][OTHER]["GBps"] is None
    assert s["top_kernels"][0]["name"] == "_gemv_kernel"
    lines = report_lines(16, s, top=2)
    assert lines[0] == "batch 16: replay 120 us, kernels 105 us (115 per step), gap 15 us"
    assert lines[1].split()[0] == "projections" and "% HBM" in lines[1]  # longest class first, with its bandwidth
    assert lines[-3] == "  longest kernels:" and "_gemv_kernel" in lines[-2] and "_decode_split_kernel" in lines[-1]
    assert "longest kernels:" not in "\n".join(report_lines(16, s, top=0))


def test_plots_write_png_files(tmp_path):
    pytest.importorskip("matplotlib")
    paths = [
        bench_plots.latency_vs_batch([1, 16, 64], {"graph": [1.5, 1.9, None], "eager": [12.0, 12.1, 11.0]},
                                     [0.3, 0.5, 1.2], "t", tmp_path / "lat.png"),
        bench_plots.kernel_breakdown([1, 64], {"attention": [100.0, 900.0], "projections": [800.0, 700.0]},
                                     [1500.0, None], "t", tmp_path / "k.png"),
        bench_plots.bars({"a": 1.0, "b": None, "c": 3.0}, "ms", "t", tmp_path / "b.png", floor=0.5),
    ]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workload_floor_counts_decode_reads_and_prefill_flops():
    mc = types.SimpleNamespace(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2)
    # Two sequences, prompts 3 and 1, outputs 3 and 1: decode steps t=0,1 for the first only.
    # kv per token = 2*1*1*2*2 = 8 bytes; contexts 4 and 5 -> bytes = 2*1000 + 8*(4+5).
    ceilings = Ceilings("test device", read_bytes_per_s=3e12, matmul_flops_per_s=700e12, matmul_dtype="bfloat16")
    floor = workload_floor_seconds(mc, 1000, 2, [3, 1], [3, 1], ceilings)
    flops = 2 * 500 * 4 + 2 * 1 * 1 * 2 * (9 + 1)
    assert floor == pytest.approx((2000 + 72) / 3e12 + flops / 700e12)


def test_ceilings_are_measured_on_the_device():
    ceilings = measure_ceilings("cpu")
    assert ceilings.device == "cpu" and ceilings.matmul_dtype == "float32"
    # A read slower than 100 MB/s or faster than 10 TB/s, or a matmul outside 100 MFLOP/s - 100 TFLOP/s, is no
    # measurement of a CPU: a unit or timing slip.
    assert 1e8 < ceilings.read_bytes_per_s < 1e13 and 1e8 < ceilings.matmul_flops_per_s < 1e14
    assert "GB/s" in ceilings.describe() and "measured here" in ceilings.describe()
    assert engine_ceilings(types.SimpleNamespace(device="cpu")) is ceilings  # --device resolved, measured once


@pytest.mark.parametrize("sub", ["kernels", "peers"])
def test_bench_subcommands_are_spelled_like_the_others(sub, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", sub, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ostinato bench {sub} ")  # as the user types it


def test_the_floor_reads_an_untied_embedding_table_one_row_a_token_not_whole():
    from types import SimpleNamespace

    import torch

    from ostinato.tools.bench.decode import weights_read_per_step

    def runner(tied: bool, world_size: int = 1):
        mc = SimpleNamespace(tie_word_embeddings=tied, vocab_size=128256, hidden_size=4096)
        return SimpleNamespace(model_config=mc, weights_bytes=16_060_522_496 // world_size, dtype=torch.bfloat16,
                               tp=SimpleNamespace(world_size=world_size))

    assert weights_read_per_step(runner(True)) == 16_060_522_496
    assert weights_read_per_step(runner(False)) == 16_060_522_496 - 128256 * 4096 * 2  # 15.01 GB
    assert weights_read_per_step(runner(False, 2)) == 16_060_522_496 // 2 - 128256 * 4096
