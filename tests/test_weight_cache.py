"""The derived-weights cache (engine/weight_cache.py), letting go of a mapped file's pages
(models/loader.release_pages) and the KV pool's memory (engine/model_runner._zeros)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from stratum.engine import model_runner, weight_cache
from stratum.models.loader import release_pages


def _entries(g: torch.Generator) -> dict:
    return {
        "a": [torch.randint(0, 256, (3, 5, 7), generator=g, dtype=torch.uint8), torch.randn(3, 4, generator=g).half(),
              7, None],
        "b": [[torch.randn(5, generator=g), torch.randn(2, 3, generator=g).bfloat16()], torch.zeros(4, 0), "x"],
        "c": torch.arange(9, dtype=torch.int32).view(3, 3),
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_entries_are_written_one_at_a_time_and_mapped_back(tmp_path):
    entries = _entries(torch.Generator().manual_seed(0))
    made: list[str] = []

    def maker(key):
        def make():
            made.append(key)
            return entries[key]
        return make

    path = tmp_path / "packed-1"
    got = weight_cache.cached(path, [(k, maker(k)) for k in entries])
    assert made == ["a", "b", "c"] and all(_same(entries[k], got[k]) for k in entries)
    assert (tmp_path / "packed-1.bin").exists() and (tmp_path / "packed-1.json").exists()
    assert not list(tmp_path.glob("*.tmp"))

    # a later start maps them, making nothing; every tensor a view of the mapped file
    again = weight_cache.cached(path, [(k, maker(k)) for k in entries])
    assert made == ["a", "b", "c"] and all(_same(entries[k], again[k]) for k in entries)
    assert again["c"].data_ptr() % weight_cache.ALIGN == 0

    # a key the file lacks: written anew; a cache without its index (a writer killed midway): made again
    weight_cache.cached(path, [("c", maker("c")), ("d", lambda: torch.ones(2))])
    assert made[-1] == "c" and set(weight_cache.read(path)) == {"c", "d"}
    (tmp_path / "packed-1.json").unlink()
    assert weight_cache.read(path) is None
    weight_cache.cached(path, [("a", maker("a"))])
    assert made[-1] == "a"

    # no cache folder: made in memory
    assert _same(weight_cache.cached(None, [("c", maker("c"))])["c"], entries["c"])


@pytest.mark.skipif(sys.platform != "linux", reason="reads the resident set from /proc")
def test_released_pages_leave_the_resident_set_and_read_back_the_same(tmp_path):
    def rss_file() -> int:
        status = open("/proc/self/status").read()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("RssFile:")) * 1024

    values = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    values.tofile(tmp_path / "f.bin")
    mapped = np.memmap(tmp_path / "f.bin", dtype=np.uint8, mode="r").view(np.ndarray)
    view = mapped[4096 * 3 + 5 :]
    assert int(view.sum()) == int(values[4096 * 3 + 5 :].sum())  # every page read: resident
    before = rss_file()
    release_pages(view)
    assert before - rss_file() > 48 << 20
    assert np.array_equal(view, values[4096 * 3 + 5 :])  # read again from the file

    heap = values[: 1 << 20].copy()  # not a file mapping: left alone (there madvise would zero it)
    release_pages(heap)
    assert np.array_equal(heap, values[: 1 << 20])


def _smaps_entry(address: int) -> tuple[list[str], dict[str, str]]:
    """The /proc/self/smaps entry of the mapping that holds `address`: its header's fields (range,
    permissions, offset, device, inode, path) and its `Key: value` lines."""
    entry = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
                if entry is not None:
                    return entry
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= address < hi:
                    entry = (fields, {})
            elif entry is not None:
                entry[1][fields[0].rstrip(":")] = " ".join(fields[1:])
    if entry is None:
        raise AssertionError(f"{address:#x} is in no mapping")
    return entry


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path or "" for anonymous memory) of the mapping that holds `address`."""
    fields, _ = _smaps_entry(address)
    return fields[1], fields[5] if len(fields) > 5 else ""


@pytest.mark.skipif(sys.platform != "linux", reason="reads the mappings from /proc")
def test_weights_move_onto_huge_pages_where_offered_else_stay_mapped(tmp_path, monkeypatch):
    """The tensors are views of the cache file at first; where the kernel offers transparent huge
    pages, the bytes move under them onto anonymous memory (read-only, the same bytes, the same
    addresses); with STRATUM_MAP_WEIGHTS=1 they stay views of the file."""
    entries = {"w": torch.randint(0, 256, (6 << 20,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)}
    path = tmp_path / "packed-1"
    weight_cache.cached(path, [("w", lambda: entries["w"])])
    weight_cache.wait_moves()
    file = str(tmp_path / "packed-1.bin")

    monkeypatch.setenv("STRATUM_MAP_WEIGHTS", "1")
    assert not weight_cache.huge_pages_offered()
    mapped = weight_cache.read(path)["w"]
    weight_cache.wait_moves()
    assert torch.equal(mapped, entries["w"]) and _mapping_of(mapped.data_ptr()) == ("r--s", file)

    monkeypatch.delenv("STRATUM_MAP_WEIGHTS")
    if not weight_cache.huge_pages_offered():
        pytest.skip("this kernel offers no transparent huge pages: the weights stay mapped")
    monkeypatch.setattr(weight_cache, "_MOVE_CHUNK", 2 << 20)  # three pieces, each moved on its own
    moved = weight_cache.read(path)["w"]
    address = moved.data_ptr()
    weight_cache.wait_moves()
    assert moved.data_ptr() == address and torch.equal(moved, entries["w"])
    for piece in range(3):  # anonymous, read-only as the file's mapping
        assert _mapping_of(address + piece * (2 << 20)) == ("r--p", "")
    del moved  # the mapping's own unmapping frees the moved memory


def _thp_eligible(address: int) -> bool:
    """Whether /proc/self/smaps says the mapping holding `address` may be backed by huge pages."""
    return _smaps_entry(address)[1]["THPeligible"] == "1"


@pytest.mark.skipif(sys.platform != "linux", reason="reads the mappings from /proc")
def test_kv_pool_is_zeroed_memory_advised_for_huge_pages():
    """The KV pool's memory: zeros, anonymous, and eligible for transparent huge pages where the
    kernel offers them for advised memory (attention reads every block of every context each step)."""
    pool = model_runner._zeros((3, 1 << 20), torch.float32, torch.device("cpu"))
    assert pool.shape == (3, 1 << 20) and not pool.any()
    assert _mapping_of(pool.data_ptr())[1] == ""
    if not weight_cache.huge_pages_offered():
        pytest.skip("this kernel offers no transparent huge pages for advised memory")
    assert _thp_eligible(pool.data_ptr())
    pool[1, 5] = 2.0
    assert float(pool.sum()) == 2.0
