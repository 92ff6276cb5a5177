"""A step's outputs as plain tuples (OutputRecord, engine/outputs.py), built from the engine's bookkeeping.

The server's engine core sends these records as they are, one message per step: tuples of strings, ints and
lists pickle several times faster than dataclasses and cost a fraction to build, and a streamed request gets a
record every step. The records leave out what the receiver already has (the prompt, its ids, the arrival time);
`outputs.output_from_record` makes the RequestOutput from them.

`state` is the engine's per-request bookkeeping and each `st` one sequence's (engine/engine.py).
"""

from __future__ import annotations

from ostinato.engine.outputs import CompletionRecord, OutputRecord
from ostinato.sampling_params import RequestOutputKind


def request_record(state) -> OutputRecord | None:
    """The request's output for this step, as its output_kind asks; None when there is nothing to send."""
    kind = state.params.output_kind
    if kind is RequestOutputKind.DELTA:
        if len(state.seqs) == 1:
            delta = delta_completion(state.seqs[0])
            comps = [] if delta is None else [delta]
        else:
            comps = [c for c in map(delta_completion, state.seqs) if c is not None]
    elif kind is RequestOutputKind.FINAL_ONLY and not state.finished:
        return None
    else:
        comps = [whole_completion(st) for st in state.seqs]
    return (state.request_id, comps, state.finished, state.first_token_time, state.finished_time,
            state.seqs[0].seq.num_cached_tokens or 0)


def whole_completion(st) -> CompletionRecord:
    """Everything so far: O(length), so built every step only for CUMULATIVE requests."""
    return (st.index, st.text.text, list(st.seq.output_token_ids), st.finish_reason,
            list(st.logprobs) if st.logprobs is not None else None)


def delta_completion(st) -> CompletionRecord | None:
    """What is new since this sequence's last delta (O(new tokens)); None if nothing is."""
    tokens, pieces = st.seq.output_token_ids, st.text.pieces
    sent_tokens, sent_pieces, num_tokens, num_pieces = st.sent_tokens, st.sent_pieces, len(tokens), len(pieces)
    finish_reason = st.finish_reason
    if sent_tokens == num_tokens and (finish_reason is None or st.sent_finish):
        return None
    if num_pieces == sent_pieces + 1:  # a streamed step's usual delta: one token, one piece
        text = pieces[sent_pieces]
    else:
        text = "".join(pieces[sent_pieces:]) if num_pieces > sent_pieces else ""
    st.sent_tokens, st.sent_pieces = num_tokens, num_pieces
    st.sent_finish = finish_reason is not None
    return (st.index, text, tokens[sent_tokens:], finish_reason,
            st.logprobs[sent_tokens:] if st.logprobs is not None else None)
