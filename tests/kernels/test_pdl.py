"""Programmatic dependent launch (kernels/pdl.py): where it may be used, how --pdl chooses, and (GPU) that launching the
decoder's Triton kernels with it changes no bit of what a decode step computes, in a graph replayed many times.

A kernel launched with PDL that read its predecessor's output before waiting would race; the GPU tests
compare every replay of a captured PDL chain, and a whole engine's tokens and logprobs, against PDL off."""

from __future__ import annotations

import functools

import pytest
import torch

from ostinato.config import EngineArgs
from ostinato.errors import ConfigError
from ostinato.kernels.pdl import pdl_unsupported_reason, resolve_pdl

CUDA = torch.cuda.is_available()


def test_off_is_off_and_auto_follows_support():
    cpu = torch.device("cpu")
    assert resolve_pdl("off", cpu) is False
    assert resolve_pdl("auto", cpu) is False
    assert "cpu" in pdl_unsupported_reason(cpu)


def test_on_where_unsupported_says_why_and_what_to_change():
    with pytest.raises(ConfigError, match=r"--pdl on cannot be honoured: .*cpu.*--pdl auto or --pdl off"):
        resolve_pdl("on", torch.device("cpu"))


def test_bad_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="--pdl must be one of auto, on, off"):
        resolve_pdl("yes", torch.device("cpu"))
    with pytest.raises(ConfigError, match="--pdl must be one of auto, on, off, got 'yes'"):
        EngineArgs(model="unused", pdl="yes")


def test_torch_backend_refuses_pdl_on():
    from ostinato.runner.runner import make_backend

    assert make_backend("torch", torch.device("cpu"), "auto").pdl is False
    with pytest.raises(ConfigError, match="--pdl on needs --attention-backend triton"):
        make_backend("torch", torch.device("cpu"), "on")


def test_kernel_sets_differ_only_in_the_launch():
    pytest.importorskip("triton")
    from ostinato.kernels.fused import TORCH_KERNELS, TRITON_KERNELS, TRITON_KERNELS_PDL, kernels_for

    cuda = torch.device("cuda")
    assert kernels_for(cuda, False) is TRITON_KERNELS
    assert kernels_for(cuda, True) is TRITON_KERNELS_PDL
    assert kernels_for(torch.device("cpu"), True) is TORCH_KERNELS  # torch ops: nothing to launch with PDL
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "qk_norm_rope", "linear", "qk_norm_rope_write_kv",
                 "norm_linear"):
        fn = getattr(TRITON_KERNELS_PDL, name)
        assert fn.keywords == {"pdl": True} and fn.func is getattr(TRITON_KERNELS, name)


# ---- GPU ------------------------------------------------------------------------------------------------

needs_pdl = pytest.mark.skipif(not CUDA or pdl_unsupported_reason(torch.device("cuda")) is not None,
                               reason="needs a GPU that supports PDL (sm_90+)")


def _layer_chain(pdl: bool, x, res, w):
    """One decoder layer's Triton kernels in decode order at batch 1 (the attention aside): norm, qkv GEMV,
    o GEMV, add + norm, gate_up GEMV, SiLU * up, down GEMV, then the next layer's add + norm."""
    from ostinato.kernels import fused
    from ostinato.kernels.gemv import GemvTiles, choose_gemv_tiles, gemv_linear

    def lin(a, weight):  # the GEMV even where the model would use cuBLAS: every launch here is a PDL one
        return gemv_linear(a, weight, None, choose_gemv_tiles(1, *weight.shape) or GemvTiles(8, 1024), pdl=pdl)

    h = fused.rms_norm(x, w["norm"], 1e-6, pdl=pdl)
    h = lin(lin(h, w["qkv"])[:, : w["o"].shape[1]], w["o"])
    h, res = fused.fused_add_rms_norm(h, res, w["norm"], 1e-6, pdl=pdl)
    h = lin(fused.silu_and_mul(lin(h, w["gate_up"]), pdl=pdl), w["down"])
    return fused.fused_add_rms_norm(h, res, w["norm"], 1e-6, pdl=pdl)


def _folded_layer_chain(pdl: bool, x, res, w):
    """The same layer as the decoder runs it at batch 1, the norms folded into the GEMVs after them: each
    folded kernel reads a residual written two or three launches before it, and writes the next one."""
    from ostinato.kernels import fused
    from ostinato.kernels.gemv import choose_gemv_tiles, gemv_linear, gemv_norm_linear

    def tiles(weight):
        return choose_gemv_tiles(1, *weight.shape, pdl=True)

    qkv, res = gemv_norm_linear(x, res, w["norm"], 1e-6, w["qkv"], None, tiles(w["qkv"]), pdl=pdl)
    h = gemv_linear(qkv[:, : w["o"].shape[1]], w["o"], None, tiles(w["o"]), pdl=pdl)
    gate_up, res = gemv_norm_linear(h, res, w["norm"], 1e-6, w["gate_up"], None, tiles(w["gate_up"]), pdl=pdl)
    return gemv_linear(fused.silu_and_mul(gate_up, pdl=pdl), w["down"], None, tiles(w["down"]), pdl=pdl), res


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("hidden,inter", [(1024, 3072), (2048, 8192)])
def test_pdl_chain_in_a_graph_matches_plain_launches_every_replay(hidden, inter, folded):
    layer_chain = _folded_layer_chain if folded else _layer_chain
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.05

    w = {"norm": rand(hidden) + 1, "qkv": rand(2 * hidden, hidden), "o": rand(hidden, hidden),
         "gate_up": rand(2 * inter, hidden), "down": rand(hidden, inter)}
    x, res = rand(1, hidden), rand(1, hidden)
    chain = 6  # layers in a row, so that PDL launches follow PDL launches
    for _ in range(2):  # compile outside the capture
        layer_chain(True, x, res, w)
        layer_chain(False, x, res, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, r = x, res
        for _ in range(chain):
            h, r = layer_chain(True, h, r, w)
    for i in range(300):
        x.copy_(rand(1, hidden))  # new inputs each replay: a kernel reading early would see the old ones
        res.copy_(rand(1, hidden))
        graph.replay()
        eh, er = x, res
        for _ in range(chain):
            eh, er = layer_chain(False, eh, er, w)
        assert torch.equal(h, eh) and torch.equal(r, er), f"replay {i} differs from the plain launches"


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("late_trigger_programs", [128, 0])
def test_engine_tokens_and_logprobs_equal_with_and_without_pdl(tmp_path, monkeypatch, late_trigger_programs):
    """The decode attention's PDL trigger as the rule places it (the tiny model's launches hold few programs:
    first thing) and always after its K/V loop (0): either way the same tokens and logprobs as without PDL."""
    from ostinato.kernels import decode_plan
    from ostinato.engine.engine import LLMEngine
    from ostinato.sampling_params import SamplingParams
    from ostinato.tools.checkpoint import make_checkpoint

    monkeypatch.setattr(decode_plan, "DecodeTuning",  # the runner builds its backend's tuning from the module's
                        functools.partial(decode_plan.DecodeTuning, late_trigger_programs=late_trigger_programs))
    make_checkpoint(tmp_path, shape="tiny", family="qwen3", seed=5, dtype="bfloat16")
    common = dict(model=str(tmp_path), dtype="bfloat16", max_model_len=256, num_kv_blocks=256, max_num_seqs=16)
    results = {}
    for mode in ("on", "off"):
        engine = LLMEngine(EngineArgs(**common, pdl=mode))
        assert engine.runner.backend.pdl is (mode == "on")
        assert engine.runner.model.kernels.name == ("triton+pdl" if mode == "on" else "triton")
        gen = torch.Generator().manual_seed(1)
        for i in range(9):  # batch sizes 1..9 across the run: padded graphs, rows joining and leaving
            prompt = torch.randint(3, 200, (5 + 3 * i,), generator=gen).tolist()
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12 + 2 * i, ignore_eos=True,
                                                               logprobs=3))
        out = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = (o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs])
        assert engine.stats().decode_steps_graph > 0
        results[mode] = out
    assert results["on"] == results["off"]
