"""In-place, chunked numpy kernels over flat float32 vectors.

Every function works on cache-sized slices so that no full-size temporary is ever allocated,
whatever the model size (``reference/limits.md``: chunked in-place pulls run ~2x faster than
``out=`` over the whole vector and ~3x faster than the naive expression).
"""

from __future__ import annotations

import math

import numpy as np

CHUNK = 1 << 18  # 256K float32 elements = 1 MiB per slice


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
        if s == 1:  # replace: exactly the target, not x - (x - target) rounded
            x[lo:hi] = target[lo:hi]
        elif s:
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


def weighted_sum_into_(out: np.ndarray, vectors: list[np.ndarray], weights: list[float],
                       chunk: int = CHUNK) -> None:
    """Write ``sum_i weights[i] * vectors[i]`` into ``out`` (no full-size temporaries)."""
    if not vectors or len(vectors) != len(weights):
        raise ValueError("weighted_sum_into_ needs one weight per vector, and a vector")
    if all(w == 1.0 for w in weights):
        return sum_into_(out, vectors, chunk)
    for v in vectors:
        _check(out, v)
    ws = [np.float32(w) for w in weights]
    scratch = np.empty(min(chunk, out.size), dtype=out.dtype)
    for lo in range(0, out.size, chunk):
        hi = min(lo + chunk, out.size)
        o, t = out[lo:hi], scratch[: hi - lo]
        np.multiply(vectors[0][lo:hi], ws[0], out=o)
        for v, w in zip(vectors[1:], ws[1:]):
            np.multiply(v[lo:hi], w, out=t)
            o += t


def mean_into_(out: np.ndarray, total: np.ndarray, weight: float, chunk: int = CHUNK) -> None:
    """``out <- total / weight`` slice by slice (``out`` may be ``total``)."""
    _check(out, total)
    if not weight > 0:
        raise ValueError(f"mean_into_ needs a positive weight, got {weight}")
    inv = np.float32(1.0 / weight)
    for lo in range(0, out.size, chunk):
        np.multiply(total[lo : lo + chunk], inv, out=out[lo : lo + chunk])


def scale_(x: np.ndarray, factor: float, chunk: int = CHUNK) -> None:
    """Multiply ``x`` by ``factor`` in place."""
    f = np.float32(factor)
    for lo in range(0, x.size, chunk):
        x[lo : lo + chunk] *= f


def elastic_center_(center: np.ndarray, total: np.ndarray, count: float, beta: float,
                    chunk: int = CHUNK) -> None:
    """EASGD center move in place: ``center <- center + beta * (total / count - center)``.

    Args:
        center: the center variable, modified in place.
        total: sum of the participants' parameter vectors (values from before their pull).
        count: number of vectors summed in ``total`` (their total weight, for a weighted sum).
        beta: moving rate in [0, 1].
    """
    _check(center, total)
    if not count > 0:
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


def elastic_exchange_(x: np.ndarray, center: np.ndarray, outbox: np.ndarray, alpha: float,
                      chunk: int = CHUNK) -> float:
    """Asynchronous EASGD exchange in place: ``d = alpha (x - center)``, ``x -= d``,
    ``center += d``, ``outbox += d``. Returns ``||x - center||`` before."""
    _check(x, center)
    _check(x, outbox)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    a = np.float32(alpha)
    scratch = np.empty(min(chunk, x.size), dtype=x.dtype)
    sq = 0.0
    for lo in range(0, x.size, chunk):
        hi = min(lo + chunk, x.size)
        d = scratch[: hi - lo]
        np.subtract(x[lo:hi], center[lo:hi], out=d)
        sq += float(np.dot(d, d))
        d *= a
        x[lo:hi] -= d
        center[lo:hi] += d
        outbox[lo:hi] += d
    return math.sqrt(sq)


def push_delta_(x: np.ndarray, ref: np.ndarray, center: np.ndarray, outbox: np.ndarray,
                scale: float = 1.0, chunk: int = CHUNK) -> None:
    """DOWNPOUR push in place: ``d = scale (x - ref)``, ``center += d``, ``outbox += d``,
    ``ref = x``."""
    for other in (ref, center, outbox):
        _check(x, other)
    s = np.float32(scale)
    scratch = np.empty(min(chunk, x.size), dtype=x.dtype)
    for lo in range(0, x.size, chunk):
        hi = min(lo + chunk, x.size)
        d = scratch[: hi - lo]
        np.subtract(x[lo:hi], ref[lo:hi], out=d)
        if s != 1:
            d *= s
        center[lo:hi] += d
        outbox[lo:hi] += d
        ref[lo:hi] = x[lo:hi]


def all_finite(x: np.ndarray, chunk: int = CHUNK) -> bool:
    """True when every element of ``x`` is finite (checked slice by slice)."""
    for lo in range(0, x.size, chunk):
        if not np.isfinite(x[lo : lo + chunk]).all():
            return False
    return True


def fingerprint(x: np.ndarray, chunk: int = CHUNK) -> int:
    """A checksum of a flat float32 vector: the sum of its bytes taken as 64-bit words (mod 2**64).

    Equal contents give equal fingerprints; a change to any one element always changes it
    (several changes could cancel out, which real training never arranges). Runs at memory
    speed with no temporary.
    """
    return finite_fingerprint(x, chunk, finite=False)[1]


def finite_fingerprint(x: np.ndarray, chunk: int = CHUNK, finite: bool = True) -> tuple[bool, int]:
    """``all_finite(x)`` and ``fingerprint(x)`` in one pass (each slice read once, from cache)."""
    if x.dtype != np.float32 or x.ndim != 1:
        raise ValueError(f"expected a flat float32 vector, got {x.dtype} of shape {x.shape}")
    chunk += chunk & 1  # slices start at even offsets: whole 64-bit words
    ok, total = True, 0
    for lo in range(0, x.size, chunk):
        c = x[lo : lo + chunk]
        if finite and ok:
            ok = bool(np.isfinite(c).all())
        even = c.size & ~1
        if even:
            total += int(np.add.reduce(c[:even].view(np.uint64)))  # wraps modulo 2**64
        if even != c.size:
            total += int(c[even:].view(np.uint32)[0])
    return ok, total & 0xFFFF_FFFF_FFFF_FFFF


def merge_(x: np.ndarray, weight: float, mail: np.ndarray, mail_weight: float,
           chunk: int = CHUNK) -> float:
    """Push-sum merge in place: ``x <- (weight * x + mail) / (weight + mail_weight)``, where
    ``mail`` is a sum of ``w_k * x_k`` of total weight ``mail_weight``. Returns the distance
    ``||x - mail / mail_weight||`` before."""
    _check(x, mail)
    if not (weight > 0 and mail_weight > 0):
        raise ValueError(f"merge needs positive weights, got {weight} and {mail_weight}")
    a = np.float32(weight / (weight + mail_weight))
    b = np.float32(1.0 / (weight + mail_weight))
    inv = np.float32(1.0 / mail_weight)
    scratch = np.empty(min(chunk, x.size), dtype=x.dtype)
    sq = 0.0
    for lo in range(0, x.size, chunk):
        hi = min(lo + chunk, x.size)
        d = scratch[: hi - lo]
        np.multiply(mail[lo:hi], inv, out=d)  # the mail's mean
        np.subtract(x[lo:hi], d, out=d)
        sq += float(np.dot(d, d))
        x[lo:hi] *= a
        np.multiply(mail[lo:hi], b, out=d)
        x[lo:hi] += d
    return math.sqrt(sq)
