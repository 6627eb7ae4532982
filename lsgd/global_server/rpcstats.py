"""Counts for ``/metrics``: failed calls by method and status code, parameter bytes moved.

``RpcStats.interceptor`` is the outermost interceptor of the global server, so it sees every
refusal: a missing signature (UNAUTHENTICATED), a full server (RESOURCE_EXHAUSTED) and the
servicer's own answers (INVALID_ARGUMENT, FAILED_PRECONDITION, ...). A call that succeeds
costs one ``try`` and nothing else; a failed one takes a lock to count. The health and
reflection services pass through untouched (their handlers stay as grpc built them).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

import grpc

from ..security import UNSIGNED_SERVICES



class RpcStats:
    """Failed calls (``errors[(method, code)]``) and parameter bytes (``bytes_in``/``bytes_out``)."""

    def __init__(self) -> None:
        self.errors: Counter[tuple[str, str]] = Counter()
        self.bytes_in = 0  # parameter data received (uploads)
        self.bytes_out = 0  # parameter data sent (downloads)
        self._lock = threading.Lock()
        self.interceptor = _ErrorCounter(self)

    def moved(self, received: int = 0, sent: int = 0) -> None:
        """Count the data bytes of one parameter stream (once, when it ends)."""
        with self._lock:
            self.bytes_in += received
            self.bytes_out += sent

    def failed(self, method: str, context: grpc.ServicerContext) -> None:
        code = context.code() if hasattr(context, "code") else None
        self.count(method, code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN")

    def count(self, method: str, code: str) -> None:
        """Count a failed call (a call refused on a ``Session`` stream, which goes on)."""
        with self._lock:
            self.errors[(method, code)] += 1

    def copy(self) -> tuple[dict[tuple[str, str], int], int, int]:
        with self._lock:
            return dict(self.errors), self.bytes_in, self.bytes_out


class _ErrorCounter(grpc.ServerInterceptor):
    def __init__(self, stats: RpcStats) -> None:
        self.stats = stats

    def intercept_service(self, continuation, details):  # noqa: ANN001 - grpc API
        handler = continuation(details)
        method = details.method if isinstance(details.method, str) else details.method.decode()
        if handler is None or method.startswith(UNSIGNED_SERVICES):
            return handler
        name = method.rsplit("/", 1)[-1]
        failed = self.stats.failed
        if handler.response_streaming:
            inner: Callable = handler.stream_stream or handler.unary_stream

            def streaming(request, context):  # noqa: ANN001 - grpc API
                try:
                    yield from inner(request, context)
                except Exception:
                    failed(name, context)
                    raise

            kind = "stream_stream" if handler.request_streaming else "unary_stream"
            return handler._replace(**{kind: streaming})
        inner = handler.stream_unary or handler.unary_unary

        def unary(request, context):  # noqa: ANN001 - grpc API
            try:
                return inner(request, context)
            except Exception:
                failed(name, context)
                raise

        kind = "stream_unary" if handler.request_streaming else "unary_unary"
        return handler._replace(**{kind: unary})

