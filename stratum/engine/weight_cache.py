"""Weights derived from a checkpoint (the native step's tiles, the PyTorch path's packed and int4
copies), kept in its cache folder as two files: NAME.bin, the tensors' bytes written one entry at a time, and
NAME.json, the index written last (a cache without it is incomplete and made again).

Each entry is made, written and dropped before the next is made, so converting a model never holds
more than one entry's worth of new tensors, and the result is read back from the file.

Read back as a mapping of the .bin, then, where the kernel offers transparent huge pages (`always`
or `madvise`), moved onto them in the background: the bytes copied into anonymous memory on 2 MB
pages and that memory moved over the mapping's addresses, so the tensors never change. A decode step
streams every weight once, and two cores read memory on 2 MB pages at 36-38 GB/s against 27-34 GB/s
on the page cache's 4 KB ones (the hardware prefetchers stop at each 4 KB page; Zen 3, measured): a
one-stream step of the 1 B Q4_K_M took 0-10% less, ~5% in the median (interleaved pairs: 0.90 and
0.93 in one process; 0.95 over seven pairs of processes, from 0.89 to 1.01: the step draws less of
the bandwidth than a plain read does). Making the pages takes ~0.8 s for 680 MB in a fresh
process (in a VM, memory the host has not backed yet), which a start made before serving; in the
background it costs the start nothing. With STRATUM_MAP_WEIGHTS=1 (or no huge pages) the weights stay
pages of the cache file, shared with the page cache and with every process serving the same file
(several replicas on one machine hold one copy), and evictable.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from stratum.kernels.kquant import mapped_tensor

log = logging.getLogger("stratum.engine")

ALIGN = 64  # each tensor's offset in the file: a cache line, and a multiple of every dtype's size
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_HUGE = 2 << 20
_MOVE_CHUNK = 16 * _HUGE  # 32 MB
_moves: list[threading.Thread] = []  # moves onto huge pages under way (`wait_moves`)


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


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = libc.mremap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    for name in ("madvise", "mprotect"):
        getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _aligned_anonymous(libc: ctypes.CDLL, size: int) -> int | None:
    """The address of `size` bytes of anonymous memory starting on a 2 MB boundary (the kernel aligns
    only lengths that are multiples of 2 MB): 2 MB more mapped, the ends left over unmapped."""
    span = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    addr = libc.mmap(None, span + _HUGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    start = -(-addr // _HUGE) * _HUGE
    if start > addr:
        libc.munmap(addr, start - addr)
    libc.munmap(start + span, addr + _HUGE - start)
    return start


def _move_onto_huge_pages(mapped: np.memmap) -> None:
    """The mapping's bytes moved onto anonymous memory on huge pages, 32 MB at a time: each piece
    copied, made read-only and moved over its own addresses in the mapping (mremap), so every tensor
    over it reads the copy from then on. The bytes are the same, so a step that runs meanwhile reads
    the same values on either side of a move; a piece at a time, the process never holds both copies
    of more than one piece (a start's peak memory grows by the weights once, not twice); where the
    kernel refuses any part, the rest stays mapped. `mapped` is held until the move is done, so its
    range cannot be unmapped and reused before."""
    libc, size, target = _libc(), mapped.size, mapped.ctypes.data
    if target % _HUGE:
        return  # moved to an address off a 2 MB boundary, the huge pages would be split
    addr = _aligned_anonymous(libc, size)
    if addr is None:
        return
    done = 0
    try:
        if libc.madvise(addr, size, mmap.MADV_HUGEPAGE) != 0:
            return
        for at in range(0, size, _MOVE_CHUNK):  # in pieces, too: making pages holds the process's memory
            n = min(_MOVE_CHUNK, size - at)     # map lock, which the engine's own allocations wait for
            libc.madvise(addr + at, n, _MADV_POPULATE_WRITE)  # made at once (else faulted in by the copy)
            ctypes.memmove(addr + at, target + at, n)
            if (libc.mprotect(addr + at, n, mmap.PROT_READ) != 0
                    or libc.mremap(addr + at, n, n, _MREMAP_MAYMOVE | _MREMAP_FIXED, target + at) != target + at):
                return
            done = at + n
    finally:
        if done < size:
            libc.munmap(addr + done, size - done)


def wait_moves() -> None:
    """Returns once every move onto huge pages started so far is done (benchmarks measure after it)."""
    for thread in list(_moves):
        thread.join()
        if thread in _moves:
            _moves.remove(thread)


def read(path: Path) -> dict[str, object] | None:
    """The entries of path's files, each tensor a read-only view of the mapped .bin, moved onto huge
    pages in the background where offered (module docstring); None where the cache is missing,
    incomplete or unreadable."""
    try:
        index = json.loads(_named(path, ".json").read_text())
        file = _named(path, ".bin")
        size = os.path.getsize(file)
        if size != index["bytes"]:
            return None
        mapped = np.memmap(file, dtype=np.uint8, mode="r") if size else None
        data = mapped.view(np.ndarray) if mapped is not None else np.empty(0, np.uint8)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if mapped is not None and size >= _HUGE and huge_pages_offered():  # serving starts on the mapping meanwhile
        thread = threading.Thread(target=_move_onto_huge_pages, args=(mapped,), name="weights-onto-huge-pages",
                                  daemon=True)
        _moves.append(thread)
        thread.start()

    def tensor(spec):
        if isinstance(spec, list):
            return [tensor(v) for v in spec]
        if not isinstance(spec, dict):
            return spec
        dtype = getattr(torch, spec["dtype"])
        n = int(np.prod(spec["shape"])) * torch.empty(0, dtype=dtype).element_size()
        return mapped_tensor(data[spec["at"] : spec["at"] + n]).view(dtype).reshape(spec["shape"])

    return {key: tensor(entry) for key, entry in index["entries"].items()}
