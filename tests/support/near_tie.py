"""Greedy outputs that may differ only where rounding moved a near-tie: the loose comparison for an FP8 cache or
weights against the model's dtype."""

from __future__ import annotations


def _top(step) -> set[int]:
    return {token for token, _ in step.top}


def identical_or_near_tie(a, b) -> bool:
    """a, b: CompletionOutputs with logprobs. True where their tokens are identical; else asserts that they agree up
    to their first difference and that there each side's token is in the other's top logprobs, and returns False."""
    diff = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
    if diff is None:
        return True
    assert a.token_ids[diff] in _top(b.logprobs[diff]) and b.token_ids[diff] in _top(a.logprobs[diff]), \
        f"token {diff}: {a.token_ids[diff]} against {b.token_ids[diff]}, neither a near-tie"
    return False
