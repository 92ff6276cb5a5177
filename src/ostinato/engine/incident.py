"""A step failure as clients see it: a generic message and an incident id, never the exception's text.

An exception's text can hold anything (a path, a tensor's contents, a prompt), and it would reach every
stream's error event and the unauthenticated /health. So the traceback goes to the log only, on a line that
carries the incident id, and clients get the id to quote to the operator.
"""

from __future__ import annotations

import logging
import uuid


def report_step_failure(log: logging.Logger, what: str) -> str:
    """Log the exception being handled, with its traceback, under a fresh incident id; return the public cause.

    Call it from inside the `except` block, so the log line carries the traceback.
    """
    incident = uuid.uuid4().hex[:16]
    log.exception("%s (incident %s); the engine stops serving", what, incident)
    return f"{what} (incident {incident}); the details are in the server log"
