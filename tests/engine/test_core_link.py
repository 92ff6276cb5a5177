"""The front's link to the engine core, without a core: the watchdog's stall and kill bounds on a fake clock of
progress, and a command sender that never blocks its caller on a pipe nobody reads."""

import multiprocessing
import threading
import time

import pytest

from ostinato.engine.core_link import CommandSender, CoreWatchdog


class Core:
    """What the watchdog watches: whether work is pending, its pings and the kill."""

    def __init__(self):
        self.work = False
        self.pings = 0
        self.killed: list[str] = []
        self.kill_event = threading.Event()

    def ping(self):
        self.pings += 1

    def kill(self, cause):
        self.killed.append(cause)
        self.kill_event.set()


def watchdog(core, stall=0.3, kill=0.8, **kw):
    dog = CoreWatchdog(stall, kill, has_work=lambda: core.work, ping=core.ping, kill=core.kill,
                       interval=0.02, **kw)
    dog.start()
    return dog


def test_an_idle_core_is_never_stalled():
    core = Core()
    dog = watchdog(core)
    try:
        time.sleep(1.0)  # past both bounds, with nothing pending
        assert dog.stall_cause is None and core.killed == [] and core.pings == 0
        core.work = True  # work arrives after a long idle time: the silence counts from now
        assert dog.stall_cause is None
    finally:
        dog.stop()


def test_a_silent_core_with_work_is_stalled_then_killed_once():
    core = Core()
    dog = watchdog(core, ping_after=0.1)
    try:
        time.sleep(0.1)
        core.work = True
        start = time.monotonic()
        while dog.stall_cause is None:
            assert time.monotonic() - start < 2, "never reported stalled"
            time.sleep(0.01)
        assert time.monotonic() - start >= 0.25 and "no progress" in dog.stall_cause
        assert core.kill_event.wait(3)
        assert time.monotonic() - start >= 0.75
        time.sleep(0.2)
        assert len(core.killed) == 1 and "was killed" in core.killed[0]
        assert core.pings >= 2  # it asked the silent core, about every ping_after
    finally:
        dog.stop()


def test_progress_keeps_a_busy_core_alive():
    core = Core()
    dog = watchdog(core)
    try:
        core.work = True
        end = time.monotonic() + 1.2
        while time.monotonic() < end:
            dog.progress()
            assert dog.stall_cause is None
            time.sleep(0.05)
        assert core.killed == []
    finally:
        dog.stop()


def test_the_kill_bound_is_at_least_the_stall_bound():
    with pytest.raises(ValueError, match="at least"):
        CoreWatchdog(5, 1, has_work=lambda: True, ping=lambda: None, kill=lambda cause: None)


def test_send_never_blocks_on_a_pipe_nobody_reads():
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    sender = CommandSender(writer)

    def send_all():  # about 2 MB: far past what the pipe buffers
        for i in range(200):
            sender.send(("add", i, b"x" * 10_000))

    caller = threading.Thread(target=send_all, daemon=True)
    caller.start()
    caller.join(2)
    blocked = caller.is_alive()
    received = [reader.recv()[1] for _ in range(200)]  # (also lets a blocked caller finish)
    assert not blocked, "send blocked on the full pipe"
    assert received == list(range(200))  # every message, in order
    sender.close(5)
    reader.close()


def test_a_batching_sender_joins_what_queued_behind_a_slow_reader_in_order_and_flushes_on_close():
    """The core's outputs: with the pipe full, the steps that queue up go as one ("batch", [...]) message once
    there is room, in order; close() writes what is still queued (a core's last "dead" message) before it ends."""
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    sender = CommandSender(writer, batch=True)
    for i in range(100):  # about 1 MB: most of it queues while the first messages fill the pipe
        sender.send(("step", i, b"x" * 10_000))
    sender.send(("dead", "the last word"))
    closing = threading.Thread(target=sender.close, args=(10,), daemon=True)
    closing.start()
    messages, batches = [], 0
    while len(messages) < 101:
        message = reader.recv()
        batches += message[0] == "batch"
        messages += message[1] if message[0] == "batch" else [message]
    closing.join(10)
    assert not closing.is_alive()
    assert [m[1] for m in messages[:100]] == list(range(100)) and messages[100] == ("dead", "the last word")
    assert batches >= 1  # what queued behind the full pipe went together
    reader.close()


def test_a_message_that_cannot_be_sent_closes_the_link_instead_of_leaving_the_reader_waiting():
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    sender = CommandSender(writer, batch=True)
    sender.send(("stats", 1, threading.Lock()))  # a lock does not pickle
    assert reader.poll(10), "the link stayed open: the reader would wait for ever"
    with pytest.raises(EOFError):
        reader.recv()
    assert sender.broken
