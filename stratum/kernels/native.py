"""Native CPU kernels (csrc/), compiled for this machine on first use and cached under $STRATUM_HOME.

Two libraries: the native step (packed_step.cpp over csrc/step/, the whole forward on the GGUF
blocks; repack.cpp, the blocks into its tiles) and the PyTorch path's kernels (paged attention,
rotary). Each is built once per machine, source, flags and torch version (`stratum pull` builds
them ahead; later starts load the cached copies). They are compiled for this CPU (-march=native,
or $STRATUM_MARCH, e.g. "haswell" to build what an AVX2-only machine would run), and the native
step picks its instructions from what the compiler was told the CPU has (`simd_path()`). Without a
C++ compiler, or with STRATUM_NATIVE=0, `available()` is False and the layers keep their PyTorch
paths, which compute the same thing.

Flags: the PyTorch path's kernels use -ffast-math (a vector exp; each row's arithmetic is still the
same whatever the batch, since a row's code path never depends on the rows beside it). The native
step is compiled without it and with -ffp-contract=off (and -fno-trapping-math, which changes no
result), so its results do not depend on the instruction set either: see csrc/step/numerics.h and docs/kernels.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from stratum.home import stratum_home
from stratum.kernels.cpu import cpu_flags, cpu_name

log = logging.getLogger("stratum.native")

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class Library:
    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...]
    headers: str = ""  # a folder under csrc/ whose headers the sources include (part of the build's key)

    def files(self) -> list[Path]:
        """Every file the build reads, in a fixed order."""
        headers = sorted((CSRC / self.headers).glob("*.h")) if self.headers else []
        return [CSRC / s for s in self.sources] + headers


# -fno-trapping-math: without it GCC keeps exp_fp32's clamps as branches and leaves attention's softmax
# and SwiGLU scalar (a third of a 2,048-token prefill, 40% of a decode step at that context); it changes
# no rounding and no order of operations (no reassociation, no contraction), so the bits stay the same.
STEP = Library("stratum_step", ("packed_step.cpp", "repack.cpp"),
               ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"), "step")
KERNELS = Library("stratum_native", ("paged_attention.cpp", "rotary_cache.cpp"),
                  ("-O3", "-ffast-math", "-fopenmp"))
LIBRARIES = (STEP, KERNELS)
_state: dict[str, object] = {}


def march() -> str:
    """The -march the libraries are built for: $STRATUM_MARCH, else "native"."""
    return os.environ.get("STRATUM_MARCH", "").strip() or "native"


def build_dir(home: Path, lib: Library = STEP) -> Path:
    """One folder per library source text, flags, -march, torch version and CPU."""
    arch = march()
    key = hashlib.sha256()
    for path in lib.files():
        key.update(path.read_bytes())
    key.update(f"{lib.cflags}|{arch}|{torch.__version__}|{platform.machine()}|{cpu_name()}|{sorted(cpu_flags())}".encode())
    return home / "kernels" / f"{lib.name}-{arch}-{key.hexdigest()[:16]}"


def build(lib: Library, directory: Path) -> None:
    """Compile (or load the cached build of) `lib` into this process; raises when the build fails.

    A finished build (marked by a `built` file beside the library) is loaded as it is: torch's build
    tooling (setuptools, ninja's check) took 0.13 s of a warm start only to find it current, and the
    folder's name already hashes everything the library is built from."""
    directory.mkdir(parents=True, exist_ok=True)
    flags = [*lib.cflags, f"-march={march()}"]
    with _exclusive(directory / "build.flock"):
        # torch's own guard is a `lock` file that a build killed midway leaves behind, and every later
        # load then waits on it forever; under this lock, which the kernel drops with its holder, no
        # other process is building here, so such a file is stale
        (directory / "lock").unlink(missing_ok=True)
        built, library = directory / "built", directory / f"{lib.name}.so"
        if built.exists() and library.exists():
            try:
                torch.ops.load_library(str(library))
                return
            except OSError:  # unreadable: built again below
                built.unlink(missing_ok=True)
        from torch.utils.cpp_extension import load

        load(name=lib.name, sources=[str(CSRC / s) for s in lib.sources], extra_cflags=flags,
             extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False, verbose=False)
        built.touch()


@contextmanager
def _exclusive(path: Path):
    """An exclusive flock on `path` for the block: released by the kernel if the process dies."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_built() -> bool:
    """Whether loading the libraries would compile nothing: each is built for this machine already,
    or they are disabled. Reads file names only; a cold start asks it before deciding to wait."""
    if os.environ.get("STRATUM_NATIVE", "1") == "0" or "ok" in _state:
        return True
    home = stratum_home()
    return all((build_dir(home, lib) / f"{lib.name}.so").exists() for lib in LIBRARIES)


def available() -> bool:
    """Load (building if needed) the native libraries once per process."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return bool(_state["ok"])


def status() -> str:
    """"loaded (<simd path>)", "disabled", or why the build failed: for `stratum info` and the kernel choices."""
    available()
    return str(_state.get("status", "not loaded"))


def simd_path() -> str | None:
    """The instructions the native step's projections were compiled for ("avx512-vnni", "avx512bw",
    "avx-vnni", "avx2", "neon", "portable"); None when the libraries are not loaded."""
    return torch.ops.stratum.packed_simd() if available() else None


def _load() -> bool:
    if os.environ.get("STRATUM_NATIVE", "1") == "0":
        _state["status"] = "disabled (STRATUM_NATIVE=0)"
        return False
    home = stratum_home()
    try:
        for lib in LIBRARIES:
            directory = build_dir(home, lib)
            if not (directory / f"{lib.name}.so").exists():
                log.warning("compiling %s for this CPU (-march=%s), once: about half a minute (`stratum pull` does "
                            "it ahead)", lib.name, march())
            build(lib, directory)
    except Exception as exc:  # no compiler, no ninja, a failed build: the PyTorch paths remain
        _state["status"] = (f"unavailable: {type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
        log.warning("native kernels %s", _state["status"])
        return False
    _state["status"] = f"loaded ({torch.ops.stratum.packed_simd()}, -march={march()})"
    return True
