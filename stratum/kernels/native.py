"""Native CPU kernels (csrc/), compiled for this machine on first use and cached under $STRATUM_HOME.

The build runs once per machine, source and torch version (about half a minute; later starts load the
cached library). Without a C++ compiler, or with STRATUM_NATIVE=0, `available()` is False and the
layers keep their PyTorch paths, which compute the same thing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from stratum.home import stratum_home
from stratum.kernels.cpu import cpu_flags, cpu_name

log = logging.getLogger("stratum.native")

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention.cpp", "q8_linear.cpp", "rotary_cache.cpp", "packed_step.cpp")]
_state: dict[str, object] = {}


def build_dir(home: Path) -> Path:
    """One folder per source text, torch version and CPU: the library is built with -march=native."""
    key = hashlib.sha256()
    for path in SOURCES:
        key.update(path.read_bytes())
    key.update(f"{torch.__version__}|{platform.machine()}|{cpu_name()}|{sorted(cpu_flags())}".encode())
    return home / "kernels" / f"native-{key.hexdigest()[:16]}"


def available() -> bool:
    """Load (building if needed) the native library once per process."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return bool(_state["ok"])


def status() -> str:
    """"loaded", "disabled", or why the build failed: for `stratum info` and the kernel choices."""
    available()
    return str(_state.get("status", "not loaded"))


def _load() -> bool:
    if os.environ.get("STRATUM_NATIVE", "1") == "0":
        _state["status"] = "disabled (STRATUM_NATIVE=0)"
        return False
    from torch.utils.cpp_extension import load

    directory = build_dir(stratum_home())
    directory.mkdir(parents=True, exist_ok=True)
    try:
        load(
            name="stratum_native",
            sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch paths remain
        _state["status"] = f"unavailable: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("native kernels %s", _state["status"])
        return False
    _state["status"] = "loaded"
    return True
