"""The native step's kernels without torch (tests/csrc/step_driver.cpp over stratum/kernels/csrc/step/),
built once per SIMD family and run on fixed inputs: every tile format through the projection at 1 to 9
rows, attention over fp32 and bf16 pools, a whole two-layer forward. Every family must print the same
hashes, bit for bit: the x86 ones this CPU runs natively, NEON built by Debian's aarch64 cross compiler
and run under qemu-aarch64, and on an x86 CPU without AVX-512 the AVX-512 families (with VNNI and
without) built on SIMDe's emulation of the intrinsics (tests/csrc/avx512_emulated.h). Families this CPU
cannot run otherwise (AVX-VNNI; AVX-512 without SIMDe) are compiled, not run.

`make test` installs the cross compiler, qemu and SIMDe when it runs as root (g++-aarch64-linux-gnu,
qemu-user, libsimde-dev); without them those tests are skipped and say so. Builds are cached in pytest's cache
folder, keyed on the sources, the flags and the compiler.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stratum.kernels import native
from stratum.kernels.cpu import cpu_flags
from tests.test_simd_paths import X86_VARIANTS

ROOT = Path(__file__).parents[1]
DRIVER = ROOT / "tests" / "csrc" / "step_driver.cpp"
STEP = native.CSRC / native.STEP.headers
# the library's own flags (no -ffast-math, -ffp-contract=off), for a program: no torch, no -fPIC
FLAGS = ["-std=c++17", *native.STEP.cflags, "-Wall", "-Wextra", f"-I{STEP}"]
# families built but not run where this CPU lacks them: -march, the path, the CPU flags it needs
EXTRA_X86 = [("icelake-server", "avx512-vnni", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})]
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
EMULATED = ROOT / "tests" / "csrc" / "avx512_emulated.h"
# the AVX-512 families on SIMDe: the path each prints, and the flags that ask for it
SIMDE_PATHS = {"avx512-vnni": ["-DSTRATUM_EMULATE_VNNI"], "avx512bw": []}

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


def _build(compiler: str, flags: list[str], out_dir: Path) -> Path:
    """The driver built by `compiler` with `flags` (an object file with -c), cached by the sources, flags
    and compiler version."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(f"{compiler}|{flags}|{version}".encode())
    for path in [DRIVER, EMULATED, *native.STEP.files()]:
        key.update(path.read_bytes())
    exe = out_dir / f"step_driver-{key.hexdigest()[:16]}{'.o' if '-c' in flags else ''}"
    if not exe.exists():
        tmp = exe.with_name(f"{exe.name}.tmp{os.getpid()}")
        proc = subprocess.run([compiler, *flags, str(DRIVER), "-o", str(tmp)], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{compiler} {' '.join(flags)}:\n{proc.stderr[-4000:]}"
        tmp.rename(exe)
    return exe


def _run(command: list[str]) -> dict[str, str]:
    """The driver's lines as {case: hash}, with "simd" naming the family it was built for."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr[-3000:]}"
    return dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines())


def _assert_same(results: dict[str, str], reference: dict[str, str], what: str) -> None:
    cases = [k for k in reference if k != "simd"]
    assert len(cases) > 100 and set(results) == set(reference), f"{what}: a different set of cases"
    differ = [k for k in cases if results[k] != reference[k]]
    assert not differ, (f"{what} ({results['simd']}) differs from {reference['simd']} in {len(differ)} cases: "
                        f"{differ[:8]}")


def _is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def _simde_applies() -> bool:
    """An x86 CPU without AVX-512 (with F16C, which the emulation's fp16 conversion uses) and SIMDe's
    headers where the compiler finds them."""
    if not _is_x86() or {"avx512f", "avx512bw"} <= cpu_flags() or "f16c" not in cpu_flags():
        return False
    probe = subprocess.run(["c++", "-E", "-x", "c++", "-", "-o", os.devnull], input="#include <simde/x86/avx512.h>\n",
                           capture_output=True, text=True)
    return probe.returncode == 0


def _runnable() -> list[str]:
    """The -march of every x86 family this CPU runs, "native" first."""
    flags = cpu_flags()
    return ["native"] + ([m for m, _, needs in X86_VARIANTS + EXTRA_X86 if needs <= flags] if _is_x86() else [])


@pytest.fixture(scope="module")
def builds(request, tmp_path_factory):
    """Every build the tests below use, started at once, one compiler per core: {name: Future[Path]} with
    names "-march=M" (run here), "object -march=M" (compiled only) and "aarch64". Cached in pytest's cache
    folder between runs, so only the first compiles."""
    cache = getattr(request.config, "cache", None)
    out = Path(cache.mkdir("step-driver-builds")) if cache is not None else tmp_path_factory.mktemp("builds")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        jobs = {f"-march={m}": pool.submit(_build, "c++", [*FLAGS, f"-march={m}"], out) for m in _runnable()}
        if _is_x86():
            for march, path, needs in X86_VARIANTS + EXTRA_X86:
                if not needs <= cpu_flags():
                    flags = [*FLAGS, f"-march={march}", f'-DSTRATUM_EXPECT_SIMD="{path}"', "-c"]
                    jobs[f"object -march={march}"] = pool.submit(_build, "c++", flags, out)
        if _simde_applies():
            for path, defines in SIMDE_PATHS.items():
                # -O1: the bits do not depend on it, and SIMDe's headers take -O3 2.5x as long
                flags = [*FLAGS, "-march=native", "-O1", "-Wno-psabi", *defines, "-include", str(EMULATED)]
                jobs[f"simde {path}"] = pool.submit(_build, "c++", flags, out)
        if all(shutil.which(tool) for tool in (CROSS, QEMU)):
            jobs["aarch64"] = pool.submit(_build, CROSS, [*FLAGS, "-march=armv8-a", "-static"], out)
        yield jobs


@pytest.fixture(scope="module")
def x86_results(builds) -> dict[str, dict[str, str]]:
    """Each x86 family this CPU runs, built and run: {-march: results}, "native" first."""
    return {m: _run([str(builds[f"-march={m}"].result())]) for m in _runnable()}


def test_every_x86_family_this_cpu_runs_prints_the_same_bits(x86_results):
    expected = {m: path for m, path, _ in X86_VARIANTS + EXTRA_X86}
    reference = x86_results["native"]
    for march, results in x86_results.items():
        if march in expected:
            assert results["simd"] == expected[march], f"-march={march} built the {results['simd']} path"
        _assert_same(results, reference, f"-march={march}")
    if platform.machine() in ("x86_64", "AMD64"):
        assert {"portable", "avx2"} <= {r["simd"] for r in x86_results.values()}


@pytest.mark.parametrize("march, path", [(m, p) for m, p, _ in X86_VARIANTS + EXTRA_X86])
def test_families_this_cpu_cannot_run_still_compile(march, path, builds):
    """AVX-512 and AVX-VNNI where the CPU lacks them: the driver compiled to an object (code generated,
    not only parsed), asserting at compile time that it built that family; running them is left to a
    machine that has them."""
    if not _is_x86():
        pytest.skip("x86 families: an x86 compiler")
    if f"object -march={march}" not in builds:
        pytest.skip(f"this CPU runs -march={march}: compared bit for bit by the test above")
    assert builds[f"object -march={march}"].result().stat().st_size > 0


@pytest.mark.parametrize("path", SIMDE_PATHS)
def test_avx512_families_under_simde_print_the_bits_of_this_cpus(path, x86_results, builds):
    """The AVX-512 kernels (the int8 ones included) run here, their intrinsics emulated by SIMDe, and
    compared bit for bit with the families this CPU runs."""
    if not _is_x86():
        pytest.skip("x86 families: an x86 compiler")
    if {"avx512f", "avx512bw"} <= cpu_flags():
        pytest.skip("this CPU runs AVX-512 itself: compared bit for bit by the test above")
    if f"simde {path}" not in builds:
        pytest.skip("no SIMDe headers (libsimde-dev; `make test` installs them when run as root): the AVX-512 "
                    "kernels are compiled here, not run")
    results = _run([str(builds[f"simde {path}"].result())])
    assert results["simd"] == path
    _assert_same(results, x86_results["native"], f"{path} under SIMDe")


def test_neon_under_qemu_prints_the_bits_of_the_x86_families(x86_results, builds):
    missing = [tool for tool in (CROSS, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {' or '.join(missing)}: the NEON kernels are not checked here (`make test` installs "
                    "g++-aarch64-linux-gnu and qemu-user when run as root)")
    results = _run([QEMU, str(builds["aarch64"].result())])
    assert results["simd"] == "neon"
    _assert_same(results, x86_results["native"], "aarch64 under qemu")
