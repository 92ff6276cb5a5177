"""The GGUF kernels on the GPU: bf16 activations at the 8B's projection shapes and ragged ones, GEMV and tensor-core
GEMM rows, against the gguf library's dequantize-then-matmul in float64; and inside a CUDA graph with PDL."""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
gguf_quants = pytest.importorskip("gguf.quants")

from ostinato.kernels.gguf_linear import KERNEL_TYPES, GGUFLinear  # noqa: E402
from ostinato.tools.checkpoint_gguf import random_blocks  # noqa: E402

TYPES = sorted(KERNEL_TYPES, key=lambda t: KERNEL_TYPES[t][0])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: KERNEL_TYPES[t][0])
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (3, 1000, 1280), (8, 4096, 14336), (16, 1000, 1280),
                                   (64, 4096, 4096), (300, 6144, 4096)])
def test_kernel_equals_dequantize_then_matmul(qtype, m, n, k):
    blocks = random_blocks(KERNEL_TYPES[qtype][0], n, k, np.random.default_rng(m))
    layer = GGUFLinear(qtype, torch.from_numpy(blocks).cuda(), k)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).to(torch.bfloat16)
    ref = x.double().cpu().numpy() @ gguf_quants.dequantize(blocks, qtype).astype(np.float64).T
    out = layer.linear(x).double().cpu().numpy()
    scale = np.abs(ref).max()
    # bf16 output (and, in the GEMM, the weight rounded to bf16 for the tensor cores): a few bf16 ulps of the max.
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * scale)


@needs_cuda
@pytest.mark.parametrize("m", [12, 16, 64])
def test_float32_gemm_rows_are_exact_not_tf32(m):
    """float32 activations in the tensor-core GEMM rows keep fp32's mantissa: TF32 (10 bits) would be off by ~1e-3
    relative, and the fp32 runs that must equal HF's greedy tokens (and the prefill graphs' fp32 self-check) would
    see it."""
    qtype = 3  # Q4_1, SmolLM2's
    n, k = 1000, 1280
    blocks = random_blocks("Q4_1", n, k, np.random.default_rng(m))
    layer = GGUFLinear(qtype, torch.from_numpy(blocks).cuda(), k)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m))
    ref = x.double().cpu().numpy() @ gguf_quants.dequantize(blocks, qtype).astype(np.float64).T
    out = layer.linear(x).double().cpu().numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 64])
def test_graph_replay_with_pdl_equals_eager(m):
    from ostinato.kernels.pdl import pdl_unsupported_reason

    pdl = pdl_unsupported_reason(torch.device("cuda")) is None
    qtype = 12  # Q4_K
    layer = GGUFLinear(qtype, torch.from_numpy(random_blocks("Q4_K", 2048, 4096, np.random.default_rng(0))).cuda(),
                       4096)
    x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    eager = layer.linear(x, pdl=pdl)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.linear(x, pdl=pdl)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, layer.linear(x, pdl=pdl))
    assert not torch.equal(out, eager)  # the replay read the new input
