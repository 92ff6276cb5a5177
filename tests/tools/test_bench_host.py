"""`ostinato bench host` runs end to end at small sizes (a smoke test: no timing is asserted, the machine is
shared), and its DELTA step is what the server's engine core does: the step's records, pickled in one message."""

from __future__ import annotations

import json
import pickle

from ostinato import cli
from ostinato.tools.bench import host


def test_bench_host_runs_at_small_sizes_and_reports_both_output_kinds(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert cli.main(["bench", "host", "--batch-sizes", "2,4", "--contexts", "8", "--steps", "3", "--repeats", "1",
                     "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(2, 8), (4, 8)]
    for row in rows:
        for kind in ("final_only", "delta"):
            assert row[kind]["engine_us"] >= row[kind]["core_us"] > 0
    assert capsys.readouterr().out.count("delta: engine step") == 2


def test_bench_host_times_speculative_steps_through_the_verify_path(tmp_path, monkeypatch):
    from ostinato.runner.spec_verify import SpecVerifier

    launched, paths = [], []
    launch = SpecVerifier.launch

    def counted(self, out):
        launched.append(out)
        pending = launch(self, out)
        paths.append(dict(self.steps_by_path))
        return pending

    monkeypatch.setattr(SpecVerifier, "launch", counted)
    out = tmp_path / "host.json"
    assert cli.main(["bench", "host", "--batch-sizes", "2", "--contexts", "8", "--steps", "3", "--repeats", "1",
                     "--output-kinds", "final_only", "--num-speculative-tokens", "3",
                     "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["final_only"]["core_us"] > 0
    verify = [c for step in launched for c in step.seqs if c.verify]
    assert verify and max(len(c.token_ids) for c in verify) == 2  # the no-op's token proposed and verified
    # The steps of verify rows only take the decode-graph path, as on a GPU (its decode step the no-op, eager)
    assert paths[-1]["decode graph"] >= len(launched) - 2 and paths[-1]["decode graph"] > 0


def test_the_delta_step_is_one_pickled_message_of_every_streamed_request(tmp_path):
    from ostinato.config import EngineArgs
    from ostinato.engine.engine import LLMEngine
    from ostinato.sampling_params import RequestOutputKind, SamplingParams
    from ostinato.tools.bench import noop_forward

    engine = LLMEngine(EngineArgs(model=host._checkpoint(tmp_path, 64), device="cpu", dtype="float32",
                                  max_model_len=64, num_kv_blocks=32))
    noop_forward.install(engine)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, 7 + i], params)
    step, tokens = host._server_core_step(engine), {}
    while engine.has_unfinished():
        kind, records, _ = pickle.loads(step())
        assert kind == "step" and sorted(r[0] for r in records) in ([], ["r0", "r1", "r2"])
        for request_id, ((_, _, token_ids, _, _),), *_ in records:
            tokens.setdefault(request_id, []).extend(token_ids)
    assert {r: len(t) for r, t in tokens.items()} == {"r0": 8, "r1": 8, "r2": 8}
