"""`stratum bench startup`: how long `stratum serve` takes to answer, and the memory it takes to get there.

Launches the server as a user would and records, from the launch: the port accepting connections,
/health answering 200, the first streamed token of a request sent at that moment, that request's
end, and when the native step runs (/health's `step` is "native", nothing `preparing`); and the peak
resident memory (VmHWM) of the server process, the engine process and any preparing child, sampled
until the server stops. Three kinds of start, each in a fresh $STRATUM_HOME holding a link to the model:
- cold: nothing compiled, converted or measured (the machine's first start);
- first: the machine's compiled native kernels linked in, the model never seen (a new file's first start);
- warm: that home again, after the first start cached what it derived (repeated `--warm-runs` times).
`--busy N` keeps N other processes spinning on the cores through the first and warm starts. The
user's own $STRATUM_HOME is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from stratum.home import stratum_home
from stratum.kernels.cpu import cpu_name

PROMPT = [{"role": "user", "content": "Name three primary colors."}]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratum.cli", *args]


class PeakMemory:
    """The VmHWM of a process and its descendants, sampled every `every_s` until `stop`: a process's
    own high-water mark, read while it lives (the last reading of one that exits is kept)."""

    def __init__(self, pid: int, every_s: float = 0.1):
        import psutil

        self._root = psutil.Process(pid)
        self.peaks: dict[int, tuple[str, int]] = {}  # pid -> (role, VmHWM bytes)
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds used), at the last sample
        self._stop = threading.Event()
        self._every_s = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self._sample():
            self._stop.wait(self._every_s)

    def _sample(self) -> bool:
        """Read each living process's mark; False once the root is gone."""
        import psutil

        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return False
        for p in procs:
            try:
                hwm = _vm_hwm(p.pid)
                role = _role(p.cmdline())
                times = p.cpu_times()
            except (psutil.Error, OSError):
                continue
            self.cpu[p.pid] = (role, times.user + times.system)
            if hwm:
                self.peaks[p.pid] = (role, max(hwm, self.peaks.get(p.pid, (role, 0))[1]))
        return True

    def cpu_s(self) -> dict:
        """CPU seconds each role has used so far (as last sampled): what a start costs, load or not."""
        roles: dict[str, float] = {}
        for role, seconds in self.cpu.values():
            roles[role] = roles.get(role, 0.0) + seconds
        return {role: round(v, 2) for role, v in sorted(roles.items())}

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sample()  # what happened since the last sample (the request just served) counts too
        roles: dict[str, int] = {}
        for role, hwm in self.peaks.values():
            roles[role] = max(roles.get(role, 0), hwm)
        return {f"{role}_mb": round(b / 2**20, 1) for role, b in sorted(roles.items())} | {
            "sum_mb": round(sum(roles.values()) / 2**20, 1)}


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _role(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    if "stratum.engine.prepare" in text:
        return "preparing_child"
    if "stratum.engine.process" in text:
        return "engine"
    if "stratum.cli" in text:
        return "server"
    return "other"


def launch(home: Path, model: str, max_tokens: int, wait_native_s: float) -> dict:
    """One start of `stratum serve` on home: the times, in seconds from the launch, and peak memory."""
    port = _port()
    env = {**os.environ, "STRATUM_HOME": str(home)}
    env.pop("STRATUM_PLAN_DIR", None)  # the plan goes where a user's would: under this home
    t0 = time.perf_counter()
    proc = subprocess.Popen(_cli("serve", "--model", model, "--port", str(port), "--data-dir", ""), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    memory = PeakMemory(proc.pid)
    out: dict = {}
    try:
        _wait_port(proc, port, t0, out)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            _wait_health(http, t0, out)
            out["cpu_s_at_ready"] = memory.cpu_s()
            _first_request(http, model, max_tokens, t0, out)
            _wait_native(http, t0, wait_native_s, out)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out["peak_memory"] = memory.stop()
    return out


def _wait_port(proc, port: int, t0: float, out: dict) -> None:
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            out["port_open_s"] = round(time.perf_counter() - t0, 3)
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stdout.read()[-2000:]}")
            time.sleep(0.02)


def _wait_health(http: httpx.Client, t0: float, out: dict) -> None:
    stages: list = []
    while True:
        r = http.get("/health")
        body = r.json()
        if r.status_code == 200:
            out["health_200_s"] = round(time.perf_counter() - t0, 3)
            out["step_at_ready"] = body.get("step")
            out["preparing_at_ready"] = body.get("preparing")
            if body.get("step") == "native" and not body.get("preparing"):
                out["native_step_s"] = out["health_200_s"]
            out["loading_stages"] = stages
            return
        if body.get("stage") not in stages:
            stages.append(body.get("stage"))
        time.sleep(0.02)


def _first_request(http: httpx.Client, model: str, max_tokens: int, t0: float, out: dict) -> None:
    request = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=request) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if "first_token_s" not in out and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                out["first_token_s"] = round(time.perf_counter() - t0, 3)
    out["first_request_done_s"] = round(time.perf_counter() - t0, 3)


def _wait_native(http: httpx.Client, t0: float, wait_native_s: float, out: dict) -> None:
    deadline = time.perf_counter() + wait_native_s
    while "native_step_s" not in out and time.perf_counter() < deadline:
        body = http.get("/health").json()
        if not body.get("preparing"):
            out["step_final"] = body.get("step")
            if body.get("step") == "native":
                out["native_step_s"] = round(time.perf_counter() - t0, 3)
            return
        time.sleep(0.1)
    out.setdefault("step_final", "native" if "native_step_s" in out else None)


@contextmanager
def busy(n: int):
    """n processes spinning on the cores while the block runs (another tenant of the machine)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _home(model: Path, compiled: bool) -> Path:
    """A fresh $STRATUM_HOME linking the model (as models/<its name>) and, where `compiled`, this
    machine's compiled native kernels."""
    home = Path(tempfile.mkdtemp(prefix="stratum-startup-"))
    (home / "models").mkdir()
    (home / "models" / model.name).symlink_to(model.resolve())
    if compiled:
        from stratum.kernels import native

        native.available()  # compiled here once if they are not yet
        (home / "kernels").mkdir()
        for lib in native.LIBRARIES:
            source = native.build_dir(stratum_home(), lib)
            (home / "kernels" / source.name).symlink_to(source)
    return home


def _model_source(model: str) -> tuple[Path, str]:
    """(the file or folder to link, what `serve --model` is given): a registered name or a path."""
    path = Path(model)
    if path.exists():
        return path, None
    source = stratum_home() / "models" / model
    if not source.is_dir():
        raise SystemExit(f"{source} is missing: `stratum pull {model}` first")
    return source, model


def run(model: str, kinds: list[str], warm_runs: int, max_tokens: int, wait_native_s: float, num_busy: int) -> dict:
    source, name = _model_source(model)
    out: dict = {"model": model, "model_bytes": _size(source), "machine": {
        "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
        "march": os.environ.get("STRATUM_MARCH") or "native"}, "max_tokens": max_tokens, "busy_processes": num_busy}
    for kind in kinds:
        home = _home(source, compiled=kind != "cold")
        target = name or str(home / "models" / source.name)
        try:
            if kind == "cold":
                out["cold"] = launch(home, target, max_tokens, wait_native_s)
                continue
            with busy(num_busy):
                out["first"] = launch(home, target, max_tokens, wait_native_s)
                out["warm"] = [launch(home, target, max_tokens, wait_native_s) for _ in range(warm_runs)]
        finally:
            shutil.rmtree(home, ignore_errors=True)
    if "warm" in out:
        out["warm_native_step_s_max"] = max((w.get("native_step_s") or float("inf")) for w in out["warm"])
    return out


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stratum bench startup", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="a registered model, or a .gguf file or folder")
    p.add_argument("--kinds", default="cold,first", help="which starts: cold, first (each followed by the warm runs)")
    p.add_argument("--warm-runs", type=int, default=5)
    p.add_argument("--busy", type=int, default=0, help="processes kept spinning through the first and warm starts")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--wait-native-s", type=float, default=300.0, help="how long to wait for a cold start's switch")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    text = json.dumps(run(args.model, kinds, args.warm_runs, args.max_tokens, args.wait_native_s, args.busy), indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
