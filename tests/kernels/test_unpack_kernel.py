"""The decode rows' unpacking kernel (kernels/unpack.py) against DecodeLayout.unpack + resolve_placeholders.

On CPU under TRITON_INTERPRET=1 (conftest sets it); the GPU runs it inside every decode graph (the graph
tests and the start-up self-check compare those graphs with eager steps).
"""

from __future__ import annotations

import pytest
import torch

from ostinato.runner.decode_batch import BLOCKS, POS, TOKEN, DecodeLayout, resolve_placeholders

pytest.importorskip("triton")
from ostinato.kernels import unpack as unpack_kernel  # noqa: E402


@pytest.mark.parametrize("n,block_size", [(1, 16), (7, 4), (130, 16), (300, 1)])
def test_kernel_unpacks_what_the_torch_path_unpacks(n, block_size):
    g = torch.Generator().manual_seed(n)
    layout = DecodeLayout(rows=max(n, 8), blocks_per_seq=6, block_size=block_size, scratch_block=999)
    rows = torch.stack([layout.pad_row() for _ in range(n)])
    rows[:, POS] = torch.randint(0, 6 * block_size, (n,), generator=g, dtype=torch.int32)
    rows[:, BLOCKS:] = torch.randint(0, 5000, (n, 6), generator=g, dtype=torch.int32)
    tokens = torch.randint(0, 50_000, (n,), generator=g, dtype=torch.int32)
    placeholder = torch.rand(n, generator=g) < 0.5
    tokens[placeholder] = -(torch.randint(0, n, (int(placeholder.sum()),), generator=g, dtype=torch.int32) + 1)
    rows[:, TOKEN] = tokens
    sampled = torch.randint(0, 50_000, (layout.rows,), generator=g, dtype=torch.int64)
    ids, positions, slots, context_lens = unpack_kernel.unpack(rows, sampled, block_size, TOKEN, POS, BLOCKS)
    want = layout.unpack(rows)
    assert torch.equal(ids, resolve_placeholders(want["input_ids"], sampled))
    assert torch.equal(positions, want["positions"])
    assert torch.equal(slots, want["slot_mapping"])
    assert context_lens.dtype == want["context_lens"].dtype and torch.equal(context_lens, want["context_lens"])
    if placeholder.any():
        r = int(placeholder.nonzero()[0])
        assert ids[r] == sampled[-int(tokens[r]) - 1]


def test_no_rows():
    rows = torch.zeros(0, 12, dtype=torch.int32)
    out = unpack_kernel.unpack(rows, torch.zeros(4, dtype=torch.int64), 16, TOKEN, POS, BLOCKS)
    assert [t.shape for t in out] == [(0,)] * 4


def test_engine_decodes_the_same_tokens_through_the_kernels(tmp_path, monkeypatch):
    # The decode step with its Triton unpacking and sampling (forced on here, on CPU tensors under the interpreter;
    # on a GPU they always run) against the same engine on the torch paths: greedy and seeded sampled rows,
    # sequences joining and leaving, placeholders resolved from the step before.
    from ostinato import LLM, SamplingParams
    from ostinato.kernels import sampling as sampling_kernel
    from ostinato.tools.checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="qwen3", seed=5)
    prompts = [[7, 8, 9], [20, 21, 22, 23, 24], [40] * 9, [55, 3]]
    params = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.3, seed=12, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]

    def run():
        llm = LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4)
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]

    torch_paths = run()
    monkeypatch.setattr(unpack_kernel, "available_for", lambda rows: True)
    monkeypatch.setattr(sampling_kernel, "available_for", lambda logits: True)
    assert run() == torch_paths
    assert [len(t) for t in torch_paths] == [7, 10, 5, 12]
