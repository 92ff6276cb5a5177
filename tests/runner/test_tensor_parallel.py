"""Tensor parallelism on CPU (gloo): the split model gives what the whole model gives, and one rank's failure
stops every rank with its cause, in bounded time.

Weight sharding is checked in-process (loading needs no collective); everything else starts real worker
processes through `--tensor-parallel-size`, exactly as a user would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.attention.torch_ref import TorchRefBackend
from ostinato.config import EngineArgs, ModelConfig
from ostinato.errors import ConfigError, TensorParallelError
from ostinato.model.loader import load_model
from ostinato.model.parallel import TPGroup, check_tp_size
from ostinato.tools.checkpoint import make_checkpoint
from support.tp_faults import inject_failure

ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64, max_num_seqs=8)
PROMPTS = ["hello there", "the quick brown fox", [5, 6, 7, 8, 9], "a"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SRC = str(Path(__file__).resolve().parents[2] / "src")
AGREE = "ostinato.runner.distributed:check_ranks_agree"
# A broken failure path must fail these tests in a minute, not hang for the default 10.
BOUNDED_WAITS = {"OSTINATO_TP_TIMEOUT_S": "60"}


@pytest.fixture(autouse=True)
def _bounded_waits(monkeypatch):
    for name, value in BOUNDED_WAITS.items():
        monkeypatch.setenv(name, value)


def _checkpoint(tmp_path_factory, shape: str, family: str) -> str:
    return str(make_checkpoint(tmp_path_factory.mktemp(f"{shape}-{family}"), shape=shape, family=family, seed=1))


def _tokens(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@contextmanager
def _tp_llm(path: str, tp: int):
    """An LLM over `tp` ranks; leaving the block shuts it down, and then no worker rank may still run."""
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE)
    workers = list(llm.engine.runner._workers)
    try:
        yield llm
    finally:
        llm.engine.shutdown()
    assert all(w.proc.poll() is not None for w in workers), "shutdown left a worker rank running"


def _run_tp(path: str, tp: int, params=GREEDY):
    with _tp_llm(path, tp) as llm:
        outs = llm.generate(PROMPTS, params)
        llm.engine.runner.call_all(AGREE)  # every rank sampled the same tokens and holds the same rows
    return outs


# ---- sharding, in-process ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, tp", [("tiny", 2), ("tiny", 4), ("tiny-mqa", 2), ("tiny-mqa", 4)])
def test_rank_shards_reassemble_the_whole_weights(tmp_path_factory, shape, tp):
    """Each rank's parts, put back together by the split rule, are the unsplit model's weights: q and gate/up
    rows, o/down columns, vocabulary rows (the padding rows zero), KV heads split or replicated."""
    path = _checkpoint(tmp_path_factory, shape, "qwen2")  # qwen2: q/k/v biases are split too
    config = ModelConfig.from_dir(path)
    load = lambda tp_group: load_model(path, config, torch.float32, torch.device("cpu"), TorchRefBackend(),
                                       progress=False, tp=tp_group)
    whole = dict(load(TPGroup()).named_parameters())
    ranks = [dict(load(TPGroup(r, tp, None)).named_parameters()) for r in range(tp)]
    h, kv, d, inter = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    hl, kvl, il = h // tp, max(1, kv // tp), inter // tp
    layer = "model.layers.1."
    for suffix in ("weight", "bias"):
        full = whole[f"{layer}self_attn.qkv_proj.{suffix}"]
        parts = [r[f"{layer}self_attn.qkv_proj.{suffix}"] for r in ranks]
        assert torch.equal(torch.cat([p[:hl * d] for p in parts]), full[:h * d])
        for r, p in enumerate(parts):
            kv_head = r * kv // tp if kv < tp else r * kvl
            k_full = full[h * d + kv_head * d: h * d + (kv_head + kvl) * d]
            assert torch.equal(p[hl * d:(hl + kvl) * d], k_full), f"rank {r} holds the wrong K head(s)"
    full = whole[f"{layer}mlp.gate_up_proj.weight"]
    parts = [r[f"{layer}mlp.gate_up_proj.weight"] for r in ranks]
    assert torch.equal(torch.cat([p[:il] for p in parts]), full[:inter])
    assert torch.equal(torch.cat([p[il:] for p in parts]), full[inter:])
    for name in (f"{layer}self_attn.o_proj.weight", f"{layer}mlp.down_proj.weight"):
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=1), whole[name])
    table = torch.cat([r["model.embed_tokens.weight"] for r in ranks])
    assert torch.equal(table[:config.vocab_size], whole["model.embed_tokens.weight"])
    assert not table[config.vocab_size:].any(), "vocabulary padding rows must be zero"


def test_sizes_that_do_not_split_are_refused_with_the_sizes_that_do(tmp_path_factory):
    config = ModelConfig.from_dir(_checkpoint(tmp_path_factory, "tiny", "llama"))  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError,
                       match=r"--tensor-parallel-size 3 does not divide num_attention_heads 4.*\[1, 2, 4\]"):
        check_tp_size(config, 3)
    with pytest.raises(ConfigError, match="cuda-graph-fallback eager cannot be used"):
        EngineArgs(model="x", tensor_parallel_size=2, cuda_graph_fallback="eager")
    with pytest.raises(ConfigError, match="tensor-parallel-size must be an integer >= 1"):
        EngineArgs(model="x", tensor_parallel_size=0)


# ---- TP=2 and TP=4 against TP=1, real worker processes ----------------------------------------------------

@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])  # llama: with the agreement check below
def test_tp2_greedy_matches_tp1(tmp_path_factory, family):
    path = _checkpoint(tmp_path_factory, "tiny", family)
    expected = _tokens(LLM(path, **ENGINE))
    got = [o.outputs[0].token_ids for o in _run_tp(path, 2)]
    assert got == expected


def test_tp2_with_biases_on_every_projection_and_llama3_rope_matches_tp1(tmp_path_factory):
    """An HF-saved Llama with q/k/v and o_proj biases (o_proj's is added once, on rank 0) and tied embeddings,
    and one with llama3 RoPE scaling (the families' remaining config switches)."""
    from test_model_vs_hf import VARIANTS, save_random_checkpoint

    from ostinato.tools.checkpoint import write_tokenizer

    for variant in ("llama-tied-bias", "llama3-rope"):
        path = tmp_path_factory.mktemp(variant)
        save_random_checkpoint(VARIANTS[variant](), path)
        write_tokenizer(path, vocab_size=300)
        prompts = [[5, 6, 7, 8, 9], [17, 3], [250, 251, 252, 1, 2, 3, 4]]
        expected = [o.outputs[0].token_ids for o in LLM(str(path), **ENGINE).generate(prompts, GREEDY)]
        llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
        try:
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected, variant
        finally:
            llm.engine.shutdown()


def test_tp2_one_kv_head_padded_vocab_tied_head_and_sampling_match_tp1(tmp_path_factory):
    """One KV head replicated on both ranks, a 509-token vocabulary (padding on rank 1), a tied lm_head; seeded
    sampling, top-k/top-p and logprobs (computed from the gathered logits) agree with TP=1 too."""
    path = _checkpoint(tmp_path_factory, "tiny-mqa", "llama")
    params = [GREEDY, SamplingParams(temperature=1.0, seed=3, max_tokens=10, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=4, max_tokens=10, ignore_eos=True), GREEDY]
    expected = LLM(path, **ENGINE).generate(PROMPTS, params)
    got = _run_tp(path, 2, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for a, b in zip(got[1].outputs[0].logprobs, expected[1].outputs[0].logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_tp2_llama_greedy_matches_tp1_and_ranks_that_disagree_are_caught(tmp_path_factory):
    """Llama over two ranks gives TP=1's tokens; then the agreement check can fail on the same engine (a TP
    engine costs seconds of worker start-up): rank 0's rows changed behind the others' backs is reported."""
    path = _checkpoint(tmp_path_factory, "tiny", "llama")
    expected = _tokens(LLM(path, **ENGINE))
    with _tp_llm(path, 2) as llm:
        assert _tokens(llm) == expected, "llama"
        llm.engine.runner.call_all(AGREE)
        llm.engine.runner.runner.decode_batch.host[0, 0] += 1  # only on rank 0
        with pytest.raises((RuntimeError, TensorParallelError), match=r"ranks \[1\] hold decode state different"):
            llm.engine.runner.call_all(AGREE)


def test_tp4_with_fewer_kv_heads_than_ranks_matches_tp1(tmp_path_factory):
    path = _checkpoint(tmp_path_factory, "tiny", "qwen3")  # 2 KV heads, each on 2 of the 4 ranks
    expected = _tokens(LLM(path, **ENGINE))
    assert [o.outputs[0].token_ids for o in _run_tp(path, 4)] == expected


# ---- failures stop every rank -----------------------------------------------------------------------------

def test_a_rank_failing_at_start_up_stops_every_rank_with_its_cause(tmp_path_factory, monkeypatch):
    path = _checkpoint(tmp_path_factory, "tiny", "llama")
    inject_failure(monkeypatch, "1:load")
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 failed: RuntimeError: failure injected on rank 1"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - t0 < 60


def test_a_rank_failing_mid_generation_stops_every_rank_with_its_cause(tmp_path_factory, monkeypatch):
    path = _checkpoint(tmp_path_factory, "tiny", "llama")
    inject_failure(monkeypatch, "1:step4")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        workers = list(llm.engine.runner._workers)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError,
                           match="rank 1 failed: RuntimeError: failure injected on rank 1 at step 4"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 60
        deadline = time.monotonic() + 10
        while any(w.proc.poll() is None for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(w.proc.poll() is not None for w in workers), "a worker rank outlived the failure"
        with pytest.raises(TensorParallelError, match="rank 1 failed"):  # the engine stays stopped, saying why
            llm.generate(PROMPTS, GREEDY)
    finally:
        llm.engine.shutdown()


def test_a_killed_worker_turns_health_503_and_the_next_step_names_it(tmp_path_factory):
    """The server's /health lists every rank; a worker killed while serving turns it 503 (rank 1 not alive),
    and the engine's next step raises with the cause instead of waiting on the dead rank."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    import httpx

    from ostinato.engine.engine import LLMEngine
    from test_server import TestServer, engine_args

    path = _checkpoint(tmp_path_factory, "tiny", "llama")
    expected = LLM(path, **ENGINE).generate(["hello there"], SamplingParams(temperature=0.0, max_tokens=6))
    engine = LLMEngine(engine_args(path, tensor_parallel_size=2, num_kv_blocks=64))
    server = TestServer(engine)
    try:
        health = httpx.get(server.base_url + "/health", timeout=10)
        assert health.status_code == 200
        assert [(r["rank"], r["alive"]) for r in health.json()["ranks"]] == [(0, True), (1, True)]
        done = server.post("/v1/completions", {"model": "tiny-llama", "prompt": "hello there", "max_tokens": 6,
                                               "temperature": 0})
        assert done.json()["choices"][0]["text"] == expected[0].outputs[0].text
        engine.runner._workers[0].proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (health := httpx.get(server.base_url + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health still says ok after a rank died"
            time.sleep(0.1)
        assert health.status_code == 503
        assert [r["alive"] for r in health.json()["ranks"]] == [False, False]  # rank 0 stopped too
        with pytest.raises(TensorParallelError, match=r"rank 1 failed: the process exited with code -9"):
            engine.add_request("after", "hello", GREEDY)
            engine.step()
    finally:
        server.stop()
        engine.shutdown()


def test_rank_0_counts_as_stopped_while_its_watcher_still_drains_a_dead_worker():
    """The window CI once hit: a worker has exited, its watcher has not yet recorded the failure. /health must
    already show rank 0 stopping, not serving."""
    from types import SimpleNamespace

    from ostinato.runner.tp_executor import TensorParallelRunner

    runner = object.__new__(TensorParallelRunner)
    runner.world_size, runner._failure, runner._closed = 2, None, False
    runner._workers = [SimpleNamespace(rank=1, proc=SimpleNamespace(poll=lambda: None), error=None)]
    assert [r["alive"] for r in runner.rank_health()] == [True, True]
    runner._workers[0].proc.poll = lambda: -9
    health = runner.rank_health()
    assert [r["alive"] for r in health] == [False, False]
    assert health[0]["error"] == "stopping: rank 1 exited"
    runner._failure = "rank 1 failed: the process exited with code -9"
    assert runner.rank_health()[0]["error"] == runner._failure


def test_a_call_that_fails_on_a_dead_worker_waits_for_its_watcher_to_say_why():
    """The pipe to a dead worker breaks before its watcher has drained the worker's report: the call waits for
    the watcher (however slow) and raises the recorded cause, not the BrokenPipeError."""
    import threading
    from types import SimpleNamespace

    from ostinato.runner.tp_executor import TensorParallelRunner

    runner = object.__new__(TensorParallelRunner)
    runner.world_size, runner._failure, runner._closed, runner._busy = 2, None, False, 0

    def slow_watcher():
        time.sleep(1.5)  # longer than the guard's grace for a worker to exit
        runner._failure = "rank 1 failed: RuntimeError: boom"

    watcher = threading.Thread(target=slow_watcher)
    runner._workers = [SimpleNamespace(rank=1, proc=SimpleNamespace(poll=lambda: 1), error=None, watcher=watcher)]
    watcher.start()
    with pytest.raises(TensorParallelError, match="rank 1 failed: RuntimeError: boom") as caught:
        with runner._guard():
            raise BrokenPipeError("the worker's pipe")
    assert isinstance(caught.value.__cause__, BrokenPipeError)


# ---- rank 0 in a process of its own ------------------------------------------------------------------------

_RANK0_DIES = """
import os, sys, time
from ostinato import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64)
print(llm.engine.runner._workers[0].proc.pid, flush=True)
os._exit(0)  # rank 0 vanishes without shutting anything down
"""


def _env(**extra) -> dict:
    """For processes started before _bounded_waits applies (module fixtures): its bound, set here."""
    return dict(os.environ, PYTHONPATH=SRC, **BOUNDED_WAITS, **extra)


def _start_rank0_that_dies(path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _RANK0_DIES, path], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _start_torchrun_style(path: str) -> list[subprocess.Popen]:
    """Every rank runs the same command: rank 0 the CLI, rank 1 a Python script (LLM(...) on a rank > 0 serves
    rank 0, then exits with code 0)."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ostinato", "generate", path, "--prompt", "hello there", "--raw", "--max-tokens",
           "8", "--temperature", "0", "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
           "--num-kv-blocks", "64", "--max-model-len", "64"]
    script = [sys.executable, "-c", "import sys; from ostinato import LLM; LLM(sys.argv[1], tensor_parallel_size=2, "
              "device='cpu', dtype='float32', num_kv_blocks=64, max_model_len=64); print('unreachable')", path]
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    return [subprocess.Popen(c, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r, c in enumerate((cmd, script))]


@pytest.fixture(scope="module")
def own_rank0s(tmp_path_factory):
    """Both launches whose rank 0 is a process of its own, started together: each is seconds of interpreters
    importing torch, which two cores do side by side. (llama checkpoint, rank 0 that dies, torchrun ranks)."""
    path = _checkpoint(tmp_path_factory, "tiny", "llama")
    launched = (path, _start_rank0_that_dies(path), _start_torchrun_style(path))
    yield launched
    for proc in (launched[1], *launched[2]):
        if proc.poll() is None:
            proc.kill()


def test_workers_exit_when_rank_0_dies_without_a_shutdown(own_rank0s):
    rank0 = own_rank0s[1]
    line = rank0.stdout.readline()  # not communicate(): the worker holds rank 0's stderr open while it lives
    assert line.strip().isdigit(), f"rank 0 did not start its worker: {rank0.stderr.read()[-2000:]}"
    pid = int(line)
    rank0.wait(timeout=60)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "a worker rank outlived rank 0"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_torchrun_style_variables_make_rank_1_a_worker_of_rank_0(own_rank0s):
    path, _, procs = own_rank0s
    expected = LLM(path, **ENGINE).generate(["hello there"], SamplingParams(temperature=0.0, max_tokens=8))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert expected[0].outputs[0].text in outs[0][0]
    assert outs[1][0].strip() == "", "a worker rank printed a completion"
