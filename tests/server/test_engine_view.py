"""The front's view of the engine: a probe waits at most its deadline for the core's stats, falls back to the
last answer, and asks one question at a time however many probes arrive."""

import asyncio
import time

import pytest

pytest.importorskip("fastapi")

from ostinato.server.engine_view import EngineView  # noqa: E402


class Engine:
    """get_stats answers while `answering`, else hangs until it is set again (a stopped core)."""

    def __init__(self):
        self.questions = 0
        self.answering = asyncio.Event()
        self.answering.set()

    async def get_stats(self):
        self.questions += 1
        await self.answering.wait()
        return f"stats {self.questions}"


def test_a_core_that_does_not_answer_gets_the_last_view_within_the_deadline():
    async def main():
        engine = Engine()
        view = EngineView(engine, timeout=0.2)
        assert await view.stats() == ("stats 1", True)
        engine.answering.clear()  # the core stops
        start = time.monotonic()
        answers = await asyncio.gather(*(view.stats() for _ in range(20)))
        assert time.monotonic() - start < 0.6
        assert answers == [("stats 1", False)] * 20
        assert await view.stats() == ("stats 1", False)
        assert engine.questions == 2, "each probe sent its own question to a core that does not answer"
        engine.answering.set()  # it comes back: the question in flight is answered
        await asyncio.sleep(0)
        assert await view.stats() in (("stats 2", True), ("stats 3", True))

    asyncio.run(main())


def test_an_error_of_the_question_reaches_the_probe():
    class Dead:
        async def get_stats(self):
            raise RuntimeError("dead")

    async def main():
        with pytest.raises(RuntimeError, match="dead"):
            await EngineView(Dead()).stats()

    asyncio.run(main())
