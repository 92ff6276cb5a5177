"""The engine core process logs as the front process does.

A spawned process starts with no logging set up, which drops every INFO line of the engine's start-up (KV size,
cache, captured graphs); the front hands its level and line format to the core, which writes to the stderr both
share.
"""

from __future__ import annotations

import logging


def parent_logging() -> tuple[int, logging.Formatter | None]:
    """The front process's log level and line format, for the core to log as the front does. Only a plain
    Formatter travels: `spawn` pickles it, and subclasses (a test runner's, a colouring one) may not pickle."""
    root = logging.getLogger()
    return root.level, next((h.formatter for h in root.handlers if type(h.formatter) is logging.Formatter), None)


def log_like_the_front(level: int, formatter: logging.Formatter | None) -> None:
    """Log at `level` to stderr, in `formatter`'s format (Python's default where None)."""
    handler = logging.StreamHandler()
    if formatter is not None:
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
