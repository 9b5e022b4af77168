"""What this CPU is: its name and feature flags, as the kernel plan and the native build key on them."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_family() -> str:
    """The CPU family the plan's defaults are known good for: architecture and widest SIMD."""
    flags = cpu_flags()
    machine = platform.machine()
    if "avx512f" in flags:
        return f"{machine} AVX-512"
    if "avx2" in flags:
        return f"{machine} AVX2"
    if machine in ("aarch64", "arm64"):
        return f"{machine} NEON"
    return f"{machine} portable"
