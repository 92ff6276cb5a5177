"""Speculative decoding's flags through the command line, its counters in /metrics, and `bench spec` /
`bench verify` on a tiny checkpoint on CPU."""

import json
import logging
import random

import pytest

from ostinato import cli
from ostinato.config import EngineArgs
from ostinato.errors import ConfigError
from ostinato.server.metrics import ServerMetrics
from ostinato.tools.checkpoint import make_checkpoint

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32", "--max-model-len", "256"]
SPEC = ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-max", "2"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("spec-cli") / "ckpt", shape="tiny", family="llama", seed=1)


def test_the_flags_reach_the_engine_and_the_start_up_log(ckpt, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="ostinato"):
        assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, *SPEC, "--raw", "--prompt", "a b a b a b",
                         "--max-tokens", "6"]) == 0
    assert ("speculative decoding: ngram, up to 3 proposed tokens a step, prompt lookup over 1..2-grams; steps "
            "are synchronous (no overlapped scheduling)") in [r.getMessage() for r in caplog.records]
    last = capsys.readouterr().out.splitlines()[-1]
    assert "; speculation: acceptance " in last and "mean accepted length " in last


@pytest.mark.parametrize("kwargs, says", [
    (dict(speculative_method="ngram", tensor_parallel_size=2), "--tensor-parallel-size 1"),
    (dict(speculative_method="ngram", batch_invariant=True), "--batch-invariant"),
    (dict(speculative_method="draft"), "needs --speculative-model PATH"),
    (dict(speculative_method="medusa"), "must be one of ngram, draft"),
    (dict(num_speculative_tokens=3), "need --speculative-method"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "--num-speculative-tokens must be"),
    (dict(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "1 <= min <= max"),
    (dict(speculative_method="ngram", speculative_model="/x"), "drop it"),
])
def test_what_speculation_cannot_serve_is_refused_naming_the_flag(kwargs, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        EngineArgs(model="m", **kwargs)


def test_a_bad_flag_is_a_clear_command_line_error(ckpt, capsys):
    assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--speculative-method", "ngram",
                     "--num-speculative-tokens", "99", "--prompt", "x"]) == 2
    assert "--num-speculative-tokens must be an integer in [1, 16]" in capsys.readouterr().err


def test_bench_spec_and_verify_report_their_figures(ckpt, tmp_path, capsys):
    spec_json, verify_json = tmp_path / "spec.json", tmp_path / "verify.json"
    assert cli.main(["bench", "spec", str(ckpt), *ENGINE_FLAGS, *SPEC, "--batch-sizes", "1,2", "--max-tokens", "6",
                     "--output-json", str(spec_json)]) == 0
    rows = json.loads(spec_json.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and [len(r["token_ids"]) for r in rows] == [1, 2]
    assert all(r["output_tokens"] == sum(map(len, r["token_ids"])) and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["verify_steps_by_path"]["prefill"] > 0 for r in rows)  # CPU: no decode graphs to replay
    assert cli.main(["bench", "verify", str(ckpt), *ENGINE_FLAGS, *SPEC, "--context", "8", "--max-k", "2",
                     "--iters", "1", "--output-json", str(verify_json)]) == 0
    result = json.loads(verify_json.read_text())
    assert [r["k"] for r in result["rows"]] == [0, 1, 2] and result["decode_step_ms"] > 0
    assert all(r["steps_by_path"] == {"decode graph": 0, "prefill": 11} for r in result["rows"])  # 1 + 10 warm-up
    assert cli.main(["bench", "verify", str(ckpt), *ENGINE_FLAGS, "--iters", "1"]) == 2  # no speculation: refused
    assert "add --speculative-method ngram" in capsys.readouterr().err


def test_bench_verify_profiles_each_phase_of_the_verify_step_and_restores_the_verifier(ckpt, tmp_path, capsys):
    from ostinato.engine.llm import LLM
    from ostinato.tools.bench.spec import verify_step
    from ostinato.tools.bench.verify_profile import DECODE_GRAPH_LABELS, HOST_LABELS, profile_verify

    verify_json = tmp_path / "verify.json"
    assert cli.main(["bench", "verify", str(ckpt), *ENGINE_FLAGS, *SPEC, "--context", "8", "--max-k", "0",
                     "--iters", "2", "--profile-k", "2", "--output-json", str(verify_json)]) == 0
    host_us = json.loads(verify_json.read_text())["profile"]["host_us"]
    # On CPU (no decode graphs) every verify step takes the prefill path.
    assert set(host_us) == set(HOST_LABELS) - set(DECODE_GRAPH_LABELS) and all(us > 0 for us in host_us.values())
    assert host_us["verify: step"] > host_us["verify: forward"] + host_us["verify: sampler"]
    assert "verify: settings rows" in capsys.readouterr().out
    llm = LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=256,
              speculative_method="ngram")
    verifier = llm.engine.runner.verifier
    sampler, hidden = verifier.sampler, verifier.hidden
    profile_verify(verifier, verify_step(llm.engine.runner, 1, 8, 2, random.Random(0)), 1)
    assert verifier.sampler is sampler and verifier.hidden == hidden and "hidden" not in verifier.__dict__


def test_metrics_carry_the_speculation_counters(ckpt):
    from ostinato import LLM, SamplingParams

    llm = LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=256,
              speculative_method="ngram")
    llm.generate([[1, 2, 3, 1, 2, 3, 1, 2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    st = llm.engine.stats()
    assert st.spec_decode_draft_tokens > 0
    text = ServerMetrics("m").render(st)[0].decode()
    assert f'ostinato:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(st.spec_decode_draft_tokens)}' \
        in text
    assert 'ostinato:spec_decode_num_accepted_tokens_total{model_name="m"}' in text
    assert 'ostinato:spec_decode_num_drafts_total{model_name="m"}' in text


def test_bench_spec_forces_a_drafts_acceptance_and_keeps_the_output(tmp_path):
    """--draft-acceptance P: the draft (another seed's checkpoint, almost never right by itself) agrees with the
    model with probability P per proposal, so the acceptance follows P, and the output is the greedy output
    at every P."""
    draft = make_checkpoint(tmp_path / "draft", shape="tiny", family="llama", seed=2)
    target = make_checkpoint(tmp_path / "target", shape="tiny", family="llama", seed=1)
    out = tmp_path / "spec.json"
    assert cli.main(["bench", "spec", str(target), *ENGINE_FLAGS, "--speculative-method", "draft",
                     "--speculative-model", str(draft), "--num-speculative-tokens", "3", "--draft-acceptance",
                     "0,0.7,1", "--batch-sizes", "2", "--max-tokens", "40", "--output-json", str(out)]) == 0
    runs = {r["draft_acceptance"]: r for r in json.loads(out.read_text())["rows"]}
    assert runs[0.0]["acceptance_rate"] == 0.0 and runs[1.0]["acceptance_rate"] == 1.0
    # Three proposals, each agreeing with probability 0.7: 0.7 + 0.49 + 0.343 accepted of 3 on average.
    assert runs[0.7]["acceptance_rate"] == pytest.approx((0.7 + 0.49 + 0.343) / 3, abs=0.15)
    assert runs[0.0]["token_ids"] == runs[0.7]["token_ids"] == runs[1.0]["token_ids"]
    assert cli.main(["bench", "spec", str(target), *ENGINE_FLAGS, *SPEC, "--draft-acceptance", "0.5"]) == 2
