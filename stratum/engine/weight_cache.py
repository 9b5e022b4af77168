"""Weights derived from a checkpoint (the native step's tiles, the PyTorch path's packed and int4
copies), kept in its cache folder as two files: NAME.bin, the tensors' bytes written one entry at a time, and
NAME.json, the index written last (a cache without it is incomplete and made again).

Each entry is made, written and dropped before the next is made, so converting a model never holds
more than one entry's worth of new tensors, and the result is mapped back from the file: the
weights are pages of the cache, shared with the page cache and evictable, not memory of the process.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from stratum.kernels.kquant import mapped_tensor

log = logging.getLogger("stratum.engine")

ALIGN = 64  # each tensor's offset in the file: a cache line, and a multiple of every dtype's size


def _named(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def cached(path: Path | None, makers: Iterable[tuple[str, Callable[[], object]]]) -> dict[str, object]:
    """key -> entry, each entry a nested list of tensors and plain values (ints, strings, None).

    With a path, entries come mapped from path's files: those files when they hold every key, else
    written anew first, one entry made at a time. Without one (or where the files cannot be written)
    the entries are made in memory.
    """
    makers = list(makers)
    if path is None:
        return {key: make() for key, make in makers}
    found = read(path)
    if found is not None and all(key in found for key, _ in makers):
        return found
    try:
        with Writer(path) as w:
            for key, make in makers:
                w.put(key, make())
    except OSError as e:  # a read-only or full disk only costs the conversion at each start
        log.warning("could not write %s: %s", _named(path, ".bin"), e)
        return {key: make() for key, make in makers}
    found = read(path)
    if found is None:
        raise OSError(f"{_named(path, '.bin')} could not be read back")
    return found


class Writer:
    """Appends each entry's tensors to a file of this writer's own; `close` renames it into place and
    writes the index. Concurrent writers of the same cache each write their own file, and the last
    rename wins (they write the same bytes)."""

    def __init__(self, path: Path):
        self.path = path
        self._tmp = path.with_name(f"{path.name}.{os.getpid()}.bin.tmp")
        self._file = open(self._tmp, "wb")
        self._at = 0
        self._index: dict[str, object] = {}

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()
            self._tmp.unlink(missing_ok=True)

    def put(self, key: str, entry) -> None:
        self._index[key] = self._write(entry)

    def _write(self, value):
        if isinstance(value, torch.Tensor):
            pad = -self._at % ALIGN
            self._file.write(bytes(pad))
            t = value.detach().contiguous().reshape(-1)
            self._file.write(t.view(torch.uint8).numpy().data if t.numel() else b"")
            spec = {"at": self._at + pad, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(value.shape)}
            self._at += pad + t.numel() * t.element_size()
            return spec
        if isinstance(value, (list, tuple)):
            return [self._write(v) for v in value]
        if value is None or isinstance(value, (int, float, str)):
            return value
        raise TypeError(f"not a tensor, list or plain value: {type(value).__name__}")

    def close(self) -> None:
        self._file.close()
        os.replace(self._tmp, _named(self.path, ".bin"))
        index = self.path.with_name(f"{self.path.name}.{os.getpid()}.json.tmp")
        index.write_text(json.dumps({"bytes": self._at, "entries": self._index}))
        os.replace(index, _named(self.path, ".json"))


def read(path: Path) -> dict[str, object] | None:
    """The entries of path's files, each tensor a read-only view of the mapped .bin; None where the
    cache is missing, incomplete or unreadable."""
    try:
        index = json.loads(_named(path, ".json").read_text())
        size = os.path.getsize(_named(path, ".bin"))
        if size != index["bytes"]:
            return None
        mapped = np.memmap(_named(path, ".bin"), dtype=np.uint8, mode="r").view(np.ndarray) if size else np.empty(0, np.uint8)
    except (OSError, ValueError, KeyError, TypeError):
        return None

    def tensor(spec):
        if isinstance(spec, list):
            return [tensor(v) for v in spec]
        if not isinstance(spec, dict):
            return spec
        dtype = getattr(torch, spec["dtype"])
        n = int(np.prod(spec["shape"])) * torch.empty(0, dtype=dtype).element_size()
        return mapped_tensor(mapped[spec["at"] : spec["at"] + n]).view(dtype).reshape(spec["shape"])

    return {key: tensor(entry) for key, entry in index["entries"].items()}
