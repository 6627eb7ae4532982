"""In-place, chunked numpy kernels over flat float32 vectors.

Every function works on cache-sized slices so that no full-size temporary is ever allocated,
whatever the model size (``reference/limits.md``: chunked in-place pulls run ~2x faster than
``out=`` over the whole vector and ~3x faster than the naive expression).
"""

from __future__ import annotations

import math
import mmap

import numpy as np

CHUNK = 1 << 18  # 256K float32 elements = 1 MiB per slice
WIRE_FORMATS = ("float32", "bfloat16")  # encodings of parameter chunks on the wire


def _check(x: np.ndarray, other: np.ndarray) -> None:
    if x.shape != other.shape or x.ndim != 1:
        raise ValueError(f"expected two flat vectors of one length, got {x.shape} and {other.shape}")


def pull_toward_(x: np.ndarray, target: np.ndarray, strength: float, chunk: int = CHUNK) -> float:
    """Move ``x`` toward ``target`` in place: ``x <- x - strength * (x - target)``.

    Args:
        x: flat float32 vector, modified in place.
        target: flat float32 vector of the same length (not modified).
        strength: pulling strength in [0, 1]; 0 leaves ``x`` untouched.
        chunk: elements per slice.

    Returns:
        The L2 distance ``||x - target||`` before the pull.
    """
    _check(x, target)
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"pulling strength must be in [0, 1], got {strength}")
    s = np.float32(strength)
    scratch = np.empty(min(chunk, x.size), dtype=x.dtype)
    sq = 0.0
    for lo in range(0, x.size, chunk):
        hi = min(lo + chunk, x.size)
        d = scratch[: hi - lo]
        np.subtract(x[lo:hi], target[lo:hi], out=d)  # d = x - target
        sq += float(np.dot(d, d))
        if s:
            d *= s
            np.subtract(x[lo:hi], d, out=x[lo:hi])
    return math.sqrt(sq)


def copy_(dst: np.ndarray, src: np.ndarray, chunk: int = CHUNK) -> None:
    """Copy ``src`` into ``dst`` slice by slice."""
    _check(dst, src)
    for lo in range(0, dst.size, chunk):
        hi = min(lo + chunk, dst.size)
        dst[lo:hi] = src[lo:hi]


def sum_into_(out: np.ndarray, vectors: list[np.ndarray], chunk: int = CHUNK) -> None:
    """Write the element-wise sum of ``vectors`` into ``out`` (no temporaries)."""
    if not vectors:
        raise ValueError("sum_into_ needs at least one vector")
    for v in vectors:
        _check(out, v)
    for lo in range(0, out.size, chunk):
        hi = min(lo + chunk, out.size)
        o = out[lo:hi]
        o[...] = vectors[0][lo:hi]
        for v in vectors[1:]:
            o += v[lo:hi]


def scale_(x: np.ndarray, factor: float, chunk: int = CHUNK) -> None:
    """Multiply ``x`` by ``factor`` in place."""
    f = np.float32(factor)
    for lo in range(0, x.size, chunk):
        x[lo : lo + chunk] *= f


def elastic_center_(center: np.ndarray, total: np.ndarray, count: int, beta: float,
                    chunk: int = CHUNK) -> None:
    """EASGD center move in place: ``center <- center + beta * (total / count - center)``.

    Args:
        center: the center variable, modified in place.
        total: sum of the participants' parameter vectors (values from before their pull).
        count: number of vectors summed in ``total``.
        beta: moving rate in [0, 1].
    """
    _check(center, total)
    if count < 1:
        raise ValueError("elastic_center_ needs at least one participant")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    inv, b = np.float32(1.0 / count), np.float32(beta)
    scratch = np.empty(min(chunk, center.size), dtype=center.dtype)
    for lo in range(0, center.size, chunk):
        hi = min(lo + chunk, center.size)
        d = scratch[: hi - lo]
        np.multiply(total[lo:hi], inv, out=d)  # mean
        d -= center[lo:hi]
        d *= b
        center[lo:hi] += d


def all_finite(x: np.ndarray, chunk: int = CHUNK) -> bool:
    """True when every element of ``x`` is finite (checked slice by slice)."""
    for lo in range(0, x.size, chunk):
        if not np.isfinite(x[lo : lo + chunk]).all():
            return False
    return True


# ---------------------------------------------------------------------- wire formats, buffers
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
