"""Preparing a model to serve fast (native kernels compiled, kernel plan measured, weights repacked;
cached under $STRATUM_HOME): ahead at `stratum pull` (`prepare`), or behind a start whose kernels are
not compiled yet (`KernelUpgrade`), which serves on the provisional step meanwhile."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import subprocess
import sys
import threading
from dataclasses import replace
from typing import Callable

from stratum.engine import builder
from stratum.engine.config import EngineConfig, ResolvedConfig

log = logging.getLogger("stratum.engine")

# The child's priority: the compiler and the plan's measurements yield the cores to serving.
CHILD_NICE = 10
_STAGE = "stage: "  # a line of the child's output that names the stage it begins


def prepare(config: EngineConfig, report: Callable[[str], None] = lambda stage: None) -> ResolvedConfig:
    """Build the native kernels, measure the kernel plan and repack the weights for config, each
    cached, so that an engine for config starts on them without waiting (`builder.resolve` with
    measure=False finds them). `report` is told each stage as it begins.

    Returns:
        The resolved configuration the engine will run with.
    """
    from stratum.kernels import native

    checkpoint = builder.load(config)
    report("building kernels")
    native.available()
    report("measuring the kernel plan")
    resolved = builder.resolve(config, checkpoint)
    report("repacking weights")
    builder.build_model(resolved, checkpoint)
    return resolved


class KernelUpgrade:
    """Prepares config's kernels in a child process, at a lower CPU priority so that serving keeps
    the cores it needs, then builds the model on them in a thread of this one; `prepared` holds it
    once done, `error` says why not (the engine stays on its step). The engine adopts it between two
    steps (`EngineCore.switch_kernels`).

    `stage` names what it is doing now, for /health: "building kernels", "measuring the kernel
    plan", "repacking weights", "loading the prepared kernels".
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.stage = "starting"
        self.prepared: builder.Built | None = None
        self.error: str | None = None
        self._child: subprocess.Popen | None = None
        self._cancelled = False
        atexit.register(self.cancel)  # an orphaned compiler would load the machine after the server is gone
        threading.Thread(target=self._run, name="stratum-kernel-upgrade", daemon=True).start()

    @property
    def is_done(self) -> bool:
        return self.prepared is not None or self.error is not None

    def cancel(self) -> None:
        self._cancelled = True
        if self._child is not None and self._child.poll() is None:
            self._child.kill()

    def _run(self) -> None:
        try:
            self._prepare_in_child()
            self.stage = "loading the prepared kernels"
            self.prepared = self._build()
        except Exception as e:  # no compiler, a failed measurement: serving goes on as it is
            self.error = f"{type(e).__name__}: {e}"
            log.warning("the kernels could not be prepared; the engine stays on its current step: %s", self.error)

    def _prepare_in_child(self) -> None:
        cmd = [sys.executable, "-m", "stratum.engine.prepare", "--config", self.config.to_json(),
               "--nice", str(CHILD_NICE)]
        self._child = child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        if self._cancelled:
            child.kill()
        for line in child.stdout:
            if line.startswith(_STAGE):
                self.stage = line[len(_STAGE):].strip()
        if child.wait() != 0:
            raise RuntimeError(f"preparing the kernels failed (the child exited with code {child.returncode})")

    def _build(self) -> builder.Built:
        """The engine's parts on what the child cached: reading them takes a second, measuring nothing."""
        from stratum.kernels import native

        config = replace(self.config, remeasure_plan=False)  # the plan is the one the child just measured
        checkpoint = builder.load(config)
        if not native.available():  # loads the libraries the child built (or learns, fast, that they cannot be)
            raise RuntimeError(f"the native kernels did not load: {native.status()}")
        # the plan the child measured (the CPU family's defaults where serving kept the machine busy)
        return builder.build(builder.resolve(config, checkpoint, measure=False), checkpoint)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stratum.engine.prepare")
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by this much")
    args = p.parse_args(argv)
    os.nice(args.nice)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prepare(EngineConfig.from_json(args.config), report=lambda stage: print(_STAGE + stage, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
