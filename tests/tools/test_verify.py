"""`ostinato verify`'s verdict on launch counts: judge() with hand-made counts at the edges of the policy.

A batch of n replays the graph of the smallest captured size >= n, so every n up to and including the largest
captured size must show exactly one graph launch per step; above it, or with graphs off, none."""

import pytest

from ostinato.tools.verify import StepCount, count_launches, default_batch_sizes, judge

CAPTURED = (1, 2, 4, 8)


def verdict(bs, graph_launches, kernel_launches=0, captured=CAPTURED, graphs_enabled=True, steps=3):
    counts = [StepCount(bs, graph_launches, kernel_launches) for _ in range(steps)]
    (v,) = judge(counts, captured, graphs_enabled)
    return v


@pytest.mark.parametrize("bs", [1, 3, 4, 7, 8])
def test_every_size_up_to_the_largest_captured_one_must_replay(bs):
    v = verdict(bs, 1, kernel_launches=2)  # the sampler's kernels outside the graph are fine
    assert v.expected == "graph" and v.ok
    assert (v.steps, v.graph_launches_per_step, v.kernel_launches_per_step) == (3, 1.0, 2.0)
    miss = verdict(bs, 0, kernel_launches=200)
    assert miss.expected == "graph" and not miss.ok


def test_the_largest_captured_size_is_a_graph_size():
    assert verdict(8, 1).expected == "graph" and verdict(8, 1).ok
    assert not verdict(8, 0).ok


@pytest.mark.parametrize("bs, launches", [(1, 2), (8, 2), (4, 3)])
def test_two_or_more_graph_launches_per_step_are_rejected(bs, launches):
    v = verdict(bs, launches)
    assert v.expected == "graph" and not v.ok


def test_one_bad_step_among_good_ones_fails_the_size():
    counts = [StepCount(4, 1, 0), StepCount(4, 2, 0), StepCount(4, 1, 0)]
    (v,) = judge(counts, CAPTURED, True)
    assert not v.ok and v.graph_launches_per_step == pytest.approx(4 / 3)


def test_above_the_largest_size_or_with_graphs_off_no_graph_may_run():
    assert verdict(9, 0, 300).expected == "eager" and verdict(9, 0, 300).ok
    assert not verdict(9, 1).ok
    off = verdict(4, 0, 300, captured=(), graphs_enabled=False)
    assert off.expected == "eager" and off.ok
    assert not verdict(4, 1, captured=(), graphs_enabled=False).ok
    # Sizes captured but graphs disabled later (eager fallback): eager is what is promised.
    assert verdict(4, 0, captured=CAPTURED, graphs_enabled=False).ok
    assert not verdict(4, 1, captured=CAPTURED, graphs_enabled=False).ok


def test_verdicts_come_one_per_size_in_ascending_order():
    counts = [StepCount(9, 0, 5), StepCount(1, 1, 0), StepCount(9, 0, 5), StepCount(4, 1, 0)]
    assert [(v.batch_size, v.steps) for v in judge(counts, CAPTURED, True)] == [(1, 1), (4, 1), (9, 2)]


def test_default_batch_sizes_cover_one_padded_largest_and_above():
    assert default_batch_sizes(CAPTURED, 16) == (1, 3, 8, 9)
    assert default_batch_sizes(CAPTURED, 8) == (1, 3, 8)  # nothing above max_num_seqs
    assert default_batch_sizes((), 8) == (1, 3)


def test_launches_are_counted_per_step_and_thread():
    def ev(name, ts, dur=1, tid=1, cat="cuda_runtime"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}

    trace = [ev("ostinato.decode_step[8]", 0, 100, cat="user_annotation"),
             ev("cudaGraphLaunch", 10), ev("cudaGraphLaunch", 20), ev("cuGraphLaunch", 30),
             ev("cudaLaunchKernelExC", 40), ev("cudaLaunchKernel", 100),  # the step's last microsecond counts
             ev("cudaLaunchKernel", 101),  # after it: not counted
             {"ph": "i", "name": "cudaGraphLaunch", "ts": 50, "tid": 1}]  # not a complete event
    (count,) = count_launches(trace)
    assert (count.batch_size, count.graph_launches, count.kernel_launches) == (8, 3, 2)
    assert not judge([count], CAPTURED, True)[0].ok


def test_verify_without_a_gpu_says_so(tmp_path, capsys, monkeypatch):
    import torch

    from ostinato import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["verify", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_verify_counts_launches_per_annotated_step():
    from ostinato.tools.verify import count_launches, judge

    def ev(name, ts, dur=1, tid=1, cat="cuda_runtime"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}

    trace = [ev("ostinato.decode_step[3]", 0, 100, cat="user_annotation"), ev("cudaLaunchKernel", 10),
             ev("cudaGraphLaunch", 20), ev("cudaLaunchKernel", 150),  # outside any step: not counted
             ev("ostinato.decode_step[9]", 200, 100, cat="user_annotation"), ev("cudaLaunchKernel", 210),
             ev("cuLaunchKernel", 220), ev("cudaGraphLaunch", 230, tid=2)]  # other thread: not counted
    counts = count_launches(trace)
    assert [(c.batch_size, c.graph_launches, c.kernel_launches) for c in counts] == [(3, 1, 1), (9, 0, 2)]
    verdicts = {v.batch_size: v for v in judge(counts, (1, 2, 4, 8), graphs_enabled=True)}
    assert verdicts[3].ok and verdicts[3].expected == "graph"
    assert verdicts[9].ok and verdicts[9].expected == "eager"  # above the largest captured size
    assert not judge(counts, (), graphs_enabled=False)[0].ok  # a graph ran although graphs were off
