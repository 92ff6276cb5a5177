"""Runs the engine core's loop (engine/core_loop.core_main) in the test's own process and thread."""

import signal

from ostinato.engine import core_loop


def run_core_main(factory, args, commands, events) -> None:
    """core_main(factory, args, commands, events) until its commands end it. The core ignores Ctrl-C (the front
    handles it); pytest's SIGINT handler is put back afterwards."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        core_loop.core_main(factory, args, commands, events)
    finally:
        signal.signal(signal.SIGINT, previous)
