"""What rounding the projections' inputs to int8 per 32 values (kernels/gguf_int8_dot.py, the one-row GGUF Q4_K /
Q6_K path) does to a real model's greedy output, on any machine: SmolLM2-135M-Instruct (its Q4_1 blocks, float32,
CPU) with every GGUF projection's input rounded that way, against the same run unrounded; and, for scale, with
the inputs rounded to bf16 instead (what a bf16 model's activations carry anyway). Greedy over
benchmarks/smollm2_gpu.py's chat prompts, judged as that script judges (identical tokens; else logprob-close: at
the first difference each side's token in the other's top 5), with the mean and largest |logprob| gap of the
chosen tokens before it.

An upper estimate for Q4_K: the kernel meets the rounding with its codes centred on 8 (its docstring), which on
random Q4_K rows carried 0.6 of the error that rounding x before a dense matmul does.

    PYTHONPATH=src python3 benchmarks/kernels/int8_activations.py [--prompts 24] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from smollm2_gpu import QUESTIONS  # noqa: E402

from ostinato import LLM, SamplingParams  # noqa: E402
from ostinato.kernels import gguf_linear  # noqa: E402

TOP = 5


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded as kernels/gguf_int8_dot.py's quantizing kernel rounds it (per 32 values, scale max|x| / 127),
    back in x's dtype."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0)
    return (codes * scale).reshape(x.shape).to(x.dtype)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def compare(base, other) -> tuple[int, int, float, float]:
    """(identical, logprob-close, mean and largest |logprob| gap over the common prefixes)."""
    same = close = 0
    gaps = []
    for (ta, la), (tb, lb) in zip(base, other):
        n = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
        same += n is None
        close += n is None or (tb[n] in [t for t, _ in la[n].top] and ta[n] in [t for t, _ in lb[n].top])
        gaps += [abs(a.logprob - b.logprob) for a, b in zip(la[:n], lb[:n])]
    return same, close, sum(gaps) / len(gaps), max(gaps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=len(QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=TOP)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:args.prompts]]
    plain = gguf_linear.GGUFLinear.linear_into

    def run(rounding):
        gguf_linear.GGUFLinear.linear_into = (plain if rounding is None else
                                              lambda self, x, out, pdl=False: plain(self, rounding(x), out, pdl))
        try:
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.chat(convs, params)]
        finally:
            gguf_linear.GGUFLinear.linear_into = plain

    base = run(None)
    print(f"| inputs of the projections | identical | logprob-close | mean / max logprob gap |  "
          f"({len(convs)} prompts, {args.max_tokens} tokens, greedy, float32 on CPU)")
    print("|---|---:|---:|---:|")
    for name, rounding in (("rounded to bf16", bf16), ("rounded to int8 per 32 values", int8_blocks)):
        same, close, mean, top = compare(base, run(rounding))
        print(f"| {name} | {same}/{len(convs)} | {close}/{len(convs)} | {mean:.4f} / {top:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
