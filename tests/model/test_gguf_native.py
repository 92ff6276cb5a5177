"""GGUF files run in their own blocks (model/gguf_native.py, model/gguf_weights.py): a random Q4_K_M file (k-quant
rows, a q|k|v of mixed types) matches HF transformers on the same dequantized weights, a second start reads the
metadata from the cache, and loading keeps host memory under twice the file size."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from ostinato import LLM, SamplingParams  # noqa: E402
from ostinato.kernels.gguf_linear import GGUFConcat, GGUFLinear  # noqa: E402
from ostinato.model.layers import QuantizedLMHead  # noqa: E402
from ostinato.tools.checkpoint import make_gguf_checkpoint  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    return make_gguf_checkpoint(tmp_path_factory.mktemp("gguf"), "tiny-256", gguf_type="Q4_K_M", seed=3)


def _assert_greedy_equals_hf(path, prompts, ours, new_tokens):
    """HF transformers reads the same GGUF file (dequantizing it, q/k rows put back) and decodes greedily."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        for prompt, out in zip(prompts, ours):
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == ref


def test_random_q4_k_m_matches_hf_on_the_same_dequantized_weights(q4_k_m, cache, caplog):
    caplog.set_level("INFO")
    llm = LLM(str(q4_k_m), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=32, max_num_seqs=4)
    layers = llm.engine.runner.model.model.layers
    assert isinstance(layers[0].mlp.down_proj, GGUFLinear) and layers[0].mlp.down_proj.type_name == "Q4_K"
    assert isinstance(layers[1].self_attn.qkv_proj, GGUFConcat)  # q, k Q4_K and v Q6_K (the _M recipe)
    qk, v = layers[1].self_attn.qkv_proj.parts  # q and k share a kernel
    # q: 256 rows, k as many as v
    assert (qk.type_name, qk.out_features, v.type_name) == ("Q4_K", 256 + v.out_features, "Q6_K")
    assert "dequantized to float32 at load: 1 x Q4_K\n" in caplog.text  # the embedding only
    head = llm.engine.runner.model.lm_head  # untied, Q6_K in the _M recipe: kept in its blocks
    assert isinstance(head, QuantizedLMHead) and head.linear.type_name == "Q6_K" and head.weight is None
    # The bench's floor counts the bytes held: the blocks, and the dense rest (less the untied table's unread rows).
    from ostinato.tools.bench.decode import weights_read_per_step

    runner = llm.engine.runner
    blocks = sum(m.blocks.numel() for m in runner.model.modules() if isinstance(m, GGUFLinear))
    dense = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert runner.weights_bytes == blocks + dense
    assert weights_read_per_step(runner) == blocks + dense - 512 * 256 * 4
    prompts = [[0, 17, 250, 31, 99], [0, 5, 6, 7], [0, 300, 2, 480, 77, 12, 9]]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    _assert_greedy_equals_hf(q4_k_m, prompts, ours, 8)
    assert len({t for o in ours for t in o.outputs[0].token_ids}) > 4  # not one repeated token


def test_a_first_start_parses_the_file_once(q4_k_m, cache, monkeypatch):
    """Config, tokenizer and the tensor table all come from one parse of the header (transformers' loaders would
    each parse it again), and the reader is the library's own again afterwards."""
    import gguf

    from ostinato.model.gguf_sources import resolve_model_dir

    construct, opened = gguf.GGUFReader, []

    def counting(*args, **kwargs):
        opened.append(args[0])
        return construct(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    folder = resolve_model_dir(str(q4_k_m))
    assert len(opened) == 1 and (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file()
    assert gguf.GGUFReader is counting


def test_second_start_reads_the_metadata_from_the_cache(q4_k_m, cache, monkeypatch):
    from ostinato.model import gguf_native
    from ostinato.model.gguf_sources import resolve_model_dir

    first = resolve_model_dir(str(q4_k_m))
    assert json.loads((first / "ostinato_gguf.json").read_text())["weights"] == "gguf"
    assert not list(first.glob("*.safetensors"))  # no float32 copy
    monkeypatch.setattr(gguf_native, "open_gguf", lambda path: pytest.fail("the cached start parsed the header"))
    assert resolve_model_dir(str(q4_k_m)) == first
    assert resolve_model_dir(str(q4_k_m), gguf_dequantize=True) != first  # the float32 folder, as before


_RSS_PROBE = """
import sys, torch
from ostinato.attention.torch_ref import TorchRefBackend
from ostinato.config import ModelConfig
from ostinato.model.gguf_sources import resolve_model_dir
from ostinato.model.loader import load_model, weights_nbytes

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

model_dir = resolve_model_dir(sys.argv[1])
config = ModelConfig.from_dir(model_dir)
import gguf, transformers.modeling_gguf_pytorch_utils  # imported before the baseline: not the loader's memory
from ostinato.model.decoder import DecoderForCausalLM
with torch.device("meta"):  # torch's one-time set-up of the meta device (~70 MB), which any load pays
    DecoderForCausalLM(config, TorchRefBackend())
before = status("VmRSS:")
model = load_model(model_dir, config, torch.float32, torch.device("cpu"), TorchRefBackend(), progress=False)
print(status("VmHWM:") - before, weights_nbytes(model))
"""


@pytest.fixture(scope="module")
def smollm2_loads():
    """The real SmolLM2 file (98 MB) loaded on the CPU by three processes started together, each alone in its
    memory (what they measure is their own): _RSS_PROBE, and benchmarks/step/gguf_load.py keeping the blocks and
    with --gguf-dequantize. Each is one core's import and load, so two cores run them side by side.
    {name: (file, stdout)}."""
    from ostinato.model.gguf_sources import short_name_path

    path = short_name_path("smollm2-135m")
    shared = str(Path(tempfile.gettempdir()) / "ostinato-test-cache")
    env = {**os.environ, "PYTHONPATH": str(SRC), "OSTINATO_CACHE_DIR": shared}  # test_smollm2's cache
    bench = [sys.executable, str(SRC.parent / "benchmarks" / "step" / "gguf_load.py"), str(path)]
    commands = {"probe": [sys.executable, "-c", _RSS_PROBE, str(path)], "blocks": bench,
                "float32": [*bench, "--gguf-dequantize"]}
    procs = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in commands.items()}
    outs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {err[-2000:]}"
        outs[name] = (path, out)
    return outs


def test_loading_keeps_peak_host_memory_under_twice_the_file_size(smollm2_loads):
    """What loading adds to the process beyond the model's own tensors (on a GPU those are device memory) stays
    under twice the file, where the float32 path held ~5x."""
    path, out = smollm2_loads["probe"]
    grown, model_bytes = map(int, out.split()[-2:])
    size = path.stat().st_size
    assert model_bytes < size * 2  # the projections stayed in their blocks (float32 would be 540 MB)
    assert grown - model_bytes < 2 * size, \
        f"grew {grown / 1e6:.0f} MB, model {model_bytes / 1e6:.0f} MB, file {size / 1e6:.0f} MB"


def test_the_load_benchmark_reports_the_blocks_and_the_float32_paths(smollm2_loads):
    """benchmarks/step/gguf_load.py: the blocks path holds far fewer bytes than the float32 one, and each figure
    it prints is there."""
    blocks, dense = (json.loads(smollm2_loads[name][1].strip().splitlines()[-1]) for name in ("blocks", "float32"))
    assert blocks["gguf_dequantize"] is False and dense["gguf_dequantize"] is True
    # 135M parameters: float32 is 0.5 GiB; the blocks (and the float32 embedding on CPU) well under that.
    assert blocks["model_GiB"] < 0.6 * dense["model_GiB"] and 0.45 < dense["model_GiB"] < 0.6
    assert all(r["peak_rss_GiB"] >= r["rss_before_load_GiB"] > 0 and r["load_s"] >= 0 for r in (blocks, dense))


def test_qwen2_q8_0_with_qkv_biases_matches_hf(tmp_path, cache):
    """Qwen2's q/k/v biases ride with the quantized q|k|v (and its rows are not permuted, unlike llama's)."""
    path = make_gguf_checkpoint(tmp_path, "tiny-256", family="qwen2", gguf_type="Q8_0", seed=1)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=32, max_num_seqs=4)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) and qkv.bias is not None and qkv.bias.shape == (512,)
    prompts = [[0, 17, 250, 31, 99], [0, 5, 6, 7]]
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    _assert_greedy_equals_hf(path, prompts, ours, 6)


def test_the_log_says_when_activations_are_rounded_to_int8(monkeypatch):
    from collections import Counter

    from ostinato.kernels import gguf_int8_route
    from ostinato.model.gguf_weights import int8_dot_line

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    line = int8_dot_line(Counter({"Q4_K": 160, "Q6_K": 48}), cuda, torch.bfloat16)
    assert "(Q4_K and Q6_K at 1-16 rows)" in line and "int8" in line  # the dp4a kernels' rows and the MMAs'
    assert "(Q8_0 and Q6_K at 1-16 rows)" in int8_dot_line(Counter({"Q6_K": 1, "Q8_0": 3}), cuda, torch.float16)
    monkeypatch.setitem(gguf_int8_route.INT8_DOT_ROWS, 8, (2, 8))  # types at different rows: one clause each
    monkeypatch.setitem(gguf_int8_route.INT8_MMA_ROWS, 8, (9, 32))
    assert "(Q8_0 at 2-32 rows; Q6_K at 1-16 rows)" in int8_dot_line(Counter({"Q6_K": 1, "Q8_0": 3}), cuda,
                                                                    torch.float16)
    assert int8_dot_line(Counter({"Q4_1": 210}), cuda, torch.bfloat16) is None  # SmolLM2: no such type
    assert int8_dot_line(Counter({"Q4_K": 1}), cuda, torch.float32) is None  # float32 keeps the fp32 decoding
    assert int8_dot_line(Counter({"Q4_K": 1}), cpu, torch.bfloat16) is None  # the torch path on CPU


def test_a_quantized_head_gives_float32_logits_from_16_bit_rows():
    """QuantizedLMHead on the CPU path: float32 logits accumulated from the bf16 rows upcast, never rounded to bf16
    (compute_logits' contract), and the rows' dtype when asked."""
    from ostinato.kernels.gguf_linear import Q6_K
    from ostinato.tools.checkpoint_gguf import random_blocks

    blocks = torch.from_numpy(random_blocks("Q6_K", 40, 256, np.random.default_rng(0)))
    head = QuantizedLMHead(GGUFLinear(Q6_K, blocks, 256), vocab_size=40)
    hidden = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = GGUFLinear(Q6_K, blocks, 256).dequantize().to(torch.bfloat16).float()
    logits = head.logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ w.T, rtol=0, atol=0)
    assert head(hidden).dtype == torch.bfloat16
    assert not torch.equal(logits, head(hidden).float())  # bf16 logits are rounded; float32 ones are not


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_decode_writing_o_projs_input_quantized_changes_no_logprob(q4_k_m, cache, monkeypatch):
    """On CUDA, with DecodeTuning.quantize_output (the default), the decode attention writes the Q4_K o_proj's int8
    input itself (kernels/decode_output.py) where, off, a kernel of its own quantizes the stored output: the same
    codes (each block's sum of x may round apart, tests/kernels/test_decode_quantized_output.py), so the same tokens
    and logprobs, in the decode graphs."""
    from ostinato.attention.triton_paged import TritonPagedBackend
    from ostinato.kernels.decode_plan import DecodeTuning

    prompts = [[0, 17, 250, 31, 99], [0, 5, 6, 7], [0, 300, 2, 480, 77, 12, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def generate(quantize_output):
        llm = LLM(str(q4_k_m), dtype="bfloat16", max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
                  gpu_memory_utilization=0.3, decode_tuning=DecodeTuning(quantize_output=quantize_output))
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
        return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]

    handed = []
    decode_with_rope = TritonPagedBackend.decode_with_rope

    def spy(self, *args, **kwargs):
        handed.append((args + (None,) * 11)[10] if "quantized" not in kwargs else kwargs["quantized"])
        return decode_with_rope(self, *args, **kwargs)

    monkeypatch.setattr(TritonPagedBackend, "decode_with_rope", spy)
    fused = generate(True)
    assert any(q is not None for q in handed), "the decode was never handed o_proj's quantized input"
    handed.clear()
    apart = generate(False)
    assert handed and all(q is None for q in handed)
    assert [tokens for tokens, _ in apart] == [tokens for tokens, _ in fused]
    for (_, ours), (_, theirs) in zip(fused, apart):
        np.testing.assert_allclose([lp for lp, _ in ours], [lp for lp, _ in theirs], atol=1e-2)
