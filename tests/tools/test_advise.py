"""`ostinato advise` on CPU: the size choice against brute force, the memory budget, the end-to-end estimate on
synthetic measurements with known answers, degenerate workloads, the @FILE round trip and the CLI with
--measurements (no GPU anywhere here)."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from ostinato.cli import main
from ostinato.config import EngineArgs, default_capture_sizes, read_cuda_graph_sizes
from ostinato.errors import ConfigError
from ostinato.tools.advise.costs import CostModel, Measurements, interpolate
from ostinato.tools.advise.estimate import advise, estimate
from ostinato.tools.advise.sizes import choose_sizes, expected_cost, padded_rows, set_memory
from ostinato.tools.advise.workload import (EngineLimits, Request, Workload, simulate, workload_from_params,
                                            workload_from_trace)

MiB = 2**20


def synthetic(max_num_seqs: int = 256, kv_blocks: int = 60_000, prefill_4k_ms: float = 30.0, grid=None,
              eager_base: float = 8.0, graph_base: float = 1.6) -> Measurements:
    """Figures shaped like a small model on a big GPU: eager pays ~8 ms of launches, a replay 1.6 ms, both
    grow with batch and context; the largest graph carries the pool."""
    sizes = tuple(grid or default_capture_sizes(max_num_seqs))
    ctxs = (256, 1024, 4096)
    eager = tuple(tuple(eager_base + 0.004 * b + 2e-6 * b * c for b in sizes) for c in ctxs)
    graph = tuple(tuple(graph_base + 0.012 * b + 2e-6 * b * c for b in sizes) for c in ctxs)
    inc = {s: 3 * MiB for s in sizes}
    inc[sizes[-1]] = 60 * MiB + sizes[-1] * MiB
    first = {s: 60 * MiB + s * MiB for s in sizes}
    return Measurements("synthetic-model", "synthetic GPU", "bfloat16", "test", sizes, ctxs, eager, graph,
                        (64, 256, 1024, 4096), (8.5, 9.0, 12.0, prefill_4k_ms), first, inc, 2 * MiB, 16, 8192,
                        max_num_seqs, 8192, kv_blocks, default_capture_sizes(max_num_seqs))


# ---- the size choice --------------------------------------------------------------------------------------
def brute_force(weights, g, e, first, inc, budget, universe):
    best = None
    for k in range(len(universe) + 1):
        for sizes in itertools.combinations(universe, k):
            if set_memory(sizes, first, inc) <= budget:
                cost = expected_cost(weights, sizes, g, e)
                best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(120))
def test_choice_is_the_brute_force_optimum(seed):
    """Random small cases with monotone costs; brute force tries every subset of 1..N, the DP only the
    observed batch sizes, so this also checks that restricting candidates loses nothing."""
    r = random.Random(seed)
    n_max = r.randint(1, 8)
    weights = {n: r.choice([0, 0, 1, 2, 7]) for n in range(1, n_max + 1)}
    base, slope, eager_base = r.uniform(1, 3), r.uniform(0, 0.6), r.uniform(1.2, 6)
    fb, ib = r.randint(1, 6), r.randint(0, 3)

    def g(s): return base + slope * s
    def e(n): return eager_base + slope * n
    def first(s): return fb + s
    def inc(s): return ib + s // 3

    budget = r.randint(0, 30)
    choice = choose_sizes(weights, g, e, first, inc, budget)
    assert choice.expected_cost == pytest.approx(brute_force(weights, g, e, first, inc, budget,
                                                             range(1, n_max + 1)), abs=1e-9)
    assert choice.memory_bytes == set_memory(choice.sizes, first, inc) <= budget
    assert choice.expected_cost == pytest.approx(expected_cost(weights, choice.sizes, g, e))


def test_known_optimum_and_the_budget_that_removes_a_graph():
    weights = {1: 10, 3: 10}

    def g(s): return float(s)
    def e(n): return 100.0
    def first(s): return 5
    def inc(s): return 5

    assert choose_sizes(weights, g, e, first, inc, 10).sizes == (1, 3)  # 10*1 + 10*3 = 40
    assert choose_sizes(weights, g, e, first, inc, 9).sizes == (3,)  # one graph only: 60 < 10*1 + 10*100
    assert choose_sizes(weights, g, e, first, inc, 4).sizes == ()  # nothing fits
    # eager cheaper than any replay: no graphs even with room for all
    assert choose_sizes(weights, lambda s: 200.0, e, first, inc, 100).sizes == ()


@pytest.mark.parametrize("seed", range(5))
def test_large_budgets_are_respected_despite_rounding(seed):
    """Budgets far above max_units bytes are counted in rounded-up units: the result must still fit."""
    r = random.Random(seed)
    weights = {n: r.randint(0, 50) for n in range(1, 200)}
    budget = r.randint(62 * MiB, 600 * MiB)  # the smallest graph alone takes 61 MiB
    m = CostModel(synthetic())

    def g(s): return m.graph_ms(s, 1024)
    def e(n): return m.eager_ms(n, 1024)

    choice = choose_sizes(weights, g, e, m.first_bytes, m.incremental_bytes, budget)
    assert set_memory(choice.sizes, m.first_bytes, m.incremental_bytes) <= budget
    assert choice.sizes, "every budget here has room for at least one graph, and graphs are cheaper"


# ---- the estimate -----------------------------------------------------------------------------------------
def test_one_request_end_to_end_time_is_prefill_plus_its_decode_steps():
    m = synthetic()
    cost = CostModel(m)
    w = workload_from_params("100", "11", 1, None, None)  # prefill gives token 1, then 10 decode steps at bs 1
    for sizes in ((), (1, 2, 4), (4,)):
        est = estimate(cost, w, "x", sizes)
        assert est.steps_by_batch == {1: 10}
        step = cost.step_ms(sizes, 1, 100)  # context grows 101..110: the model is linear in context
        mean_step = sum(cost.step_ms(sizes, 1, c) for c in range(101, 111)) / 10
        assert est.total_s == pytest.approx((cost.prefill_ms(100) + 10 * mean_step) / 1e3)
        assert est.output_tokens == 11
        assert est.padded_rows == (3 * 10 if sizes == (4,) else 0)
        assert step > 0


def test_graph_memory_lowers_concurrency_when_the_cache_is_the_limit():
    """Eight requests of 160 tokens need 10 blocks each. With 80 blocks all eight run at once; graphs of a
    few MiB (blocks are 2 MiB) take blocks back, so fewer run together and there are more decode steps."""
    m = synthetic(kv_blocks=80)
    cost = CostModel(m)
    w = workload_from_params("60", "100", 8, None, None)
    eager = estimate(cost, w, "eager", ())
    graphs = estimate(cost, w, "graphs", (1, 2, 4, 8))
    assert max(eager.steps_by_batch) == 8
    assert graphs.kv_blocks == 80 - -(-cost.graph_bytes((1, 2, 4, 8)) // m.block_bytes) < 80
    assert max(graphs.steps_by_batch) == graphs.kv_blocks // 10 < 8
    assert graphs.decode_steps > eager.decode_steps


def test_chat_gains_more_than_summarization():
    """Long prompts and short outputs spend their time in eager prefill, so graphs gain less there."""
    cost = CostModel(synthetic(prefill_4k_ms=60.0))
    chat = advise(cost, workload_from_params("50:500", "200:1000", 64, None, None))
    summ = advise(cost, workload_from_params("4000", "64", 64, None, None))
    assert chat.enable and chat.gain > 0.5
    assert summ.gain < chat.gain / 3
    assert summ.eager.prefill_s / summ.eager.total_s > 0.5 > chat.eager.prefill_s / chat.eager.total_s
    strict = advise(cost, workload_from_params("4000", "64", 64, None, None), min_gain=summ.gain + 0.01)
    assert not strict.enable and "OFF" in strict.verdict


# ---- degenerate workloads ---------------------------------------------------------------------------------
def test_all_batch_one_captures_size_one_only():
    cost = CostModel(synthetic())
    a = advise(cost, workload_from_params("50:100", "20:40", 30, None, 1))
    assert set(a.default.steps_by_batch) == {1}
    assert a.recommended.sizes == (1,)
    assert a.recommended.graph_bytes < a.default.graph_bytes
    assert a.recommended.padded_rows == 0 and a.enable


def test_batches_above_the_largest_measured_size():
    """max_num_seqs 512 while the default sizes stop at 256: every step at 400 runs eager with the defaults;
    the choice captures 400 (its cost interpolated) when the budget has room, and nothing when it has none."""
    m = synthetic(max_num_seqs=512, kv_blocks=10**6, grid=default_capture_sizes(256))
    m = Measurements(**{**m.__dict__, "default_sizes": default_capture_sizes(256)})
    cost = CostModel(m)
    w = Workload("hist", batch_histogram={400: 100.0})
    a = advise(cost, w, budget_bytes=1 << 30)  # the default budget (the defaults' 418 MiB) < first(400)
    assert a.default.eager_steps == 100 and a.eager.eager_steps == 100
    assert a.recommended.sizes == (400,) and a.recommended.eager_steps == 0
    assert a.recommended.graph_bytes <= a.budget_bytes
    assert advise(cost, w).recommended.sizes == ()
    none = advise(cost, w, budget_bytes=0)
    assert none.recommended.sizes == () and not none.enable and "OFF" in none.verdict


def test_prefill_only_workload_recommends_no_graphs():
    a = advise(CostModel(synthetic()), workload_from_params("300:900", "1", 40, None, None))
    assert a.default.decode_steps == 0 and a.recommended.sizes == ()
    assert not a.enable and a.gain == pytest.approx(0.0)
    assert a.eager.output_tokens == 40


def test_simulation_conserves_tokens_and_reports_truncation():
    w = Workload("t", (Request(0.0, 500, 600), Request(0.1, 10, 5)), None, {}, 255, 302, 2)
    r = simulate(w, EngineLimits(4, 1000, 16, 1024, 1024), lambda n, c: 1.0, lambda L: 2.0)
    assert r.truncated == 1 and r.output_tokens == (1024 - 500) + 5


# ---- inputs, files and the command line -------------------------------------------------------------------
def test_interpolate_and_extrapolate():
    assert interpolate([1, 3], [10, 30], 2) == 20
    assert interpolate([1, 3], [10, 30], 5) == 50
    assert interpolate([1, 3], [10, 30], -100) == 0.0
    assert interpolate([7], [4.0], 100) == 4.0


def test_measurements_json_round_trip_and_bad_files(tmp_path):
    m = synthetic()
    m.save(tmp_path / "m.json")
    assert Measurements.load(tmp_path / "m.json") == m
    (tmp_path / "bad.json").write_text(json.dumps({"format": "ostinato-advise-measurements", "model": "x"}))
    with pytest.raises(ConfigError, match="incomplete"):
        Measurements.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read"):
        Measurements.load(tmp_path / "missing.json")


def test_trace_workload(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_tokens": 12, "output_len": 3, "arrival": 5}\n\n{"prompt_len": 7, "max_tokens": 2, '
                    '"arrival_s": 4.5}\n')
    w = workload_from_trace(path)
    assert w.requests == (Request(0.0, 7, 2), Request(0.5, 12, 3))
    path.write_text('{"output_len": 3}\n')
    with pytest.raises(ConfigError, match="line 1 lacks 'prompt_len'"):
        workload_from_trace(path)


def test_sizes_file_round_trip(tmp_path):
    path = tmp_path / "sizes.txt"
    path.write_text("# from advise\n1 2, 8\n24  # the busiest\n")
    assert read_cuda_graph_sizes(f"@{path}") == (1, 2, 8, 24)
    assert EngineArgs(model="m", cuda_graph_sizes=f"@{path}").cuda_graph_sizes == (1, 2, 8, 24)
    path.write_text('{"cuda_graph_sizes": [4, 16]}')
    assert read_cuda_graph_sizes(f"@{path}") == (4, 16)
    assert read_cuda_graph_sizes("1,2 4") == (1, 2, 4)
    path.write_text("1 two 3")
    with pytest.raises(ConfigError, match="integers"):
        read_cuda_graph_sizes(f"@{path}")
    with pytest.raises(ConfigError, match="cannot read"):
        read_cuda_graph_sizes(f"@{tmp_path / 'nope.txt'}")


def test_cli_with_measurements_writes_a_sizes_file_the_engine_flags_accept(tmp_path, capsys):
    synthetic().save(tmp_path / "m.json")
    out = tmp_path / "out"
    rc = main(["advise", "some-model", "--measurements", str(tmp_path / "m.json"), "--prompt-len", "50:500",
               "--output-len", "200:1000", "--num-requests", "64", "--concurrency", "20", "--out", str(out),
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    text = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["enable_graphs"] and report["recommended_sizes"]
    assert f"--cuda-graph-sizes @{out / 'cuda_graph_sizes.txt'}" in text and "verdict: ENABLE" in text
    assert {p.name for p in out.iterdir()} == {"cuda_graph_sizes.txt", "speedup.png", "graph_memory.png",
                                              "padding.png"}
    # the file goes through the engine flags' own parser, as `ostinato serve ... --cuda-graph-sizes @FILE`
    from ostinato.cli_args import add_engine_args
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["m", "--cuda-graph-sizes", f"@{out / 'cuda_graph_sizes.txt'}"])
    assert list(ns.cuda_graph_sizes) == report["recommended_sizes"]
    # padding of the chosen sizes is no worse than the defaults' on the same distribution
    rec, default = report["estimates"]["recommended"], report["estimates"]["default sizes"]
    assert rec["total_s"] <= default["total_s"] * 1.001


def test_cli_without_a_gpu_says_what_to_do(tmp_path, capsys):
    rc = main(["advise", str(tmp_path), "--prompt-len", "10", "--output-len", "5", "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--measurements" in err


def test_cli_needs_exactly_one_workload(tmp_path, capsys):
    synthetic().save(tmp_path / "m.json")
    assert main(["advise", "x", "--measurements", str(tmp_path / "m.json"), "--out", str(tmp_path)]) == 2
    assert "give one workload" in capsys.readouterr().err


def test_padded_rows_counts():
    assert padded_rows({1: 2, 3: 1, 9: 4}, (2, 4)) == (1 * 2 + 1 * 1, 1 * 2 + 3 * 1, 4)


def test_host_overhead_dilutes_the_gain():
    """Host work per step is paid with and without graphs: the same workload gains less with it counted."""
    m = synthetic()
    w = workload_from_params("100:200", "100:300", 32, None, 8)
    bare = advise(CostModel(m), w)
    with_host = advise(CostModel(m, host_ms=1.0, host_ms_per_seq=0.02), w)
    assert 0 < with_host.gain < bare.gain
    est = estimate(CostModel(m, host_ms=1.0), workload_from_params("100", "11", 1, None, None), "x", ())
    assert est.decode_s == pytest.approx(estimate(CostModel(m), workload_from_params("100", "11", 1, None, None),
                                                  "x", ()).decode_s + 10 * 1.0 / 1e3)


def test_simulation_matches_the_real_scheduler_when_kv_is_plentiful():
    """The simulation's decode batch sizes are the real Scheduler's (pure Python, driven with dummy tokens)
    on the same requests, when the cache never limits: same prefill-first policy, seats and token budget."""
    from ostinato.config import CacheConfig, SchedulerConfig
    from ostinato.contract import DecodeRows
    from ostinato.engine.request import Sequence, SequenceStatus
    from ostinato.engine.scheduler import Scheduler
    from ostinato.sampling_params import SamplingParams

    w = workload_from_params("5:120", "1:40", 40, None, None, seed=3)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
                      CacheConfig(block_size=16, num_blocks=10_000))
    seqs = {}
    for i, r in enumerate(w.requests):
        seqs[i] = Sequence(i, str(i), [1] * r.prompt_len, SamplingParams(max_tokens=r.output_len))
        sched.add(seqs[i])
    real: dict[int, int] = {}
    prefills = 0
    rows = DecodeRows()
    for _ in range(100_000):
        out = sched.schedule()
        if out.kind == "idle":
            break
        prefills += bool(out.seqs)
        for seq_id in out.left:  # the runner's decode rows, kept from the scheduler's changes
            rows.remove(seq_id)
        computed = list(rows.seq_ids)
        if computed:
            real[len(computed)] = real.get(len(computed), 0) + 1
        for s in out.seqs:
            if s.samples:
                rows.add(s.seq_id)
                computed.append(s.seq_id)
        sched.update(computed, [7] * len(computed))
        for seq_id in computed:
            if len(seqs[seq_id].output_token_ids) >= w.requests[seq_id].output_len:
                sched.finish(seq_id, SequenceStatus.FINISHED_LENGTH)
    sim = simulate(w, EngineLimits(8, 10_000, 16, 256, 256), lambda n, c: 1.0, lambda L: 1.0)
    assert dict(sim.steps_by_batch) == real and len(real) > 3
    assert sim.prefill_steps == prefills


def test_a_set_that_fits_the_budget_exactly_is_chosen():
    """Seen on the H200: the first graph took 113,246,208 bytes and the budget was exactly that (the default
    sizes' memory); costs rounded up to units and the budget rounded down left no set, so advise said OFF."""
    first = 113_246_208
    choice = choose_sizes({1: 5.0, 2: 3.0, 7: 1.0}, lambda s: 0.1 + 0.01 * s, lambda n: 1.7,
                          lambda s: first, lambda s: 0, first)
    assert choice.sizes == (1, 2, 7) and choice.memory_bytes == first
    assert not choose_sizes({1: 5.0}, lambda s: 0.1, lambda n: 1.7, lambda s: first, lambda s: 0, first - 1).sizes
