"""The step policy: how many tokens one engine step carries, and how many of them may be prompt tokens when the
step also decodes running sequences. Pure Python, resolved once from the flags (EngineArgs.scheduler_config).

The budget is the server's and the offline API's (LLM, `bench throughput`): a step with nothing to decode prefills
up to it, so a burst of prompts into an idle engine is admitted in few, large steps. Where they differ is the cap
on a step that also decodes: the server defaults to default_prefill_tokens_while_decoding(), so a running
stream's next token never waits behind more than about one prefill graph of prompt; LLM leaves it uncapped, as a
batch job reads only the total and a cap would slow the admission of its queued prompts. The measurements, and
what each costs (TTFT, the gap between tokens, throughput): docs/PERFORMANCE.md, "Why these defaults".
"""

from __future__ import annotations

from collections.abc import Sequence

from ostinato.config_readers import DEFAULT_PREFILL_GRAPH_TOKENS, plan_prefill_graph_tokens

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def step_budget(given: int | None, max_num_seqs: int) -> int:
    """--max-num-batched-tokens, or its default: never below --max-num-seqs (each decode row counts one token)."""
    return given or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)


def default_prefill_tokens_while_decoding(max_num_seqs: int, largest_prefill_graph: int) -> int:
    """The prompt tokens a step with decode rows carries unless --max-prefill-tokens-while-decoding says: what
    leaves the decode rows room in the largest prefill graph (the step stays one replay, its cost near a decode
    step's), but at least half that graph, so that admission keeps up where many sequences decode (and at least
    one token, where the graphs are that small)."""
    return max(largest_prefill_graph - max_num_seqs, largest_prefill_graph // 2, 1)


def prefill_tokens_while_decoding(given: int | None, max_num_seqs: int, budget: int,
                                  prefill_graph_tokens: Sequence[int] | None) -> int:
    """--max-prefill-tokens-while-decoding, or the server's default from the prefill graphs the flags leave
    (DEFAULT_PREFILL_GRAPH_TOKENS' largest where they leave none)."""
    if given is not None:
        return given
    graphs = plan_prefill_graph_tokens(budget, prefill_graph_tokens)
    largest = max(graphs) if graphs else DEFAULT_PREFILL_GRAPH_TOKENS[-1]
    return default_prefill_tokens_while_decoding(max_num_seqs, largest)
