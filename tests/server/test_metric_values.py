"""Metric VALUES, not just names: /metrics' exposition text (ServerMetrics.render over engine.stats()) checked
against counts made independently of the engine's counters: block arithmetic done here, preemptions read
from the SchedulerOutputs the scheduler hands out, tokens counted in the RequestOutputs."""

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.sampling_params import SamplingParams
from ostinato.server.metrics import ServerMetrics
from ostinato.tools.checkpoint import make_checkpoint

BLOCK = 16
PROMPT_LEN = 20  # two blocks each


def scrape(engine) -> dict[str, float]:
    """The engine's metrics as a Prometheus client parses them: sample name (labels dropped) -> value."""
    text, _ = ServerMetrics("m").render(engine.stats())
    return {s.name: s.value for fam in text_string_to_metric_families(text.decode()) for s in fam.samples
            if "path" not in s.labels and "finished_reason" not in s.labels}


class RecordingScheduler:
    """Counts the preemptions announced in each SchedulerOutput (the scheduler's public result)."""

    def __init__(self, engine):
        self.preempted: list[int] = []
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            self.preempted.extend(out.preempted_seq_ids)
            return out

        engine.scheduler.schedule = recording_schedule


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("metrics") / "ckpt", shape="tiny", family="llama", seed=2)


def make_engine(checkpoint, num_blocks, max_num_seqs):
    return LLMEngine(EngineArgs(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=num_blocks,
                                block_size=BLOCK, max_model_len=64, max_num_seqs=max_num_seqs))


def prompt(i):
    return [10 + i] * PROMPT_LEN


def test_queue_gauges_kv_usage_and_prompt_tokens_follow_the_schedule(checkpoint):
    engine = make_engine(checkpoint, num_blocks=20, max_num_seqs=2)
    for i in range(3):
        engine.add_request(f"r{i}", prompt(i), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    m = scrape(engine)
    # Queued, not yet prefilled: nothing runs, nothing is counted as prefilled.
    assert (m["ostinato:num_requests_running"], m["ostinato:num_requests_waiting"]) == (0, 3)
    assert m["ostinato:kv_cache_usage_perc"] == 0 and m["ostinato:prompt_tokens_total"] == 0
    engine.step()  # prefill: max_num_seqs admits two
    m = scrape(engine)
    assert (m["ostinato:num_requests_running"], m["ostinato:num_requests_waiting"]) == (2, 1)
    used = 2 * math.ceil(PROMPT_LEN / BLOCK)
    assert m["ostinato:kv_cache_usage_perc"] == pytest.approx(used / 20)
    assert (m["ostinato:kv_cache_free_blocks"], m["ostinato:kv_cache_total_blocks"]) == (20 - used, 20)
    assert m["ostinato:prompt_tokens_total"] == 2 * PROMPT_LEN
    assert m["ostinato:generation_tokens_total"] == 2
    engine.abort("r2")  # aborted before its prefill: its prompt is never counted
    for _ in range(13):  # decode to 20 + 1 + 13 = 34 tokens: a third block each
        engine.step()
    m = scrape(engine)
    assert (m["ostinato:num_requests_running"], m["ostinato:num_requests_waiting"]) == (2, 0)
    assert m["ostinato:kv_cache_usage_perc"] == pytest.approx(2 * 3 / 20)
    assert m["ostinato:prompt_tokens_total"] == 2 * PROMPT_LEN
    engine.abort("r0"), engine.abort("r1")
    m = scrape(engine)
    assert m["ostinato:kv_cache_usage_perc"] == 0 and m["ostinato:num_requests_running"] == 0


def test_preemptions_and_token_counters_under_a_full_cache(checkpoint):
    # 5 blocks of 16 tokens for 3 sequences that each grow to 50 tokens (4 blocks): preemption is certain.
    engine = make_engine(checkpoint, num_blocks=5, max_num_seqs=3)
    recorder = RecordingScheduler(engine)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"p{i}", prompt(i), params)
    finished = set()
    for _ in range(1000):
        finished.update(out.request_id for out in engine.step() if out.finished)
        if not engine.has_unfinished():
            break
    assert finished == {"p0", "p1", "p2"} and len(recorder.preempted) > 0
    m = scrape(engine)
    assert m["ostinato:num_preemptions_total"] == len(recorder.preempted)
    # Recomputed prefills do not count again: the prompt tokens are those of the three requests, and with
    # ignore_eos each generated exactly max_tokens.
    assert m["ostinato:prompt_tokens_total"] == 3 * PROMPT_LEN
    assert m["ostinato:generation_tokens_total"] == 3 * params.max_tokens
    assert m["ostinato:kv_cache_usage_perc"] == 0



def test_latency_histograms_count_each_gap_in_the_bucket_of_its_bound():
    """on_step with chosen step times: each inter-token gap lands in the first bucket whose bound it does not
    exceed, and count and sum are the gaps'; TTFT and end-to-end from the same steps."""
    from ostinato.engine.outputs import CompletionOutput, RequestOutput

    def output(request_id, finished, arrival):
        completion = CompletionOutput(0, "a", [1], "length" if finished else None, None)
        return RequestOutput(request_id, None, [1], [completion], finished, arrival, None, None, 0)

    metrics = ServerMetrics("m")
    # Request a arrives at 0.0 and gets tokens at 0.5, 0.5015, 0.5045, 0.5445 (gaps of 1.5, 3 and 40 ms) and
    # ends at 1.0 (a gap of 455.5 ms); b arrives at 0.9 and gets its first token at 1.0.
    for now in (0.5, 0.5015, 0.5045, 0.5445):
        metrics.on_step([output("a", False, 0.0)], now)
    metrics.on_step([output("a", True, 0.0), output("b", False, 0.9)], 1.0)
    families = {fam.name: fam for fam in text_string_to_metric_families(metrics.render(None)[0].decode())}

    def samples(name):
        return {(s.name[len(name) + 1:], s.labels.get("le")): s.value for s in families[name].samples}

    itl = samples("ostinato:inter_token_latency_seconds")
    for le, expected in (("0.001", 0), ("0.002", 1), ("0.004", 2), ("0.025", 2), ("0.05", 3), ("0.4", 3),
                         ("0.5", 4), ("+Inf", 4)):
        assert itl[("bucket", le)] == expected, le
    assert itl[("count", None)] == 4 and itl[("sum", None)] == pytest.approx(1.0 - 0.5)
    ttft = samples("ostinato:time_to_first_token_seconds")
    assert ttft[("count", None)] == 2 and ttft[("sum", None)] == pytest.approx(0.5 + 0.1)
    assert (ttft[("bucket", "0.08")], ttft[("bucket", "0.25")], ttft[("bucket", "0.5")]) == (0, 1, 2)
    e2e = samples("ostinato:e2e_request_latency_seconds")
    assert (e2e[("count", None)], e2e[("bucket", "0.8")], e2e[("bucket", "1.0")]) == (1, 0, 1)


def test_a_value_equal_to_a_bound_counts_in_that_bound_s_bucket():
    from ostinato.server.metrics import StepHistogram

    histogram = StepHistogram("h", "a histogram", (0.25, 0.5, 1.0), "m")
    for value in (0.25, 0.5, 0.75, 2.0):
        histogram.observe(value)
    (family,) = histogram.collect()
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name == "h_bucket"}
    assert buckets == {"0.25": 1, "0.5": 2, "1.0": 3, "+Inf": 4}
