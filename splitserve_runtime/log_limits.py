"""Rate limits on log lines a remote peer can trigger at will (malformed messages, handshakes,
servicer errors), so that a flood of bad calls cannot flood the log: at most one line per key
(e.g. per gRPC method) per interval, the next one saying how many were suppressed."""

from __future__ import annotations

import logging
import os
import threading
import time

DEFAULT_INTERVAL_S = 10.0
GRPC_LOGGERS = ("grpc._cython.cygrpc", "grpc._server", "grpc._common")


class LogRateLimit:
    """Decides, per key, whether a line may be written now (thread-safe)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, key: str) -> int | None:
        """None to suppress this line; else how many lines of `key` were suppressed since the
        last one written."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return None
            if len(self._last) > 10_000:  # keys come from a finite set; bound it anyway
                self._last.clear()
            self._last[key] = now
            return self._suppressed.pop(key, 0)


class RateLimitedLog:
    """A logger whose warnings and errors are limited per key."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.logger = logger
        self.limit = LogRateLimit(interval_s)

    def warning(self, key: str, message: str, *args: object) -> None:
        self._log(logging.WARNING, key, message, args)

    def exception(self, key: str, message: str, *args: object) -> None:
        """An error with the traceback of the exception being handled."""
        self._log(logging.ERROR, key, message, args, exc_info=True)

    def _log(
        self, level: int, key: str, message: str, args: tuple[object, ...], exc_info: bool = False
    ) -> None:
        suppressed = self.limit.admit(key)
        if suppressed is None:
            return
        if suppressed:
            message += " (%d more like it in the last %.0f s not logged)"
            args = (*args, suppressed, self.limit.interval_s)
        self.logger.log(level, message, *args, exc_info=exc_info)


class RepeatFilter(logging.Filter):
    """Drops a record whose first line (which for grpc's servicer errors names the method) was
    logged less than `interval_s` ago; the next one kept notes how many were dropped."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        self.limit = LogRateLimit(interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.getMessage().splitlines()[0][:200] if record.msg else ''}"
        suppressed = self.limit.admit(key)
        if suppressed is None:
            return False
        if suppressed:
            record.msg = f"{record.getMessage()} ({suppressed} more like it not logged)"
            record.args = None
        return True


def limit_grpc_logs(interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Rate-limit what grpc's own loggers write (idempotent)."""
    for name in GRPC_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(RepeatFilter(interval_s))


def quiet_grpc_core_logs() -> None:
    """gRPC's C core logs every failed TLS handshake (one line per plaintext or foreign
    connection attempt: a flood anyone can cause) unless GRPC_VERBOSITY is ERROR. Call before
    grpc is first imported; an explicit GRPC_VERBOSITY wins."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
