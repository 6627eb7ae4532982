"""The global server's saved parameters (leader, center, the rule's state): ``.npz`` files
written and read chunk by chunk.

The format is ``numpy.savez``'s (an uncompressed zip of ``.npy`` members, read without pickle),
so a file of either writer loads with either reader: ``np.load(path, allow_pickle=False)``
reads what ``NpzWriter`` writes, and ``NpzReader`` reads what ``np.savez`` wrote (the state
and checkpoints of earlier versions). Vectors stream between a live buffer (or another file's
member) and the file in ``CHUNK``-byte pieces: a save or a load of a 100 MB model needs no
full-size copy, only a chunk at a time.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import numpy as np

CHUNK = 4 << 20  # bytes per write or read
_FORMAT = np.lib.format


class NpzWriter:
    """Writes members to a new ``.npz`` at ``path`` (a temporary file: see ``files.atomic_path``)."""

    def __init__(self, path: str | Path) -> None:
        self._zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def vector(self, name: str, vec: np.ndarray) -> None:
        """Stream the flat contiguous ``vec`` as member ``name``, straight from its memory."""
        if vec.ndim != 1 or not vec.flags.c_contiguous:
            raise ValueError(f"{name}: a flat contiguous vector is needed, got shape {vec.shape}")
        raw = memoryview(vec).cast("B")
        with self._zip.open(f"{name}.npy", "w", force_zip64=True) as f:
            _FORMAT.write_array_header_1_0(f, _FORMAT.header_data_from_array_1_0(vec))
            for lo in range(0, raw.nbytes, CHUNK):
                f.write(raw[lo : lo + CHUNK])

    def small(self, name: str, array: np.ndarray) -> None:
        """Write a small array (flags) as member ``name``."""
        with self._zip.open(f"{name}.npy", "w", force_zip64=True) as f:
            _FORMAT.write_array(f, np.ascontiguousarray(array), allow_pickle=False)

    def copy(self, reader: "NpzReader", name: str) -> None:
        """Copy member ``name`` of another file as it is (header and data), chunk by chunk."""
        with reader.open(name) as src, self._zip.open(f"{name}.npy", "w", force_zip64=True) as dst:
            try:
                shutil.copyfileobj(src, dst, CHUNK)
            except zipfile.BadZipFile as exc:
                raise ValueError(f"{reader.path}: member '{name}' is damaged ({exc})") from None

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> "NpzWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NpzReader:
    """Reads an ``.npz`` (either writer's); every problem is a ValueError naming the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except zipfile.BadZipFile as exc:
            raise ValueError(f"{self.path}: not an .npz file ({exc})") from None

    def open(self, name: str):  # noqa: ANN201 - a zip member's file object
        try:
            return self._zip.open(f"{name}.npy")
        except KeyError:
            raise ValueError(f"{self.path}: no member '{name}'") from None

    def members(self) -> set[str]:
        """The names of the arrays in the file (without ``.npy``)."""
        return {n[:-4] for n in self._zip.namelist() if n.endswith(".npy")}

    def header(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        """(shape, dtype) of member ``name``; ValueError unless it is a plain C-order array."""
        with self.open(name) as f:
            return self._header(f, name)

    def _header(self, f, name: str) -> tuple[tuple[int, ...], np.dtype]:  # noqa: ANN001
        try:
            version = _FORMAT.read_magic(f)
            read = {(1, 0): _FORMAT.read_array_header_1_0,
                    (2, 0): _FORMAT.read_array_header_2_0}.get(version)
            if read is None:
                raise ValueError(f"npy format version {version}")
            shape, fortran, dtype = read(f)
        except (ValueError, EOFError, SyntaxError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{self.path}: member '{name}' is not a saved array ({exc})") from None
        if fortran or dtype.hasobject:
            raise ValueError(f"{self.path}: member '{name}' is not a plain array")
        return shape, dtype

    def small(self, name: str) -> np.ndarray:
        """Member ``name`` as an array (for small members: it is read whole)."""
        with self.open(name) as f:
            try:
                return _FORMAT.read_array(f, allow_pickle=False)
            except (ValueError, EOFError, zipfile.BadZipFile) as exc:
                raise ValueError(f"{self.path}: member '{name}' is unreadable ({exc})") from None

    def into(self, name: str, out: np.ndarray) -> None:
        """Read member ``name`` into ``out`` (flat, same size and dtype), chunk by chunk."""
        dst = memoryview(out).cast("B")
        with self.open(name) as f:
            shape, dtype = self._header(f, name)
            if shape != out.shape or dtype != out.dtype:
                raise ValueError(f"{self.path}: member '{name}' is {dtype}{list(shape)}, "
                                 f"expected {out.dtype}{list(out.shape)}")
            pos = 0
            try:
                while pos < dst.nbytes:
                    data = f.read(min(CHUNK, dst.nbytes - pos))
                    if not data:
                        break
                    dst[pos : pos + len(data)] = data
                    pos += len(data)
            except zipfile.BadZipFile as exc:  # a CRC that does not match: a damaged file
                raise ValueError(f"{self.path}: member '{name}' is damaged ({exc})") from None
            if pos != dst.nbytes:
                raise ValueError(f"{self.path}: member '{name}' ends after {pos} of "
                                 f"{dst.nbytes} bytes")

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> "NpzReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
