"""The models one server serves (`ModelSet`): each an engine of its own behind the API process, started
on first use through one function (`start_engine`: a `ModelSpec` in, an `EngineClient` out, whatever
the model), kept warm for its keep-alive, and unloaded least-recently-used when a new one does not
fit the memory budget; a model with requests in flight is never unloaded.

    unloaded --first request--> loading --EngineInfo--> loaded --idle past keep-alive / evicted--> unloaded
                                   \\--start failed--> failed --next request--> loading

A request holds its model from the moment its body names it to the end of its response
(`hold_model`; `app.Envelope` releases the hold once the response is sent, streamed ones too).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from stratum.engine.client import EngineClient
from stratum.engine.config import EngineConfig
from stratum.server.errors import EngineUnavailable, InvalidRequest, NotFound
from stratum.server.protocol.ollama import FOREVER, keep_alive_seconds

log = logging.getLogger("stratum.server")

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default keep_alive, 5 minutes
DEFAULT_KV_ESTIMATE_MB = 256  # a model's KV pool before it first reports its own (builder.KV_POOL_MIN_MB)
KEEP_ALIVE_HEADER = "x-stratum-keep-alive"


@dataclass(frozen=True)
class ModelSpec:
    """One model a server may serve, as the command line named it.

    name: what clients send in `model`. config: the engine's configuration for it (its `model` the
    registered name, file or folder). engine: where its loop runs, "process" (default) or "thread".
    restarts: the engine process's `RestartPolicy` (None: a dead engine stays dead).
    weight_bytes: its files on disk; kv_bytes: its KV pool, as estimated before it first reports its own.
    """

    name: str
    config: EngineConfig
    engine: str = "process"
    restarts: Any = None
    weight_bytes: int = 0
    kv_bytes: int = DEFAULT_KV_ESTIMATE_MB * 2**20
    modified_at: str = ""

    @property
    def path(self) -> str:
        return self.config.model


def spec_of(name: str, config: EngineConfig, path: Path, **kwargs) -> ModelSpec:
    """A model's spec, its footprint estimated from its files (weights are memory-mapped: they take what
    their files take) and its KV pool (`--kv-cache-mb`, else the default pool's floor)."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    stats = [p.stat() for p in files if p.exists()]
    mtime = max((st.st_mtime for st in stats), default=0.0)
    kv_mb = config.kv_cache_memory_mb or DEFAULT_KV_ESTIMATE_MB
    return ModelSpec(name, config, weight_bytes=sum(st.st_size for st in stats), kv_bytes=kv_mb * 2**20,
                     modified_at=datetime.fromtimestamp(mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **kwargs)


def parse_model_arg(value: str) -> tuple[str | None, str]:
    """`--model`'s value: (NAME, MODEL) for NAME=MODEL, else (None, MODEL), a model named by itself."""
    name, sep, model = value.partition("=")
    if sep and name and model and "/" not in name and not Path(value).expanduser().exists():
        return name, model
    return None, value


def scan_models_dir(folder: Path) -> list[tuple[str, str]]:
    """(name, model) for every model under folder, by name: a .gguf file (named by its stem; the
    registry's `NAME/FILE.gguf` by its registered NAME, which keeps its sampling settings) and a Hugging
    Face folder (config.json beside its weights; named by the folder)."""
    from stratum.models.registry import REGISTRY, model_path

    found: list[tuple[str, str]] = []
    for path in sorted(folder.expanduser().iterdir()) if folder.expanduser().is_dir() else []:
        if path.is_file() and path.suffix == ".gguf":
            found.append((path.stem, str(path)))
        elif path.is_dir() and (path / "config.json").is_file():
            found.append((path.name, str(path)))
        elif path.is_dir():
            ggufs = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
            if path.name in REGISTRY and model_path(path.name) in ggufs:
                found.append((path.name, path.name))
            elif len(ggufs) == 1:
                found.append((path.name, str(ggufs[0])))
            else:
                found += [(g.stem, str(g)) for g in ggufs]
    return found


def model_specs(entries: list[str], dirs: list[Path], base: EngineConfig, first_name: str | None = None,
                **kwargs) -> list[ModelSpec]:
    """The specs of `--model` entries (NAME=MODEL or MODEL, the first the default, named `first_name`
    where given), then of every model under `dirs` not named already (a file served once, by its first
    name). kwargs: `ModelSpec`'s engine and restarts, the same for every model.

    Raises:
        PullError: a registered model not pulled, or a path that does not exist.
        ValueError: two models of one name.
    """
    from stratum.models.registry import resolve_model_path

    named = [parse_model_arg(e) for e in entries]
    if named and first_name:
        named[0] = (first_name, named[0][1])
    listed = [(name or model, model) for name, model in named]
    seen = {str(resolve_model_path(model).resolve()) for _, model in listed}
    for folder in dirs:
        for name, model in scan_models_dir(folder):
            where = str(resolve_model_path(model).resolve())
            if where not in seen and all(name != n for n, _ in listed):
                listed.append((name, model))
                seen.add(where)
    names = [n for n, _ in listed]
    if len(set(names)) < len(names):
        raise ValueError(f"two models are named {next(n for n in names if names.count(n) > 1)!r}; "
                         "name them apart with NAME=MODEL")
    several = len(listed) > 1  # the context flags are then the generators' (`EngineConfig.encoder_takes_context`)
    return [spec_of(name, replace(base, model=model, encoder_takes_context=not several), resolve_model_path(model),
                    **kwargs) for name, model in listed]


def start_engine(spec: ModelSpec, loop: asyncio.AbstractEventLoop | None = None) -> EngineClient:
    """The one way a served model's engine starts, whatever the model: its loop in a process of its
    own (supervised by `spec.restarts`) or in a thread of this one; blocks until it is ready.

    Raises:
        EngineStartError: the engine failed to load the model.
    """
    if spec.engine == "thread":
        from stratum.engine.core import EngineCore
        from stratum.engine.thread_transport import start_thread_engine

        client = start_thread_engine(EngineCore(spec.config))
    else:
        from stratum.engine.process import EngineProcess

        client = EngineProcess(spec.config, spec.restarts).connect(loop=loop)
    client.tokenizer.offload_large_texts(LARGE_TEXT_CHARS)
    return client


# Texts this long are tokenized in a helper process, off this process's interpreter lock (see
# TextTokenizer.offload_large_texts): a 3.8 MB count_tokens stalled other streams 235 ms without it.
LARGE_TEXT_CHARS = 256 * 1024


def kv_pool_bytes(client: EngineClient) -> int:
    """The KV pool an engine reported, in bytes (K and V of every layer; fp32 unless the pool is bf16)."""
    cfg, facts = client.config, client.info.model_facts or {}
    heads, layers, width = facts.get("head_count"), facts.get("block_count"), facts.get("embedding_length")
    if not (heads and layers and width):
        return 0
    width_bytes = 2 if cfg.dtype == "bfloat16" else 4
    per_token = 2 * layers * facts.get("head_count_kv", heads) * facts.get("head_dim", width // heads) * width_bytes
    return cfg.num_kv_blocks * cfg.block_size * per_token


@dataclass(eq=False)
class ServedModel:
    """A served model's state: `state` one of unloaded, loading, loaded, failed; its engine while loaded;
    the requests holding it; when it was last used and when it expires (monotonic seconds)."""

    spec: ModelSpec
    state: str = "unloaded"
    engine: EngineClient | None = None
    error: str | None = None
    num_in_flight: int = 0
    last_used: float = 0.0
    expires_at: float | None = None  # None: in use, or kept forever
    footprint_bytes: int = 0
    aliases: tuple[str, ...] = ()
    loading: asyncio.Future | None = None
    is_pinned: bool = False  # its engine was handed in, not started here: never unloaded
    is_kept: bool = False  # the default model: loaded at start and kept (unloaded only to make room)
    num_loads: int = 0

    def __post_init__(self) -> None:
        self.footprint_bytes = self.footprint_bytes or self.spec.weight_bytes + self.spec.kv_bytes

    @property
    def name(self) -> str:
        return self.spec.name

    def view(self) -> dict[str, Any]:
        """/health's entry: the state, and what explains it."""
        body: dict[str, Any] = {"name": self.name, "state": self.state, "in_flight": self.num_in_flight,
                                "footprint_mb": round(self.footprint_bytes / 2**20, 1), "loads": self.num_loads}
        if self.expires_at is not None:
            body["expires_in_s"] = round(max(0.0, self.expires_at - time.monotonic()), 1)
        if self.error and self.state == "failed":
            body["error"] = self.error
        if self.engine is not None:
            body["engine_pid"] = self.engine.engine_pid
        return body


class ModelSet:
    """Every model of the server, by name; the first is the default, which `patterns` (Claude Code's
    `claude-*` ids) name too.

    Args:
        specs: the models, the default first.
        start: `start_engine` (a spec and the serving loop in, a ready client out), run in a worker thread.
        memory_bytes: what every loaded model's footprint may add up to (`--models-memory-mb`).
        keep_alive_s: how long a model stays loaded after its last request (`--keep-alive`; FOREVER).
        load_wait_s: how long a request waits for its model to load before a 503 (`--model-load-wait-s`).
    """

    def __init__(self, specs: list[ModelSpec], start: Callable[..., EngineClient] | None = start_engine,
                 memory_bytes: int | None = None, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
                 load_wait_s: float = 60.0, patterns: tuple[str, ...] = ("claude-*",)):
        assert specs, "a server serves at least one model"
        self.models = {s.name: ServedModel(s) for s in specs}
        self.default = self.models[specs[0].name]
        self.default.is_kept = True  # loaded at start and kept, as a one-model server's is
        self.start, self.memory_bytes, self.keep_alive_s = start, memory_bytes, keep_alive_s
        self.load_wait_s, self.patterns = load_wait_s, patterns
        self._reaper: asyncio.Task | None = None
        self._unloading: set[asyncio.Task] = set()

    @classmethod
    def of_engine(cls, name: str, engine: EngineClient, aliases: tuple[str, ...] = (),
                  patterns: tuple[str, ...] = ("claude-*",)) -> "ModelSet":
        """One model whose engine is already running (handed in): loaded, and never unloaded."""
        models = cls([ModelSpec(name, EngineConfig(model=name))], start=None, patterns=patterns)
        models.adopt(models.default, engine, aliases)
        models.default.is_pinned = True
        return models

    def adopt(self, served: ServedModel, engine: EngineClient, aliases: tuple[str, ...] = ()) -> None:
        """A model's engine, started (the default's at boot, or `_load`'s): loaded, its footprint measured."""
        served.engine, served.state, served.error = engine, "loaded", None
        served.aliases = tuple(a for a in (*aliases, engine.info.model_name) if a and a != served.name)
        served.footprint_bytes = served.spec.weight_bytes + (kv_pool_bytes(engine) or served.spec.kv_bytes)
        served.last_used, served.num_loads = time.monotonic(), served.num_loads + 1
        served.expires_at = None

    # ---- names --------------------------------------------------------------------------------------
    def find(self, name: str) -> ServedModel:
        """The model `name` names: a served name, an alias (a checkpoint's own name, once loaded), or a
        name matching `patterns`, which the default model answers.

        Raises:
            NotFound: 404, naming the models served.
        """
        served = self.models.get(name)
        if served is not None:
            return served
        for m in self.models.values():
            if name in m.aliases:
                return m
        if any(fnmatch.fnmatchcase(name, p) for p in self.patterns):
            return self.default
        raise NotFound(f"model {name!r} not found; this server serves {', '.join(map(repr, self.models))}",
                       code="model_not_found")

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.state == "loaded"]

    # ---- holds ----------------------------------------------------------------------------------------
    async def acquire(self, served: ServedModel) -> EngineClient:
        """Hold `served` for a request: started if it is not (waiting for it up to load_wait_s), and
        never unloaded until `release`.

        A model whose engine died is its supervisor's to restart (`RequestLifecycle.admit` waits for it)
        or to give up (then it answers 503, as `--engine-restarts` says, until it is unloaded to make room).

        Raises:
            EngineUnavailable: 503 with retry-after, the model did not load in time, or failed to.
        """
        served.num_in_flight += 1
        served.expires_at = None
        try:
            if served.state != "loaded":
                await self._wait_loaded(served)
        except BaseException:
            self.release(served, None)
            raise
        served.last_used = time.monotonic()
        return served.engine

    def release(self, served: ServedModel, keep_alive_s: float | None) -> None:
        """A request's hold ends: once none holds the model, it stays loaded for `keep_alive_s` (the
        request's, else the server's `keep_alive_s`); 0 unloads it now. The default model stays loaded
        whatever a request says (it is unloaded only to make room for another)."""
        served.num_in_flight -= 1
        served.last_used = time.monotonic()
        if served.num_in_flight or served.state != "loaded" or served.is_pinned or served.is_kept:
            return
        keep = self.keep_alive_s if keep_alive_s is None else keep_alive_s
        served.expires_at = None if keep == FOREVER else served.last_used + keep
        if keep == 0:
            self._unload_soon(served)

    async def _wait_loaded(self, served: ServedModel) -> None:
        if served.loading is None:
            if self.start is None:
                raise EngineUnavailable(f"model {served.name!r} is not loaded")
            served.loading = asyncio.ensure_future(self._load(served))
        try:
            async with asyncio.timeout(self.load_wait_s):
                await asyncio.shield(served.loading)
        except TimeoutError:
            retry = max(1, math.ceil(self.load_wait_s / 2))
            raise EngineUnavailable(f"model {served.name!r} is still loading after {self.load_wait_s:g}s; retry "
                                    f"in {retry}s", headers={"retry-after": str(retry)}) from None
        if served.state != "loaded":
            raise EngineUnavailable(f"model {served.name!r} failed to load: {served.error}",
                                    headers={"retry-after": "5"})

    # ---- loading and unloading ----------------------------------------------------------------------
    async def _load(self, served: ServedModel) -> None:
        """Start the model's engine, once there is room for it (least-recently-used idle models unloaded
        first; while models in use leave no room, it waits for them, up to load_wait_s)."""
        served.state, served.error = "loading", None
        try:
            deadline = time.monotonic() + self.load_wait_s
            while not await self._make_room(served):
                if time.monotonic() > deadline:
                    raise MemoryError(self._no_room(served))
                await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            engine = await asyncio.to_thread(self.start, served.spec, loop)
            self.adopt(served, engine)
            log.warning("model %s loaded (%.0f MiB of %s)", served.name, served.footprint_bytes / 2**20,
                        "unbounded" if self.memory_bytes is None else f"{self.memory_bytes / 2**20:.0f} MiB")
        except Exception as e:  # said to every request waiting, and on /health; the next request tries again
            served.state, served.error = "failed", str(e) or type(e).__name__
            log.warning("model %s failed to load: %s", served.name, served.error)
        finally:
            served.loading = None

    def _no_room(self, served: ServedModel) -> str:
        busy = ", ".join(f"{m.name} ({m.num_in_flight} in flight)" for m in self.loaded() if m.num_in_flight)
        return (f"{served.name} needs {served.footprint_bytes / 2**20:.0f} MiB and --models-memory-mb is "
                f"{self.memory_bytes / 2**20:.0f} MiB" + (f"; in use: {busy}" if busy else ""))

    def used_bytes(self, but: ServedModel | None = None) -> int:
        return sum(m.footprint_bytes for m in self.models.values()
                   if m is not but and m.state in ("loaded", "loading"))

    async def _make_room(self, served: ServedModel) -> bool:
        """Unload idle models, least recently used first, until `served` fits; False while it cannot."""
        if self.memory_bytes is None:
            return True
        if served.footprint_bytes > self.memory_bytes:
            raise MemoryError(self._no_room(served))
        while self.used_bytes(but=served) + served.footprint_bytes > self.memory_bytes:
            idle = sorted((m for m in self.loaded() if not m.num_in_flight and not m.is_pinned),
                          key=lambda m: m.last_used)
            if not idle:
                return False
            log.warning("model %s unloaded to make room for %s", idle[0].name, served.name)
            await self.unload(idle[0])
        return True

    async def unload(self, served: ServedModel) -> None:
        """Stop the model's engine (its KV pool and prefix cache go with it); its next request starts it."""
        engine = served.engine
        if engine is None or served.num_in_flight or served.is_pinned:
            return
        served.engine, served.state, served.expires_at = None, "unloaded", None
        await asyncio.to_thread(_stop, engine)

    def _unload_soon(self, served: ServedModel) -> None:
        task = asyncio.get_running_loop().create_task(self.unload(served))
        self._unloading.add(task)
        task.add_done_callback(self._unloading.discard)

    async def reap(self, every_s: float = 0.2) -> None:
        """Unload each model whose keep-alive has passed with no request holding it (runs with the app)."""
        while True:
            now = time.monotonic()
            for m in self.loaded():
                if m.expires_at is not None and m.expires_at <= now and not m.num_in_flight:
                    await self.unload(m)
            await asyncio.sleep(every_s)

    def start_reaper(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self.reap())

    async def stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()

    def shutdown(self) -> None:
        """Every engine stopped (the server is stopping)."""
        for m in self.models.values():
            if m.engine is not None:
                engine, m.engine, m.state = m.engine, None, "unloaded"
                _stop(engine)


def _stop(engine: EngineClient) -> None:
    engine.shutdown()
    engine.tokenizer.close()


async def hold_model(request, models: ModelSet, name: str, keep_alive: float | int | str | None = None) -> ServedModel:
    """The model a request names, held until its response is sent (`app.Envelope` releases it), with
    the keep-alive it asked for (Ollama's `keep_alive`, else the X-Stratum-Keep-Alive header).

    Raises:
        NotFound: no such model. InvalidRequest: a malformed keep-alive. EngineUnavailable: it did not load.
    """
    served = models.find(name)
    try:
        seconds = keep_alive_seconds(keep_alive if keep_alive is not None else request.headers.get(KEEP_ALIVE_HEADER))
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    state = request.state
    if getattr(state, "held_model", None) is not None:  # one hold per request
        state.keep_alive_s = seconds
        return state.held_model
    await models.acquire(served)
    state.held_model, state.keep_alive_s = served, seconds
    return served


def release_held(scope: dict, models: ModelSet) -> None:
    """The request's hold on its model, released once its response is sent (`app.Envelope`)."""
    state = scope.get("state") or {}
    served = state.pop("held_model", None)
    if served is not None:
        models.release(served, state.get("keep_alive_s"))


@dataclass(frozen=True)
class ModelCatalogue:
    """What `/v1/models` lists: every served model, in Anthropic's shape (which OpenAI's SDK reads too)."""

    models: ModelSet
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))

    def card(self, served: ServedModel) -> dict[str, Any]:
        return {"type": "model", "id": served.name, "display_name": served.name, "created_at": self.created_at,
                "object": "model", "owned_by": "stratum", "state": served.state}

    def page(self) -> dict[str, Any]:
        cards = [self.card(m) for m in self.models.models.values()]
        return {"data": cards, "has_more": False, "first_id": cards[0]["id"], "last_id": cards[-1]["id"],
                "object": "list"}
