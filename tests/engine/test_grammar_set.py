"""GrammarSet's step work (engine/grammar_set.py): one step's tokens accepted in one call, the next bitmasks filled,
and the same results whether the rows run in one chunk or split across the helper threads (RowWork)."""

import logging

import pytest

xgr = pytest.importorskip("xgrammar")

from ostinato.engine.grammar import GrammarCompiler  # noqa: E402
from ostinato.engine.grammar_set import SPLIT_RETRY, GrammarSet, RowWork  # noqa: E402
from ostinato.structured_outputs import StructuredOutputs  # noqa: E402
from ostinato.tools.checkpoint import eos_token_ids, make_checkpoint  # noqa: E402

PATTERN = "[0-9]{2}-[a-z]{3}"
PREFIXES = ["", "1", "12", "12-", "12-a", "12-ab", "3", "45-", "45-xy", "7"]  # rows in different states


@pytest.fixture(scope="module")
def grammar(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("grammar-set")
    make_checkpoint(path, shape="tiny", family="qwen3", seed=2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    stops = eos_token_ids()
    compiled = GrammarCompiler(tokenizer, tokenizer.vocab_size, stops).check(StructuredOutputs(regex=PATTERN))
    return tokenizer, compiled, stops


def _char_ids(tokenizer, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(c) for c in text]  # one token per character (all are in the BPE)


def _rows(grammar, work: RowWork) -> GrammarSet:
    """A set whose sequences 0..9 have taken PREFIXES[i], one character a step, as the engine feeds them."""
    tokenizer, compiled, _ = grammar
    rows = GrammarSet(tokenizer.vocab_size, work)
    for seq_id in range(len(PREFIXES)):
        rows.add(seq_id, compiled)
    for step in range(max(map(len, PREFIXES))):
        live = [i for i, p in enumerate(PREFIXES) if len(p) > step]
        assert rows.accept_tokens(live, [_char_ids(tokenizer, PREFIXES[i][step])[0] for i in live]) == set()
    return rows


def _reference_masks(grammar) -> list[list[int]]:
    tokenizer, compiled, _ = grammar
    masks = []
    for prefix in PREFIXES:
        matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
        assert matcher.accept_string(prefix)
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(bitmask[0].tolist())
    return masks


@pytest.mark.parametrize("work", [RowWork(helpers=0), RowWork(helpers=3, min_chunk_seconds=0)],
                         ids=["one-chunk", "split"])
def test_fill_gives_each_row_its_own_mask_split_or_not(grammar, work):
    rows = _rows(grammar, work)
    step_rows = [100, *range(len(PREFIXES)), 101]  # unconstrained rows around the constrained ones
    positions, bitmask = rows.fill(step_rows)
    assert positions == list(range(1, len(PREFIXES) + 1))
    assert bitmask.tolist() == _reference_masks(grammar)
    assert work.chunks("fill", len(PREFIXES)) == (1 if work.helpers == 0 else 4)
    assert rows.fill([100, 101]) is None


def test_accept_tokens_ends_a_complete_grammar_and_a_refused_token(grammar, caplog):
    tokenizer, _, stops = grammar
    rows = _rows(grammar, RowWork(helpers=3, min_chunk_seconds=0))
    with caplog.at_level(logging.WARNING):  # 5 ("12-ab") completes its text; 0 ("") is refused a letter
        assert rows.accept_tokens([5, 0], _char_ids(tokenizer, "ca")) == {0}
    assert "refused" in caplog.text and 0 not in rows and 5 in rows
    assert rows.accept_tokens([5, 1], [stops[0], *_char_ids(tokenizer, "2")]) == {5}  # 5's stop token ends it
    assert 5 not in rows and 1 in rows
    positions, _ = rows.fill([1, 5, 0, 2])  # ended sequences have no matcher: their rows are left out
    assert positions == [0, 3]


def test_row_work_splits_only_work_worth_a_chunk():
    work = RowWork(helpers=3, min_chunk_seconds=100e-6)
    assert work.chunks("fill", 64) == 1  # nothing measured yet: one chunk, which measures
    spans = []
    for _ in range(2):  # the first call only warms up; the second measures
        work.run("fill", 64, lambda lo, hi: spans.append((lo, hi)))
        assert spans.pop() == (0, 64) and not spans
    assert work.timing("fill").row_seconds > 0
    timing = work.timing("fill")
    timing.row_seconds = 2e-6  # 64 rows of 2 us: 128 us, one chunk's worth
    assert work.chunks("fill", 64) == 1
    timing.row_seconds = 5e-6  # 320 us: three chunks of at least 100 us
    assert work.chunks("fill", 64) == 3
    timing.row_seconds = 1e-3  # every thread, never more chunks than rows
    assert work.chunks("fill", 64) == 4 and work.chunks("fill", 2) == 2
    spans.clear()
    work.run("fill", 10, lambda lo, hi: spans.append((lo, hi)))
    assert sorted(spans) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    work.shutdown()


def test_row_work_keeps_one_chunk_while_splits_do_not_pay():
    work = RowWork(helpers=3, min_chunk_seconds=100e-6)
    timing = work.timing("accept")
    timing.row_seconds, timing.split_share = 1e-3, 1.5  # the last splits took longer than one chunk
    chosen = []
    for _ in range(2 * SPLIT_RETRY):
        chosen.append(work.chunks("accept", 64))
        timing.calls += 1
    assert chosen.count(4) == 2 and chosen.count(1) == 2 * SPLIT_RETRY - 2  # a split now and then, to re-measure
    timing.split_share = 0.4  # they pay again
    assert work.chunks("accept", 64) == 4
