"""Weights derived from a checkpoint (the native step's tiles, the PyTorch path's packed and int4
copies), kept in its cache folder as two files: NAME.bin, the tensors' bytes written one entry at a time, and
NAME.json, the index written last (a cache without it is incomplete and made again).

Each entry is made, written and dropped before the next is made, so converting a model never holds
more than one entry's worth of new tensors, and the result is read back from the file.

Read back into the process's memory, on huge pages where the kernel offers them (transparent huge
pages, `always` or `madvise`): a decode step streams every weight once, and two cores read a buffer
on 2 MB pages at 36-38 GB/s against 27-34 GB/s on the page cache's 4 KB ones (the hardware
prefetchers stop at each 4 KB page; Zen 3, measured), so a one-stream step of the 1 B Q4_K_M took
5-10% less (the median of interleaved pairs: 0.90 and 0.93 in one process, 0.93 over four pairs of
processes). The pages are made at load: ~0.8 s for 680 MB in a fresh process (the kernel compacts
memory for them), against a mapping's lazy faults. Elsewhere, or with
STRATUM_MAP_WEIGHTS=1, the weights stay pages of the cache file, shared with the page cache and with
every process serving the same file (several replicas on one machine hold one copy), and evictable.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
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

    With a path, entries come read from path's files: those files when they hold every key, else
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


def huge_pages_offered() -> bool:
    """Whether weights are read into memory advised for huge pages (module docstring): the kernel's
    transparent huge pages are on for such memory, and STRATUM_MAP_WEIGHTS does not ask for the mapping."""
    if os.environ.get("STRATUM_MAP_WEIGHTS", "0") not in ("", "0") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def huge_buffer(size: int) -> mmap.mmap | None:
    """`size` bytes of anonymous memory advised for huge pages, its pages made; None where the kernel
    refuses the advice. Weights are read into one; `stratum bench roofline` reads its bandwidth from
    one, the memory the weights are on."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        buf.close()
        return None
    try:  # its pages made at once: a read faulting them in one by one took 5x as long (0.93 vs 0.18 s for 680 MB)
        buf.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))  # Linux 5.14+
    except OSError:
        pass
    return buf


def _resident(file: Path, size: int) -> np.ndarray | None:
    """The file's bytes in memory on huge pages (`huge_buffer`), read-only; None where there is none."""
    buf = huge_buffer(size)
    if buf is None:
        return None
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        done = 0
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{file}: ended after {done} of {size} bytes")
            done += n
    view.release()
    out = np.frombuffer(buf, dtype=np.uint8)  # holds buf: the memory lives as long as a tensor over it
    out.flags.writeable = False
    _read_only(out.ctypes.data, size)
    return out


def _read_only(address: int, size: int) -> None:
    """Pages no write reaches, as the file's read-only mapping (a tensor over them takes writes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(address, size, mmap.PROT_READ) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")


def read(path: Path) -> dict[str, object] | None:
    """The entries of path's files, each tensor a read-only view of the .bin's bytes, in memory on huge
    pages or mapped (module docstring); None where the cache is missing, incomplete or unreadable."""
    try:
        index = json.loads(_named(path, ".json").read_text())
        file = _named(path, ".bin")
        size = os.path.getsize(file)
        if size != index["bytes"]:
            return None
        data = _resident(file, size) if size and huge_pages_offered() else None
        if data is None:
            data = np.memmap(file, dtype=np.uint8, mode="r").view(np.ndarray) if size else np.empty(0, np.uint8)
    except (OSError, ValueError, KeyError, TypeError):
        return None

    def tensor(spec):
        if isinstance(spec, list):
            return [tensor(v) for v in spec]
        if not isinstance(spec, dict):
            return spec
        dtype = getattr(torch, spec["dtype"])
        n = int(np.prod(spec["shape"])) * torch.empty(0, dtype=dtype).element_size()
        return mapped_tensor(data[spec["at"] : spec["at"] + n]).view(dtype).reshape(spec["shape"])

    return {key: tensor(entry) for key, entry in index["entries"].items()}
