"""Shared fixtures: the tiny random model (fast tests) and the real default model (integration tests)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.factories import make_tiny_model_dir

# Kernel plans measured by the tests (and the servers they start) go to a directory of the session's
# own: a plan measured while the suite loads the machine never becomes the plan a server here uses.
os.environ["STRATUM_PLAN_DIR"] = tempfile.mkdtemp(prefix="stratum-test-plans-")
# Engines built in the test process keep their prefix cache to themselves (no disk tier) unless a test
# asks for one: a tier shared across tests would turn their cold prompts into hits. Servers get a tier
# each (`ServerProcess`), as `stratum serve` has by default.
os.environ["STRATUM_KV_DISK_GB"] = "0"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the long variants of soak, fuzz and stress tests (marked slow)")


def pytest_collection_modifyitems(config, items):
    """A test marked slow is the long variant of one the default run keeps in a bounded form: it
    runs with --slow (or when selected with -m slow)."""
    if config.getoption("--slow") or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the long variant: run with --slow (the default run has a bounded one)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def home_with_kernels(home: Path) -> Path:
    """A $STRATUM_HOME holding this machine's compiled native kernels (linked from the session's home,
    compiled there first where they are not yet): a new file's first start, without compiling them again."""
    from stratum.home import stratum_home
    from stratum.kernels import native

    native.available()
    (home / "kernels").mkdir(parents=True, exist_ok=True)
    for lib in native.LIBRARIES:
        source, target = native.build_dir(stratum_home(), lib), native.build_dir(home, lib)
        if source.exists() and not target.exists():
            if os.path.lexists(target):  # a link to a build that is gone (a kept home)
                target.unlink()
            target.symlink_to(source)
    return home


@pytest.fixture(scope="module")
def module_stratum_home(tmp_path_factory):
    """A $STRATUM_HOME of the module's own (its converted-checkpoint caches and plans; the session's
    compiled kernels), for modules that ask for it with
    `pytestmark = pytest.mark.usefixtures("module_stratum_home")`."""
    home = home_with_kernels(tmp_path_factory.mktemp("stratum-home"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATUM_HOME", str(home))
        yield home


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_template(tiny_model_dir):
    """The tiny model's chat template and tokenizer, to build prompts token by token in a test."""
    from stratum.models.chat_template import ChatTemplate
    from stratum.models.loader import load_checkpoint

    ck = load_checkpoint(tiny_model_dir)
    return ChatTemplate(ck.chat_template, ck.tokenizer)


@pytest.fixture(scope="session")
def real_model_path():
    """The default GGUF; `make test` pulls it first. Skips only if it is genuinely absent."""
    from stratum.models.registry import DEFAULT_MODEL, model_path

    path = model_path(DEFAULT_MODEL)
    if not path.exists():
        pytest.skip(f"{path} missing: run `stratum pull`")
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A real `stratum serve` subprocess on a free loopback port."""

    def __init__(self, model: str, *extra: str, env: dict | None = None):
        import os
        import subprocess
        import sys
        import tempfile

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        if "--data-dir" not in extra:  # batches of one test session never reach another's server
            self.data_dir = tempfile.mkdtemp(prefix="stratum-data-")
            extra = (*extra, "--data-dir", self.data_dir)
        self.kv_dir = None
        if "--kv-disk-dir" not in extra:  # the default disk tier, in a folder of this server's own
            self.kv_dir = tempfile.mkdtemp(prefix="stratum-kv-")
            extra = (*extra, "--kv-disk-dir", self.kv_dir)
        cmd = [sys.executable, "-m", "stratum.cli", "serve", "--model", model, "--port", str(self.port), *extra]
        # One engine thread: the test process and other servers share the same few cores, and
        # oversubscribed threads spin-wait (measured ~10x slower steps on 2 cores).
        env = {"STRATUM_NUM_THREADS": "1", **{k: v for k, v in os.environ.items() if k != "STRATUM_KV_DISK_GB"},
               **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0, prepared: bool = True) -> "ServerProcess":
        """Until /health says 200; with `prepared`, also until a cold start's kernels have taken
        over (no "preparing" stage): the switch drops the prefix cache, which tests would see."""
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 and not (prepared and r.json().get("preparing")):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        output = self.output()
        self.stop()  # the fixture that started it never gets it back to stop: it would serve on, busy, to the end
        raise TimeoutError(f"server not ready: {output}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        import shutil

        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except Exception:
            self.proc.kill()
        if self.kv_dir is not None:
            shutil.rmtree(self.kv_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """`stratum serve` on the tiny random model, served as "tiny"."""
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(tiny_server):
    """The official anthropic SDK on `tiny_server` (a module may name its own `client`)."""
    import anthropic

    return anthropic.Anthropic(base_url=tiny_server.url, api_key="test", max_retries=0)


@pytest.fixture(scope="module")
def oai(tiny_server):
    """The official openai SDK on `tiny_server`."""
    import openai

    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="test", max_retries=0)


@pytest.fixture(scope="session")
def real_server(real_model_path):
    """`stratum serve` on the default model."""
    server = ServerProcess("smollm2-135m").wait_ready()
    yield server
    server.stop()
