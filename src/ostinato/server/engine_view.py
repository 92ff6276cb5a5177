"""The front's own view of the engine, so /health and /metrics answer within a second whatever the core does.

The engine's stats come from the engine core (a question down the pipe, answered between steps). A core
that is stopped, stuck in a step or flooded answers late or never; a probe that waited for it would hang, and
a load balancer would read a hang as worse than a 503. So a probe asks with a deadline (ANSWER_TIMEOUT_S) and
falls back to the last answer it got. One question is in flight at a time, however many probes arrive: a
stalled core is not sent a question per probe.
"""

from __future__ import annotations

import asyncio

from ostinato.engine.outputs import EngineStats

ANSWER_TIMEOUT_S = 0.5  # well under the 1 s a probe may take


class EngineView:
    """The last stats the engine gave, and a bounded wait for fresh ones."""

    def __init__(self, async_engine, timeout: float = ANSWER_TIMEOUT_S):
        self.async_engine, self.timeout = async_engine, timeout
        self.last: EngineStats | None = None
        self._question: asyncio.Future | None = None

    async def stats(self) -> tuple[EngineStats | None, bool]:
        """(stats, fresh): the engine's answer within the deadline (fresh), else the last one (None if there was
        none). Errors of the question (the engine is loading or dead) are raised."""
        if self._question is None or self._question.done():
            self._question = asyncio.ensure_future(self._ask())
            self._question.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(self._question), self.timeout), True
        except TimeoutError:
            return self.last, False

    async def _ask(self) -> EngineStats:
        stats = await self.async_engine.get_stats()
        self.last = stats
        return stats


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a question's error as seen: the probe that asked may have stopped waiting for it."""
    if not fut.cancelled():
        fut.exception()
