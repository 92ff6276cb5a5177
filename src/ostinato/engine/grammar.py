"""Grammars for structured outputs: compiled by xgrammar off the engine loop, one matcher per constrained sequence,
and the token bitmasks of a step's constrained rows filled on the CPU.

Compiling: `GrammarCompiler.submit` compiles a StructuredOutputs in a small thread pool and caches the result by
the constraint's canonical key (the kind and its value), so a schema compiles once per process; `check` waits for
it with a time bound and turns a failure or a timeout into an InvalidRequestError naming the field. The server
and LLM.generate call `check` before they queue a request; LLMEngine.add_request only submits, and a request whose
grammar is still compiling waits outside the scheduler (LLMEngine), so the engine loop never waits for a compile.

Matching: `GrammarSet` (engine/grammar_set.py) holds a GrammarMatcher per constrained sequence. It accepts the
tokens a step sampled, and `fill(seq_ids)` writes the bitmask of the next token for the constrained ones among a
step's rows (xgrammar's batch calls, split across persistent threads when the work pays for it). xgrammar is
imported on first use: an engine that never sees a constrained request runs without it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ostinato.engine.grammar_set import GrammarSet
from ostinato.errors import InvalidRequestError
from ostinato.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2
COMPILE_TIMEOUT_S = 30.0  # a grammar that takes longer is refused: the bound a request may hold a compile thread


def import_xgrammar():
    """xgrammar, or an InvalidRequestError saying what to install (a constrained request on an engine without it)."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError("structured outputs (response_format, structured_outputs, tool_choice required or "
                                  "named) need the xgrammar package, which is not installed on this server: "
                                  "pip install xgrammar", param="structured_outputs") from None
    return xgrammar


def _compile(compiler, spec: StructuredOutputs):
    kind = spec.kind
    if kind == "json":
        return compiler.compile_json_schema(spec.json, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        import xgrammar as xgr

        # A choice is the alternation of the literal strings, as an EBNF root rule.
        alternatives = " | ".join(_ebnf_literal(c) for c in spec.choice)
        return compiler.compile_grammar(xgr.Grammar.from_ebnf(f"root ::= {alternatives}"))
    return compiler.compile_grammar(spec.grammar)


def _ebnf_literal(text: str) -> str:
    import json

    return json.dumps(text)  # EBNF string literals take JSON's escapes


class GrammarCompiler:
    """Compiles constraints for one tokenizer, in a thread pool, cached by the constraint's key."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], threads: int = COMPILE_THREADS,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ostinato-grammar")
        self._lock = threading.Lock()
        self._futures: dict[Any, Future] = {}
        self._compiler = None  # xgrammar's, made in the pool on first use (TokenizerInfo reads the whole vocab)
        self.compile_seconds: dict[Any, float] = {}  # per key: the first compile's time

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                # No stop ids given (the server's front, which only checks that a grammar compiles): xgrammar
                # finds the tokenizer's own.
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _run(self, spec: StructuredOutputs):
        t0 = time.perf_counter()
        compiled = _compile(self._xgr_compiler(), spec)
        self.compile_seconds[spec.key] = time.perf_counter() - t0
        return compiled

    def submit(self, spec: StructuredOutputs) -> Future:
        """The compiled grammar of `spec`, as a Future (already done when it was compiled before). A failed
        compile is not cached: its Future is dropped so that the same mistake is reported again."""
        import_xgrammar()  # fail now, naming the package, rather than in the pool
        with self._lock:
            future = self._futures.get(spec.key)
            if future is None:
                future = self._futures[spec.key] = self._pool.submit(self._run, spec)
                future.add_done_callback(lambda f, key=spec.key: self._forget_failure(key, f))
        return future

    def _forget_failure(self, key, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._futures.get(key) is future:
                    del self._futures[key]

    def check(self, spec: StructuredOutputs, timeout_s: float | None = None):
        """Compile (or find) `spec`'s grammar, waiting at most timeout_s (default: the compiler's bound)."""
        return result_of(self.submit(spec), spec, self.timeout_s if timeout_s is None else timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def result_of(future: Future, spec: StructuredOutputs, timeout_s: float | None = 0.0):
    """The compiled grammar, or an InvalidRequestError naming the field: the compile failed (a bad regex, a schema
    xgrammar cannot express) or took longer than timeout_s."""
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise InvalidRequestError(f"the {spec.kind} constraint did not compile within {timeout_s:g} s; simplify it",
                                  param=spec.field_name) from None
    except InvalidRequestError:
        raise
    except Exception as e:  # xgrammar's own errors (RuntimeError, InvalidJSONError, ...): the user's constraint
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidRequestError(f"the {spec.kind} constraint does not compile: {first_line}",
                                  param=spec.field_name) from None


class ConstrainedRequests:
    """The engine's side of structured outputs: the compiler (made on first use), the matchers of the constrained
    sequences (`rows`), and the requests held back while their grammar compiles."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], tensor_parallel_size: int = 1):
        self.rows = GrammarSet(vocab_size)
        self._args = (tokenizer, vocab_size, frozenset(stop_token_ids))
        self._tp = tensor_parallel_size
        self._compiler: GrammarCompiler | None = None
        self._held: dict[str, tuple[Future, StructuredOutputs, float, int]] = {}  # id -> (future, spec, since, n)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(*self._args)
        return self._compiler

    def check(self, spec: StructuredOutputs, timeout_s: float | None = None):
        """Compile `spec` now (bounded), for a caller that may wait: the server's pool, LLM.generate."""
        self._check_supported(spec)
        return self.compiler.check(spec, timeout_s)

    def _check_supported(self, spec: StructuredOutputs) -> None:
        if self._tp > 1:  # every rank samples: a mask on rank 0 alone would make the ranks' tokens differ
            raise InvalidRequestError("structured outputs are not supported with --tensor-parallel-size > 1",
                                      param=spec.field_name)

    def submit(self, request_id: str, spec: StructuredOutputs, num_seqs: int):
        """The compiled grammar when it is ready now (raising InvalidRequestError when it failed); else None, and
        the request is held until `take_ready` hands it back."""
        self._check_supported(spec)
        future = self.compiler.submit(spec)
        if future.done():
            return result_of(future, spec)
        self._held[request_id] = (future, spec, time.monotonic(), num_seqs)
        return None

    @property
    def num_held_seqs(self) -> int:
        return sum(n for *_, n in self._held.values())

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def wait_for_held(self, timeout_s: float) -> None:
        """Wait up to timeout_s for a held request's compile (an engine with nothing else to run)."""
        if self._held:
            from concurrent.futures import FIRST_COMPLETED, wait

            wait([f for f, *_ in self._held.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def take_ready(self) -> list[tuple[str, Any]]:
        """(request id, compiled grammar or the InvalidRequestError it ended with) for every held request whose
        compile finished, failed, or outlived the compiler's time bound."""
        if not self._held:
            return []
        ready, now, bound = [], time.monotonic(), self.compiler.timeout_s
        for request_id, (future, spec, since, _) in list(self._held.items()):
            if not future.done() and now - since < bound:
                continue
            del self._held[request_id]
            try:
                ready.append((request_id, result_of(future, spec, 0.0)))
            except InvalidRequestError as e:
                ready.append((request_id, e))
        return ready
