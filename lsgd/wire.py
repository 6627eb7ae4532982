"""How parameter chunks travel: wire encodings, gRPC limits and keepalive, transfer buffers.

Used by both ends of a parameter stream (``lsgd/local_server/global_client.py`` and
``lsgd/global_server/params.py``); see ``bench/params.py`` for the measurements behind them.
"""

from __future__ import annotations

import mmap

import numpy as np

WIRE_FORMATS = ("float32", "bfloat16")  # encodings of parameter chunks on the wire

MAX_MESSAGE = 8 * 1024 * 1024  # bytes; parameter chunks are at most 4 MiB (512 KiB by default)
SMALL_VECTOR = 1 << 20  # bytes on the wire: a smaller vector moves whole on a Session stream
# gRPC options both ends use: message limits and keepalive (a dead peer is seen in ~15 s even
# between calls; nodes also send heartbeats every second).
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # a channel whose server was away tries again within 2 s once it is back (gRPC's default
    # backoff grows to 120 s: a node would sit out a healed partition for minutes)
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def varint(v: int) -> bytes:
    """Protobuf base-128 varint (``v`` >= 0): for messages encoded around a large bytes
    field that is not copied through protobuf."""
    if v < 0x80:
        return bytes((v,))
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def wire_dtype(wire: str) -> np.dtype:
    """The numpy dtype of a wire format's chunk elements (little-endian).

    ``"bfloat16"`` needs the optional ``ml_dtypes`` package (``pip install 'lsgd[bf16]'``),
    imported only when that format is asked for.
    """
    if wire == "float32":
        return np.dtype("<f4")
    if wire == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError("the bfloat16 wire format needs the optional ml_dtypes package: "
                              "pip install 'lsgd[bf16]' (or 'ml_dtypes>=0.4')") from None
        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"unknown wire format {wire!r}; choose one of {', '.join(WIRE_FORMATS)}")


_HEAP_STEADY = False


def steady_heap() -> None:
    """Keep the chunk-sized buffers of parameter streams in malloc's heap (once per process).

    Every chunk of an upload or download passes through a few short-lived buffers of its size
    (Python bytes, protobuf arenas, gRPC slices). glibc serves requests above a moving threshold
    (128 KiB at start) with fresh mmaps and gives the heap's free top back beyond twice that
    threshold, so those buffers kept coming back as fresh pages: 45-70 thousand minor page
    faults, about 0.1 s, per 100 MB transferred (``bench/params.py``). Fixed thresholds keep
    them in the heap and reuse the same pages: requests below 8 MiB come from the heap, and up
    to 32 MiB of free heap top is kept. Process-wide; a no-op where malloc is not glibc's.
    """
    global _HEAP_STEADY
    if _HEAP_STEADY:
        return
    _HEAP_STEADY = True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return
    del gnu_get_libc_version
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 8 << 20)
    mallopt(m_trim_threshold, 32 << 20)


def aligned_empty(count: int, dtype: "np.dtype | str" = np.float32) -> np.ndarray:
    """An uninitialised vector that starts on a page boundary (a private anonymous mapping).

    Staging buffers are page aligned because copies between a page-aligned vector (shared
    memory) and one that starts a few bytes into a page run several times slower.
    """
    dt = np.dtype(dtype)
    buf = mmap.mmap(-1, max(1, count * dt.itemsize))
    return np.frombuffer(buf, dtype=dt, count=count)
