"""`ostinato generate` and `ostinato bench` through cli.main, on a tiny checkpoint on CPU.

generate's text is checked against the offline API on the same checkpoint; bench's report against figures
computed here from the checkpoint's own files (its floor is arithmetic on bytes, so it is checked exactly)."""

import json

import pytest
from safetensors.torch import load_file

from ostinato import LLM, SamplingParams, cli
from ostinato.tools.checkpoint import make_checkpoint

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16", "--max-model-len", "64"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cli") / "ckpt", shape="tiny", family="llama", seed=1)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)


def test_generate_prints_the_offline_greedy_text_per_prompt(ckpt, llm, capsys):
    prompts = ["Hello world", "The sky"]
    assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--raw", "--prompt", prompts[0], "--prompt", prompts[1],
                     "--max-tokens", "7"]) == 0
    out = capsys.readouterr().out
    expected = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7))
    for prompt, ref in zip(prompts, expected):
        c = ref.outputs[0]
        block = f"--- prompt: {prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]"
        assert block in out
    total = sum(len(r.outputs[0].token_ids) for r in expected)
    assert f"--- {total} tokens in " in out and "decode graphs: disabled (" in out


def test_generate_sends_a_prompt_through_the_chat_template_by_default(ckpt, llm, capsys):
    assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--prompt", "Hello world", "--max-tokens", "7"]) == 0
    out = capsys.readouterr().out
    ref = llm.chat([{"role": "user", "content": "Hello world"}], SamplingParams(temperature=0.0, max_tokens=7))
    raw = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=7))[0].outputs[0]
    c = ref[0].outputs[0]
    assert c.token_ids != raw.token_ids  # the template changes what the model sees: the check can fail
    assert f"'Hello world'\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]" in out


def test_generate_sampling_flags_reach_the_sampler(ckpt, llm, capsys):
    assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--raw", "--prompt", "Once", "--max-tokens", "8",
                     "--temperature", "1.0", "--top-p", "0.9", "--top-k", "50", "--sample-seed", "11"]) == 0
    ref = llm.generate(["Once"], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8,
                                                seed=11))[0].outputs[0]
    greedy = llm.generate(["Once"], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert ref.token_ids != greedy.token_ids  # the seeded draw is not the greedy path: the flags matter
    assert f"--- prompt: 'Once'\n{ref.text}\n" in capsys.readouterr().out


class _Recorder:
    """stdout that notes, for each write, how many engine steps had run by then."""

    def __init__(self, steps: list[int]):
        self.steps, self.writes = steps, []

    def write(self, text: str) -> int:
        self.writes.append((self.steps[0], text))
        return len(text)

    def flush(self) -> None:
        pass


def test_generate_streams_one_prompt_as_its_tokens_come(ckpt, llm, monkeypatch):
    from ostinato.engine.engine import LLMEngine

    steps = [0]
    real_step = LLMEngine.step

    def counted(self):
        steps[0] += 1
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", counted)
    out = _Recorder(steps)
    monkeypatch.setattr("sys.stdout", out)
    assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--raw", "--prompt", "Hello world",
                     "--max-tokens", "7"]) == 0
    monkeypatch.undo()
    ref = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=7))[0].outputs[0]
    text = "".join(t for _, t in out.writes)
    assert f"--- prompt: 'Hello world'\n{ref.text}\n[7 tokens, finish_reason=length]" in text
    # The header is out before the first step, and the text arrives over several steps, not once at the end.
    assert out.writes[0] == (0, "--- prompt: 'Hello world'")
    text_steps = {step for step, t in out.writes[2:] if t and not t.startswith(("\n[", "--- "))}
    assert len(text_steps) >= 3, out.writes


def test_generate_shows_a_progress_bar_for_many_prompts(ckpt, capsys):
    assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--raw", "--prompt", "a", "--prompt", "b",
                     "--prompt", "c", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "generate: 100%" in err and "3/3" in err


def test_generate_bad_sampling_flag_is_a_clear_error(ckpt, capsys):
    assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--prompt", "x", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: temperature must be") and "got -1" in err


def test_generate_needs_a_prompt(ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", str(ckpt)])
    assert e.value.code == 2 and "--prompt" in capsys.readouterr().err


def _weights_and_kv_bytes(ckpt) -> tuple[int, int]:
    """Weight bytes a decode step reads in float32 (an untied embedding table is read one row a token, so it is
    left out) and K+V bytes per token, from the checkpoint's files."""
    weights = sum(t.numel() for t in load_file(ckpt / "model.safetensors").values()) * 4
    cfg = json.loads((ckpt / "config.json").read_text())
    if not cfg.get("tie_word_embeddings", False):
        weights -= cfg["vocab_size"] * cfg["hidden_size"] * 4
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return weights, 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


def test_bench_runs_eager_on_cpu_and_reports_consistent_figures(ckpt, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", str(ckpt), *ENGINE_FLAGS, "--batch-sizes", "1,2", "--context", "8", "--iters", "2",
                     "--warmup", "1", "--output-json", str(out_json)]) == 0
    text = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["device"] == "cpu" and report["graph_status"].startswith("disabled (")
    assert "floors: bytes read over cpu: memory read" in text  # this machine's bandwidth, measured, not a GPU's
    rows = report["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["context"] == 8 for r in rows)
    weights, kv_per_token = _weights_and_kv_bytes(ckpt)
    for r in rows:
        assert r["graph_ms"] is None and r["graph_queued_ms"] is None  # no graphs on CPU: no figures made up
        assert r["graph_speedup_vs_eager"] is None and r["floor_ratio_queued"] is None
        assert r["eager_ms"] > 0 and r["hf_ms"] > 0
        read = weights + r["batch"] * 9 * kv_per_token  # context 8 + the new token
        assert r["floor_ms"] == pytest.approx(read / report["read_bytes_per_s"] * 1e3, rel=1e-9)
        assert r["floor_ratio"] == pytest.approx(r["floor_ms"] / r["eager_ms"])
        assert r["speedup_vs_hf"] == pytest.approx(r["hf_ms"] / r["eager_ms"])
        assert r["achieved_GBps"] == pytest.approx(read / r["eager_ms"] / 1e6)
        row = f"bs {r['batch']:>4}  graph - ms (queued -)  eager {r['eager_ms']:.3f} ms  HF {r['hf_ms']:.3f} ms"
        assert row in text


def test_bench_refuses_a_context_longer_than_the_engine_holds(ckpt, capsys):
    """--context past --max-model-len: an error naming both flags, not a tensor shape error."""
    assert cli.main(["bench", str(ckpt), *ENGINE_FLAGS, "--batch-sizes", "1", "--context", "5000", "--iters", "1",
                     "--no-hf"]) == 2
    err = capsys.readouterr().err
    assert "--context 5000" in err and "--max-model-len" in err


def test_bench_without_hf(ckpt, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert cli.main(["bench", str(ckpt), *ENGINE_FLAGS, "--batch-sizes", "1", "--context", "4", "--iters", "1",
                     "--warmup", "0", "--no-hf", "--output-json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["hf_ms"] is None and row["speedup_vs_hf"] is None and row["eager_ms"] > 0


def test_bench_throughput_repeats_without_prefix_hits(ckpt, tmp_path, capsys):
    """--repeats runs the workload again in the one process: each run is timed, and a repeat's prompts are new
    tokens of the same lengths, so the prefix cache serves none of them (the second run would be faster)."""
    out_json = tmp_path / "tput.json"
    assert cli.main(["bench", "throughput", str(ckpt), *ENGINE_FLAGS, "--num-seqs", "3", "--min-len", "5",
                     "--max-len", "9", "--repeats", "2", "--output-json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert len(result["runs_seconds"]) == 2 and all(s > 0 for s in result["runs_seconds"])
    assert result["seconds"] == pytest.approx(sum(result["runs_seconds"]) / 2)  # the median of two runs
    assert result["stats"]["prefix_cache_hits"] == 0
    assert result["kernels_compiled_in_service"] == []  # CPU: nothing compiles
    assert "2 runs, tok/s:" in capsys.readouterr().out


def test_bench_throughput_refuses_zero_repeats(ckpt, capsys):
    assert cli.main(["bench", "throughput", str(ckpt), *ENGINE_FLAGS, "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_the_cpu_start_up_log_says_there_is_no_cuda_device(ckpt, caplog, capsys):
    """Nothing the user set turned graphs off on CPU: the log must not blame the configuration."""
    import logging

    with caplog.at_level(logging.INFO, logger="ostinato"):
        assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--raw", "--prompt", "Hi", "--max-tokens", "2"]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert "no CUDA device: decode runs eager" in messages
    assert not any("turned off by configuration" in m or "CUDA graphs disabled" in m for m in messages)


def test_the_start_up_log_names_the_weight_load_before_it_runs(ckpt, caplog, capsys):
    import logging

    with caplog.at_level(logging.INFO, logger="ostinato"):
        assert cli.main(["generate", str(ckpt), *ENGINE_FLAGS, "--raw", "--prompt", "Hi", "--max-tokens", "1"]) == 0
    messages = [r.getMessage() for r in caplog.records]
    start = messages.index(f"loading weights from {ckpt}")
    assert any(m.startswith(f"loaded {ckpt} (") for m in messages[start + 1:])


@pytest.mark.parametrize("words", [["bench", x] for x in cli._BENCH_SUBCOMMANDS] + [["advise"], ["bench"]])
def test_every_command_help_shows_the_command_as_typed(words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*words, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ostinato {' '.join(words)} ")


def test_generate_help_shows_the_offline_defaults_and_no_server_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes
    assert "(default max(8192, --max-num-seqs))" in text and "(default: the step budget, no cap" in text
    assert "--served-model-name" not in text and "--max-queued-requests" not in text
    assert "per prompt (default: 32)" in text and "0 is greedy (default: 0.0)" in text
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    served = " ".join(capsys.readouterr().out.split())
    assert "(default max(8192, --max-num-seqs))" in served and "--served-model-name" in served
    assert "(default: the largest prefill graph, 512 tokens" in served and "no cap" not in served
    with pytest.raises(SystemExit):
        cli.main(["bench", "throughput", "--help"])  # runs the LLM API, as generate does
    bench = " ".join(capsys.readouterr().out.split())
    assert "(default: the step budget, no cap" in bench and "--served-model-name" not in bench


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ostinato {version('ostinato')}"


def test_decode_tuning_flag_reaches_the_engine_args():
    from ostinato.cli_args import engine_args_from
    from ostinato.kernels.decode_plan import DecodeTuning

    given = '{"splits": 8, "quantize_output": true}'
    ns = cli.build_parser().parse_args(["bench-engine", "m", "--decode-tuning", given])  # main's `bench engine`
    assert engine_args_from(ns).decode_tuning == DecodeTuning(splits=8, quantize_output=True)
    assert engine_args_from(cli.build_parser().parse_args(["generate", "m", "--prompt", "x"])).decode_tuning is None


@pytest.mark.parametrize("text,says", [
    ('{"quantize_output": 1}', "decode setting quantize_output takes bool, got 1"),
    ('{"splits": true}', "decode setting splits takes int or null, got true"),
    ('{"block_n": 32.0}', "decode setting block_n takes int, got 32.0"),
    ('{"pdl": true}', "no decode setting 'pdl'; the settings: block_n,"),
    ('{"block_n": 10}', "decode block_n must be a power of two >= 16, got 10"),
    ('[8]', """expected a JSON object such as '{"splits": 8}', got '[8]'"""),
])
def test_a_bad_decode_tuning_is_a_usage_error_naming_the_setting(text, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "m", "--decode-tuning", text])
    assert e.value.code == 2 and says in capsys.readouterr().err
