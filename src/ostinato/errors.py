"""Typed, user-facing errors. Each message says what to change.

Anything a user can cause (a bad flag, a bad request, a checkpoint we cannot read) raises one of these;
`assert` is kept for internal invariants only. The server maps them to HTTP status codes.
"""


class OstinatoError(Exception):
    """Base class of every error ostinato raises on purpose."""


class InvalidRequestError(OstinatoError, ValueError):
    """A request (prompt or sampling parameters) that can never be served as given. HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class CheckpointError(OstinatoError):
    """A model folder that cannot be loaded: missing file, unsupported architecture, bad tensor."""


class ConfigError(OstinatoError, ValueError):
    """Engine arguments that contradict each other or the hardware."""


class OutOfKVCacheError(OstinatoError):
    """The KV cache is too small for what was asked (e.g. one sequence at max_model_len)."""


class CudaGraphCaptureError(OstinatoError):
    """Capturing or checking a CUDA graph failed; start-up stops unless eager fallback was chosen."""


class QueueFullError(OstinatoError):
    """The waiting queue is at --max-queued-requests. HTTP 429/503 with Retry-After."""


class EngineDeadError(OstinatoError):
    """The engine stopped (a step raised, start-up failed, or it was shut down); restart the server."""


class EngineNotReadyError(OstinatoError):
    """The engine is still loading; retry once it is ready."""


class TensorParallelError(OstinatoError):
    """A tensor-parallel rank failed (its cause is in the message); every rank was stopped."""
