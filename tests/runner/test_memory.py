"""KV-cache and CUDA-graph memory arithmetic, with made-up device figures."""

import pytest

from ostinato.errors import ConfigError, OutOfKVCacheError
from ostinato.runner.memory import (
    GiB,
    MiB,
    capture_oom_message,
    graph_memory_report,
    kv_block_bytes,
    plan_kv_cache,
)

FLAGS = ("--gpu-memory-utilization", "--max-cuda-graph-size", "--cuda-graph-sizes", "--enforce-eager")
BLOCK = 2 * MiB  # Llama-3.1-8B, bf16, 16 tokens a block (checked below)


def plan(**overrides):
    args = dict(total_bytes=80 * GiB, gpu_memory_utilization=0.5, weights_bytes=16 * GiB,
                activation_peak_bytes=2 * GiB, graph_estimate_bytes=1 * GiB, block_bytes=BLOCK, block_size=16,
                max_model_len=8192)
    args.update(overrides)
    return plan_kv_cache(**args)


def test_kv_block_bytes_counts_k_and_v_of_every_layer():
    # 2 (K, V) x 32 layers x 16 tokens x 8 kv heads x 128 dims x 2 bytes
    assert kv_block_bytes(32, 8, 128, 16, 2) == 2 * MiB
    assert kv_block_bytes(1, 1, 1, 1, 4) == 8
    with pytest.raises(ValueError, match="block_size"):
        kv_block_bytes(32, 8, 128, 0, 2)


def test_plan_subtracts_weights_activations_and_graphs():
    p = plan()
    assert p.budget_bytes == 40 * GiB
    assert p.kv_bytes == 21 * GiB
    assert p.num_blocks == 21 * 512 - 1  # one block reserved for padded rows
    assert p.reserved_blocks == 1 and p.pool_bytes == 21 * GiB
    assert p.graph_blocks == 512  # 1 GiB of graphs = 512 blocks of 2 MiB
    assert p.num_tokens == p.num_blocks * 16
    assert p.blocks_per_seq == 512 and p.max_full_length_seqs == 20
    assert "CUDA graphs 1.00 GiB (= 512 KV blocks)" in p.summary()


def test_plan_without_graphs_or_reserved_blocks():
    p = plan(graph_estimate_bytes=0, reserved_blocks=0)
    assert p.graph_blocks == 0 and p.num_blocks == 22 * 512


def test_no_room_because_of_graphs_names_every_flag_and_what_eager_would_give():
    # 40 GiB budget - 39.5 GiB of weights and activations leaves 0.5 GiB; graphs want 1 GiB.
    with pytest.raises(OutOfKVCacheError) as e:
        plan(weights_bytes=37 * GiB + GiB // 2, activation_peak_bytes=2 * GiB)
    msg = str(e.value)
    assert all(flag in msg for flag in FLAGS)
    assert "without CUDA graphs (--enforce-eager) the cache would get 255 blocks" in msg


def test_no_room_even_without_graphs_says_so():
    with pytest.raises(OutOfKVCacheError, match="even without CUDA graphs") as e:
        plan(weights_bytes=45 * GiB)
    assert all(flag in str(e.value) for flag in FLAGS)


def test_a_single_leftover_block_is_the_reserved_one():
    # Exactly one block of room: the scratch block takes it, none is left to schedule.
    with pytest.raises(OutOfKVCacheError, match="no room"):
        plan(weights_bytes=40 * GiB - 2 * GiB - 1 * GiB - BLOCK)


def test_less_than_one_sequence_names_the_largest_max_model_len_that_fits():
    # 40 GiB - 16 - 2 - 1 = 21 GiB = 10751 usable blocks = 172016 tokens.
    with pytest.raises(OutOfKVCacheError) as e:
        plan(max_model_len=200_000)
    msg = str(e.value)
    assert "--max-model-len to 172016" in msg
    assert all(flag in msg for flag in FLAGS)
    # The length it names fits exactly; one token more does not.
    fitted = plan(max_model_len=172016)
    assert fitted.num_blocks == fitted.blocks_per_seq and fitted.max_full_length_seqs == 1
    with pytest.raises(OutOfKVCacheError):
        plan(max_model_len=172017)


def test_invalid_figures():
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        plan(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="weights_bytes"):
        plan(weights_bytes=-1)
    with pytest.raises(ValueError, match="block_bytes"):
        plan(block_bytes=0)


def test_graph_memory_report_table_and_cost_line():
    text = graph_memory_report({1: -5, 8: 3 * MiB, 2: 0, 4: 1 * MiB}, estimate_bytes=8 * MiB,
                               block_bytes=BLOCK, block_size=16, max_model_len=64)
    lines = text.splitlines()
    sizes = [int(line.split()[0]) for line in lines[2:6]]
    assert sizes == [8, 4, 2, 1]  # capture order
    assert lines[2].split()[1] == "3.0" and lines[5].split()[1] == "0.0"  # a negative reading counts as 0
    assert lines[6].split() == ["total", "4.0"]
    assert "estimate 8.0 MiB, actual 4.0 MiB (50% of the estimate)" in text
    assert lines[-1] == ("CUDA graphs use 0.004 GiB = 2 KV blocks = 32 tokens of context "
                         "(0.50 sequences at max_model_len 64)")


def test_graph_memory_report_rounds_blocks_up_and_handles_no_graphs():
    text = graph_memory_report({8: BLOCK + 1}, estimate_bytes=0, block_bytes=BLOCK, block_size=16,
                               max_model_len=16)
    assert "no estimate" in text and "= 2 KV blocks = 32 tokens" in text and "(2.00 sequences" in text
    assert "none captured" in graph_memory_report({}, 0, BLOCK, 16, 64)


def test_capture_oom_message():
    msg = capture_oom_message(128, "OutOfMemoryError: CUDA out of memory")
    assert "batch size 128" in msg and "CUDA out of memory" in msg
    assert all(flag in msg for flag in FLAGS)
