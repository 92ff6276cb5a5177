"""`ostinato bench spec` and `ostinato bench verify`: speculative decoding, offline.

bench spec: a workload whose output repeats its prompt (each request asks the chat model to repeat a given
text word for word, a different text per request), greedy, at each batch size: output tokens per second of one
LLM.chat call after a warm-up, and the speculation counters of that call (acceptance rate, mean accepted
length). Run it once with the engine flags under test and once without --speculative-method; both write the
token ids to --output-json, so the two runs' greedy outputs can be compared (benchmarks/step/spec_check.sh).

bench verify: the verify step alone (runner/spec_verify.py) at one batch size and context, for k = 0 .. --max-k
proposed tokens per row, against the one-token decode step (the decode graph's replay, `ostinato bench`'s
figure): the forward over k + 1 tokens per row, its logits, the draw of every position and the acceptance,
read to the host. It needs --speculative-method (the runner then builds the verify step); with a draft model it
times the draft's steps too. --profile-k K then profiles verify steps of K proposals: each phase's host time and
the device kernels (tools/bench/verify_profile.py).

bench spec --draft-acceptance P[,P...] (with --speculative-method draft, one row per batch size and P): where a
draft pays, as a function of how often it agrees with the model. Each batch is first generated once to learn the
model's greedy tokens (the same with or without speculation); then, timed, each proposal the draft makes is
replaced by the model's own token with probability P and by another token otherwise (`ForcedAcceptance`), so a
proposal is accepted with probability P whatever the draft. The draft's steps still run and cost what they cost,
and the output is still the model's greedy output. Prefix caching is off in this mode: the replacement finds a
sequence's reference by its prompt, which it reads from the prompt's chunks as they are computed.
"""

from __future__ import annotations

import json
import math
import random

TEXTS = [
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls followed them, and the market "
    "opened its stalls one by one. By nine the square was full of voices, crates of ice and the smell of bread.",
    "To replace the filter, switch the pump off at the wall, open the cover with a flat screwdriver, pull the "
    "old cartridge straight out, rinse the housing with clean water, and push the new cartridge in until it clicks.",
    "Our meeting on Tuesday agreed three things: the release moves to the first week of May, the old reports "
    "are archived rather than deleted, and every team names one person who answers questions about its data.",
    "The recipe needs two cups of flour, one egg, a pinch of salt and a cup of milk. Whisk the egg and milk, "
    "fold in the flour and salt, rest the batter for ten minutes, then cook thin pancakes in a hot buttered pan.",
]


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def register(sub) -> None:
    from ostinato.cli_args import add_engine_args, int_list

    p = sub.add_parser("bench-spec", help="speculative decoding on a prompt-repeating workload: tok/s, acceptance")
    add_engine_args(p, offline=True)
    p.add_argument("--batch-sizes", type=int_list, default=(1, 8))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--output-json", default=None)
    p.add_argument("--draft-acceptance", type=float_list, default=None, metavar="P[,P...]",
                   help="with --speculative-method draft: replace each proposal by the model's own token with "
                        "probability P (else by another token), to see the speed at a given acceptance rate; "
                        "one row per batch size and P")
    p.set_defaults(func=run_spec)

    p = sub.add_parser("bench-verify", help="the verify step's cost for k = 0..max-k against a one-token step")
    add_engine_args(p, offline=True)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--context", type=int, default=512, help="tokens in the cache before each row")
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--profile-k", type=int, default=None, metavar="K",
                   help="after the table, profile --iters verify steps of K proposals (torch.profiler): each "
                        "phase's host time and the device kernels per step (tools/bench/verify_profile.py)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_verify)


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": "Repeat the following text word for word, and nothing else.\n\n"
              + TEXTS[i % len(TEXTS)]}] for i in range(n)]


def timed(fn):
    """(seconds, fn()) with the device synchronized on both sides."""
    import time

    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, result


class ForcedAcceptance:
    """The draft model's override (runner/draft.py, DraftModel.override) for --draft-acceptance: each proposal
    becomes the model's greedy token at its position with probability p, else a token that differs from it.
    references: (prompt token ids, greedy output token ids) of every request that will run. A sequence's
    prompt is read from its prompt chunks (from position 0: prefix caching must be off)."""

    def __init__(self, p: float, references: list[tuple[list[int], list[int]]], vocab: int, seed: int = 0):
        import numpy as np

        self.p, self.vocab, self.rng = p, vocab, np.random.default_rng(seed)
        self.full = {tuple(prompt): list(prompt) + list(output) for prompt, output in references}
        self.prompt_lens = sorted({len(prompt) for prompt, _ in references})
        self.seen: dict[int, list[int]] = {}  # seq_id -> its tokens from position 0, as its chunks came

    def observe(self, out) -> None:
        for chunk in out.seqs:
            if not chunk.verify:
                tokens = self.seen.setdefault(chunk.seq_id, []) if chunk.start_pos else []
                del tokens[chunk.start_pos:]
                tokens.extend(chunk.token_ids)
                self.seen[chunk.seq_id] = tokens

    def reference(self, seq_id: int) -> list[int] | None:
        tokens = self.seen.get(seq_id, [])
        for n in self.prompt_lens:
            full = self.full.get(tuple(tokens[:n]))
            if full is not None:
                return full
        return None

    def __call__(self, seqs, j: int, drawn: list[int]) -> list[int]:
        """Proposal j + 1 of each verify row (its position: the row's start_pos + 1 + j)."""
        out = []
        for seq, token in zip(seqs, drawn):
            full, pos = self.reference(seq.seq_id), seq.start_pos + 1 + j
            if full is None or pos >= len(full):
                out.append(token)
            elif self.rng.random() < self.p:
                out.append(full[pos])
            else:
                out.append(token if token != full[pos] else (token + 1) % self.vocab)
        return out


def force_acceptance(llm, p: float, convs, params) -> None:
    """Learn the model's greedy output of convs (one untimed run), then make the draft agree with it with
    probability p."""
    llm.engine.runner.draft.override = None
    outs = llm.chat(convs, params)
    references = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    llm.engine.runner.draft.override = ForcedAcceptance(p, references, llm.engine.model_config.vocab_size)


def spec_engine_args(args):
    """The engine's flags, checked against --draft-acceptance (which needs a draft and no prefix caching)."""
    from dataclasses import replace

    from ostinato.cli_args import engine_args_from
    from ostinato.errors import ConfigError

    engine_args = engine_args_from(args)
    if args.draft_acceptance is None:
        return engine_args
    if args.speculative_method != "draft":
        raise ConfigError("--draft-acceptance replaces a draft model's proposals: add --speculative-method draft "
                          "--speculative-model PATH")
    if not all(0.0 <= p <= 1.0 for p in args.draft_acceptance):
        raise ConfigError(f"--draft-acceptance must be in [0, 1], got {args.draft_acceptance}")
    return replace(engine_args, enable_prefix_caching=False)


def run_spec(args) -> int:
    from ostinato.engine.llm import LLM
    from ostinato.sampling_params import SamplingParams

    llm = LLM.from_engine_args(spec_engine_args(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    for bs in args.batch_sizes:
        convs = conversations(bs)
        llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        for p in args.draft_acceptance or [None]:
            if p is not None:
                force_acceptance(llm, p, convs, params)
            rows.append(timed_row(llm, convs, params, bs, p))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "speculative_method": args.speculative_method,
                       "speculative_model": args.speculative_model,
                       "num_speculative_tokens": args.num_speculative_tokens, "rows": rows}, f, indent=2)
    return 0


def timed_row(llm, convs, params, bs: int, forced: float | None) -> dict:
    """One timed LLM.chat call of the batch, its tok/s and the speculation counters it moved (printed too)."""
    before, paths_before = llm.engine.stats(), verify_paths(llm.engine.runner)
    seconds, outs = timed(lambda: llm.chat(convs, params))
    after, paths = llm.engine.stats(), verify_paths(llm.engine.runner)
    paths = {path: n - paths_before[path] for path, n in paths.items()}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = after.spec_decode_drafts - before.spec_decode_drafts
    proposed = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    row = {"batch": bs, "draft_acceptance": forced, "output_tokens": tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds, "acceptance_rate": accepted / proposed if proposed else None,
           "mean_accepted_length": 1 + accepted / drafts if drafts else None,
           "verify_steps_by_path": paths, "token_ids": [o.outputs[0].token_ids for o in outs]}
    spec = ("" if not proposed else f"  acceptance {row['acceptance_rate']:.2f}  mean accepted length "
            f"{row['mean_accepted_length']:.2f}  verify steps {describe_paths(paths)}")
    forcing = "" if forced is None else f"  (forced P = {forced:g})"
    print(f"bs {bs:>3}  {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tok/s{spec}{forcing}", flush=True)
    return row


def verify_paths(runner) -> dict[str, int]:
    """How many verify steps took each path so far (runner/spec_verify.py, SpecVerifier.steps_by_path); empty
    without speculation."""
    verifier = getattr(runner, "verifier", None)
    return dict(verifier.steps_by_path) if verifier is not None else {}


def describe_paths(paths: dict[str, int]) -> str:
    return ", ".join(f"{n} {path}" for path, n in paths.items() if n) or "none"


def verify_step(runner, batch: int, context: int, k: int, rng: random.Random):
    """A step of `batch` verify rows of k proposals each after `context` cached positions, on blocks 0, 1, ...
    of the pool (the engine is idle: nothing else holds them)."""
    from ostinato.contract import ScheduledSeq, SchedulerOutput
    from ostinato.errors import ConfigError
    from ostinato.sampling_params import SamplingParams

    per_row = math.ceil((context + k + 1) / runner.block_size)
    if batch * per_row > runner.cache_config.num_blocks:
        raise ConfigError(f"bench verify needs {batch * per_row} KV blocks, the pool has "
                          f"{runner.cache_config.num_blocks}: lower --batch-size or --context")
    vocab = runner.model_config.vocab_size
    greedy = SamplingParams(temperature=0.0)
    return SchedulerOutput("prefill", tuple(
        ScheduledSeq(i, tuple(rng.randrange(vocab) for _ in range(k + 1)), context,
                     tuple(range(i * per_row, (i + 1) * per_row)), greedy, 0, verify=True) for i in range(batch)))


def run_verify(args) -> int:
    import torch

    from ostinato.cli_args import engine_args_from
    from ostinato.engine.llm import LLM
    from ostinato.errors import ConfigError
    from ostinato.tools.bench.decode import replay_ms, time_cuda

    llm = LLM.from_engine_args(engine_args_from(args))
    runner = llm.engine.runner
    if getattr(runner, "verifier", None) is None:
        raise ConfigError("bench verify times the verify step: add --speculative-method ngram (or draft)")
    with torch.inference_mode():
        eager, graph = replay_ms(runner, args.batch_size, args.context, torch.Generator().manual_seed(0),
                                 iters=args.iters, warmup=10)
        one = graph if graph is not None else eager
        print(f"batch {args.batch_size}, context {args.context}: one-token decode step {one:.3f} ms "
              f"({'graph' if graph is not None else 'eager'})")
        rng, rows = random.Random(0), []
        for k in range(args.max_k + 1):
            out = verify_step(runner, args.batch_size, args.context, k, rng)
            before = verify_paths(runner)
            ms = time_cuda(lambda: runner.verifier.launch(out).result(), args.iters, 10)
            paths = {path: n - before[path] for path, n in verify_paths(runner).items()}
            rows.append({"k": k, "verify_ms": ms, "vs_decode_step": ms / one,
                         "ms_per_token_all_accepted": ms / (k + 1), "steps_by_path": paths})
            print(f"k {k}  verify {ms:.3f} ms  x{ms / one:.2f} of a decode step  {ms / (k + 1):.3f} ms a token "
                  f"when all are accepted  ({describe_paths(paths)})", flush=True)
        profiled = None
        if args.profile_k is not None:
            from ostinato.tools.bench.verify_profile import print_profile, profile_verify

            out = verify_step(runner, args.batch_size, args.context, args.profile_k, rng)
            profiled = profile_verify(runner.verifier, out, args.iters)
            print_profile(args.profile_k, profiled)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "batch": args.batch_size, "context": args.context,
                       "decode_step_ms": one, "decode_graph": graph is not None, "rows": rows,
                       "profile": profiled}, f, indent=2)
    return 0
