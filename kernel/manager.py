"""The resident-model manager: which models are loaded, who is using them, and loading
and unloading them without pulling a model out from under a running request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import attrs

from .engines import Engine, EngineError, vram_of
from .errors import LocalmError
from .models import DEFAULT_MODEL_ID, ModelEntry, ModelKinds, Registry

if TYPE_CHECKING:
    from .runtime import Kernel

log = logging.getLogger("localm.models")

UNLOAD_GRACE_SECONDS = 10.0


@attrs.define(eq=False)
class Resident:
    entry: ModelEntry
    engine: Engine
    loaded_at: float
    in_flight: int = 0
    unloading: bool = False
    #: the plugin whose engine loaded it (its models are unloaded when it stops)
    plugin: str | None = None


@attrs.define(eq=False)
class Hold:
    """A model held beyond one ``async with``: from preparing a request to the end of its
    generation, so an unload cannot begin in between. ``release()`` ends it (once); a hold
    dropped without a release is released when it is collected."""

    resident: Resident
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.resident.in_flight -= 1

    def __del__(self) -> None:
        self.release()


class ModelManager:
    def __init__(self, kernel: Kernel) -> None:
        self._kernel = kernel
        #: the file formats and pull sources active plugins registered
        self.kinds = ModelKinds()
        self.registry = Registry(kernel.data_dir, self.kinds)
        self.resident: dict[str, Resident] = {}
        self.active: str | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        #: Held while a reranker loads: one reranker is resident at a time, and two loads of
        #: different rerankers must not both end resident.
        self._reranker_turn = asyncio.Lock()
        #: A model locked (by the steering plugin) is the only one GET /v1/models lists.
        self.locked: str | None = None
        #: Models a keep_alive gave a deadline: the time (epoch seconds) each is unloaded at, idle.
        self._expiry: dict[str, float] = {}
        self._background: set[asyncio.Task[Any]] = set()
        #: Models another instance answers (accepted peer routes): model id → a Resident whose
        #: engine forwards there. Kept in memory only; ``forward``/``unforward`` change it.
        self.forwards: dict[str, Resident] = {}
        #: model id → what GET /v1/models/{id} and GET /api/models say of its route
        self.forward_info: dict[str, dict[str, Any]] = {}

    # --- names ----------------------------------------------------------------------
    def default_name(self) -> str:
        return self._kernel.startup_model or DEFAULT_MODEL_ID

    def resolve(self, name: str | None) -> ModelEntry:
        """The registry entry a request names; no name (or "localm") means the active model."""
        if not name or name == "localm":
            name = self.active or self.default_name()
        return self.registry.get(name)

    def engine_name(self, entry: ModelEntry) -> str:
        engines = self._kernel.engines
        if entry.engine is not None:
            if entry.engine in engines:
                return entry.engine
            raise LocalmError(503, f"No active engine {entry.engine} serves {entry.id}", code="no_engine")
        formats = self._kernel.engine_formats
        for slot in (0, 1):  # an engine that lists the format, else one that falls back to it
            for name in engines:
                if entry.type in formats.get(name, ((), ()))[slot]:
                    return name
        plugins = self._kernel.plugins.plugins.values()
        could = sorted(p.name for p in plugins if p.manifest is not None and not p.active
                       and entry.type in p.manifest.engine_formats)
        hint = (f"enable the {' or '.join(could)} plugin" if could
                else "enable an engine plugin that serves them (localm plugin list shows the Engines group)")
        raise LocalmError(503, f"No active engine can run {entry.type} models: {hint}", code="no_engine")

    # --- loading --------------------------------------------------------------------
    async def load(self, name: str | None, *, activate: bool = True,
                   options: dict[str, Any] | None = None) -> tuple[Resident, bool]:
        """(resident, was_loaded_now). Concurrent loads of one model share one load.

        Loading a chat model makes it the active one (what a request without a model gets),
        unless ``activate`` is False (a model routed to for one request's needs); an embedding
        model or a reranker never becomes active. Loading a reranker first
        unloads any other resident reranker, waiting for its requests as ``unload_one`` does.
        ``options`` go to the engine's factory for this load (``n_gpu_layers``: a load's own GPU
        layer count); a model already resident keeps how it was loaded.
        """
        entry = self.resolve(name)
        if entry.role == "adapter":  # a LoRA: it changes a model, it is none
            raise LocalmError(400, f"{entry.id} is a LoRA adapter, not a model: apply it to a model with "
                                   f"`localm pull MODEL_FILE --lora {entry.id}` and load that",
                              code="model_is_adapter")
        forwarded = self.forwards.get(entry.id)
        if forwarded is not None:  # another instance answers it: nothing loads here
            return forwarded, False
        lock = self._locks.setdefault(entry.id, asyncio.Lock())
        async with lock:
            found = self.resident.get(entry.id)
            if found is not None:
                return found, False
            if entry.role != "reranker":
                return await self._load_now(entry, activate, options), True
            async with self._reranker_turn:
                await self._unload_rerankers(keep=entry.id)
                return await self._load_now(entry, options=options), True

    async def _load_now(self, entry: ModelEntry, activate: bool = True,
                        options: dict[str, Any] | None = None) -> Resident:
        engine_name = self.engine_name(entry)
        plugin, factory = self._kernel.engines[engine_name]
        started = time.perf_counter()
        try:
            engine = await asyncio.to_thread(factory, entry, dict(options or {}))
        except EngineError as exc:
            raise LocalmError(500, f"Could not load {entry.id}: {exc}", code=exc.code or "model_load_failed") from exc
        resident = Resident(entry=entry, engine=engine, loaded_at=time.time(), plugin=plugin)
        self.resident[entry.id] = resident
        if entry.role == "chat" and entry.provider is None and activate:
            self.active = entry.id
        self._update_gauge()
        log.info("loaded %s with %s in %.2fs", entry.id, engine_name, time.perf_counter() - started)
        return resident

    async def _unload_rerankers(self, keep: str) -> None:
        """Unload every resident reranker but ``keep``; 503 model_busy when one stays in use."""
        for other in [r for r in self.resident.values() if r.entry.role == "reranker" and r.entry.id != keep]:
            out = await self._unload(other)  # by the resident: its entry may have left the registry
            if out["status"] == "confirm_required":
                raise LocalmError(503, f"One reranker is resident at a time, and {other.entry.id} is still in use; "
                                       "retry in a moment", code="model_busy")
            log.info("unloaded the reranker %s to load %s", other.entry.id, keep)

    @contextlib.asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[Resident]:
        """Hold a model for one request: loaded on demand, never unloaded while held."""
        hold = await self.hold(name)
        try:
            yield hold.resident
        finally:
            hold.release()

    async def hold(self, name: str | None, *, activate: bool = True) -> Hold:
        """``use`` without the block: the model stays held until ``release()`` (a request whose
        reply streams after its handler returned holds it that long). ``activate``: as ``load``."""
        entry = self.resolve(name)
        current = self.resident.get(entry.id)
        if current is not None and current.unloading:
            raise LocalmError(503, f"Model {entry.id} is being unloaded; retry in a moment", code="model_busy")
        resident, _ = await self.load(entry.id, activate=activate)
        if resident.unloading:
            raise LocalmError(503, f"Model {entry.id} is being unloaded; retry in a moment", code="model_busy")
        resident.in_flight += 1
        return Hold(resident)

    async def unload_one(self, name: str, grace: float = UNLOAD_GRACE_SECONDS) -> dict[str, Any]:
        entry = self.registry.get(name)
        resident = self.resident.get(entry.id)
        if resident is None:
            return {"status": "already_unloaded", "model": entry.id}
        return await self._unload(resident, grace)

    async def _unload(self, resident: Resident, grace: float = UNLOAD_GRACE_SECONDS) -> dict[str, Any]:
        """Unload ``resident`` once its requests finish (up to ``grace`` seconds)."""
        entry = resident.entry
        resident.unloading = True
        deadline = time.monotonic() + grace
        while resident.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if resident.in_flight:
            resident.unloading = False
            return {"status": "confirm_required", "model": entry.id,
                    "detail": f"{resident.in_flight} request(s) still use {entry.id}; it stays loaded"}
        self.resident.pop(entry.id, None)
        before = vram_of(resident.engine)
        after = await asyncio.to_thread(self._close, resident.engine)
        was_active = self.active == entry.id
        if was_active:
            self.active = None
        self._update_gauge()
        out = {"status": "unloaded", "model": entry.id, "was_active": was_active}
        if before is not None:  # the accelerator's free memory, read before and after
            out.update(vram_before_bytes=before[1] - before[0])
            if after is None:
                out.update(vram_reading_uncertain=True, vram_note="GPU memory could not be read after the unload")
            else:
                out.update(vram_after_bytes=after[1] - after[0], vram_freed=max(0, after[0] - before[0]))
        return out

    @staticmethod
    def _close(engine: Any) -> tuple[int, int] | None:
        """Close ``engine``; the accelerator memory reading after, when it has one."""
        reading = getattr(engine, "vram", None)
        engine.close()
        if not callable(reading):
            return None
        time.sleep(0.05)  # a driver reclaims freed memory a moment after the free returns
        return vram_of(engine)

    async def unload_all(self, grace: float = UNLOAD_GRACE_SECONDS) -> dict[str, Any]:
        if not self.resident:
            return {"status": "already_unloaded", "unloaded_models": [], "embedder_unloaded": False}
        results = await asyncio.gather(*(self.unload_one(n, grace) for n in list(self.resident)))
        unloaded = [r["model"] for r in results if r["status"] == "unloaded"]
        kept = [r for r in results if r["status"] == "confirm_required"]
        out: dict[str, Any] = {"status": "unloaded" if unloaded else "in_use", "unloaded_models": unloaded,
                               "embedder_unloaded": False}
        if kept:
            out["skipped_in_use"] = [r["model"] for r in kept]
            out["confirm_required"] = {r["model"]: r["detail"] for r in kept}
        return out

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        self._expiry.clear()
        for model_id in list(self.forwards):
            forwarded = self.forwards.pop(model_id)
            self.forward_info.pop(model_id, None)
            forwarded.engine.close()
        for resident in list(self.resident.values()):
            self.resident.pop(resident.entry.id, None)
            await asyncio.to_thread(resident.engine.close)

    def rename(self, name: str, new_name: str) -> dict[str, Any]:
        entry, new_id = self.registry.rename(name, new_name)
        resident = self.resident.pop(entry.id, None)
        if resident is not None:
            resident.entry = attrs.evolve(resident.entry, id=new_id)
            self.resident[new_id] = resident
        if self.active == entry.id:
            self.active = new_id
        return {"status": "renamed", "model": entry.id, "new_name": new_id, "notes": []}

    # --- models another instance answers ------------------------------------------------
    def forward(self, model_id: str, engine: Engine, info: dict[str, Any], *, plugin: str) -> None:
        """Answer ``model_id`` with ``engine`` (one that forwards to another instance) instead
        of loading it here, until ``unforward``; ``info`` is what the model's detail shows."""
        entry = self.registry.get(model_id)
        self.unforward(entry.id)
        self.forwards[entry.id] = Resident(entry=entry, engine=engine, loaded_at=time.time(), plugin=plugin)
        self.forward_info[entry.id] = dict(info)

    def unforward(self, model_id: str) -> bool:
        """Stop forwarding ``model_id``; whether it was. Its engine closes once its requests end."""
        gone = self.forwards.pop(model_id, None)
        self.forward_info.pop(model_id, None)
        if gone is None:
            return False
        gone.unloading = True
        try:
            self._later(self._close_when_idle(gone))
        except RuntimeError:  # no running loop: nothing can be using it
            gone.engine.close()
        return True

    async def _close_when_idle(self, resident: Resident) -> None:
        while resident.in_flight:
            await asyncio.sleep(0.1)
        resident.engine.close()

    def forwarded(self, name: str | None) -> dict[str, Any] | None:
        """What the route of the model ``name`` resolves to says, or None when it has none."""
        try:
            entry = self.resolve(name)
        except LocalmError:
            return None
        return self.forward_info.get(entry.id)

    async def unload_idle(self) -> dict[str, Any]:
        """Unload every loaded model no request is using (another instance asked for the memory)."""
        freed, kept, size = [], [], 0
        for resident in list(self.resident.values()):
            if resident.in_flight or resident.unloading:
                kept.append(resident.entry.id)
                continue
            out = await self._unload(resident, grace=0.0)
            if out["status"] == "unloaded":
                freed.append(resident.entry.id)
                size += int(resident.entry.size_bytes or 0)
            else:
                kept.append(resident.entry.id)
        return {"status": "unloaded" if freed else "nothing_idle", "freed": freed, "kept_in_use": kept,
                "freed_bytes": size}

    # --- residency: how long an idle model stays loaded -----------------------------------
    async def keep_alive(self, name: str, seconds: float | None) -> None:
        """Ollama's ``keep_alive``, for any surface: unload the model ``seconds`` after now once
        no request uses it (a later call moves the deadline); negative or infinite: keep it
        loaded until unloaded; 0: unload it now, or once its running requests end; None: leave it as it is
        (a model stays loaded until unloaded)."""
        if seconds is None:
            return
        entry = self.resolve(name)
        if seconds < 0 or seconds == float("inf"):
            self._expiry.pop(entry.id, None)
            return
        if seconds > 0:
            deadline = time.time() + seconds
            self._expiry[entry.id] = deadline
            self._later(self._expire(entry.id, deadline))
            return
        self._expiry.pop(entry.id, None)
        resident = self.resident.get(entry.id)
        if resident is None:
            return
        if resident.in_flight:
            self._later(self._unload_quietly(entry.id))
        else:
            await self._unload_quietly(entry.id)

    def expires_at(self, name: str) -> float | None:
        """When a loaded model is unloaded (epoch seconds); None: it stays loaded until unloaded."""
        resident = self.resident.get(name)
        deadline = self._expiry.get(name)
        return deadline if resident is not None and deadline is not None and deadline >= resident.loaded_at else None

    def _later(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _unload_quietly(self, model_id: str) -> None:
        try:
            out = await self.unload_one(model_id)
        except LocalmError as exc:
            log.info("keep_alive: %s not unloaded: %s", model_id, exc.detail)
            return
        if out.get("status") == "confirm_required":
            log.info("keep_alive: %s", out.get("detail"))

    async def _expire(self, model_id: str, deadline: float) -> None:
        while self._expiry.get(model_id) == deadline:
            await asyncio.sleep(max(0.0, deadline - time.time()))
            if self._expiry.get(model_id) != deadline:
                return  # a later request moved it
            resident = self.resident.get(model_id)
            if resident is None:
                self._expiry.pop(model_id, None)
                return
            if resident.in_flight:  # in use: look again in a second
                deadline = self._expiry[model_id] = time.time() + 1.0
                continue
            self._expiry.pop(model_id, None)
            await self._unload_quietly(model_id)

    def _update_gauge(self) -> None:
        metrics = self._kernel.metrics
        if metrics is not None:
            metrics.models_loaded = len(self.resident)

    def lock(self, name: str | None) -> str | None:
        """Lock ``name`` (None unlocks): while locked, GET /v1/models lists only that model, so
        OpenAI clients see one stable model id. Returns the locked id."""
        self.locked = None if name is None else self.registry.get(name).id
        return self.locked

    # --- the registry, for surfaces that manage models (the Ollama API) ----------------
    def entries(self) -> list[ModelEntry]:
        """Every registered model, and the models active plugins provide."""
        return self.registry.entries()

    def provide(self, plugin: str, entries: list[ModelEntry | dict[str, Any]]) -> None:
        """Set the models ``plugin`` provides (listed and answered like registered ones, by the
        engine each entry names; an empty list withdraws them). An entry is a ModelEntry or a
        dict with ``id`` and ``engine`` (and optionally ``role``, ``capabilities``, ``source``).
        A model it no longer provides is unloaded once its requests finish."""
        made = []
        for item in entries:
            if isinstance(item, dict):
                if not isinstance(item.get("id"), str) or not item["id"] or not isinstance(item.get("engine"), str):
                    raise ValueError("a provided model needs an id and an engine (strings)")
                item = ModelEntry(id=item["id"], path="", source=item.get("source") or f"plugin:{plugin}",
                                  type=item.get("type", "provided"), role=item.get("role", "chat"),
                                  capabilities=dict(item.get("capabilities") or {}), engine=item["engine"],
                                  created=item.get("created") or time.time())
            made.append(item)
        for gone in self.registry.provide(plugin, made):
            resident = self.resident.get(gone)
            if resident is not None:
                asyncio.get_running_loop().create_task(self._unload(resident))

    def engine_gone(self, plugin: str) -> list[str]:
        """``plugin`` stopped: the models its engines loaded are unloaded once their requests
        finish (those still held after the grace period stay until unloaded by hand)."""
        for model_id in [m for m, r in self.forwards.items() if r.plugin == plugin]:
            self.unforward(model_id)
        gone = [r for r in self.resident.values() if r.plugin == plugin and not r.unloading]
        loop = asyncio.get_running_loop()
        for resident in gone:
            loop.create_task(self._unload(resident))
        return [r.entry.id for r in gone]

    def copy(self, name: str, new_name: str) -> ModelEntry:
        """Register the files of ``name`` under a second id."""
        from .models import model_id

        if not new_name.strip():
            raise LocalmError(400, "The new name must not be empty")
        entry = self.registry.stored_entry(name)
        copy = attrs.evolve(entry, id=model_id(new_name, named=True), aliases=(), created=time.time())
        return self.registry.add(copy)

    async def pull(self, source: str, name: str | None = None, projector: str | None = None,
                   adapters: list[tuple[str, float]] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Register models from ``source`` (what ``localm pull`` accepts; ``projector`` is its
        ``--mmproj``, ``adapters`` its ``--lora``: (adapter, scale) pairs), reporting progress.

        Yields ``{"status": text}`` steps, ``{"status": "pulling FILE", "total", "completed"}``
        while a file downloads (bytes), ``{"status": "verifying sha256 digest", "total",
        "completed"}`` while a file is hashed, and last ``{"status": "success", "models":
        [ids]}``. A failure raises its LocalmError (before or between the steps).
        """
        from .deps import pip_install_sync
        from .models import pull as pull_model

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

        def put(item: dict[str, Any] | BaseException | None) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        last = [0.0]

        def progress(done: int, total: int, status: str = "verifying sha256 digest") -> None:
            now = time.monotonic()
            if done >= total or now - last[0] >= 0.1:  # at most ten a second
                last[0] = now
                put({"status": status, "total": total, "completed": done})

        def work() -> None:
            try:
                entries = pull_model(self.registry, source, name=name, log=lambda line: put({"status": line}),
                                     pip=pip_install_sync, progress=progress, projector=projector,
                                     adapters=adapters)
                put({"status": "success", "models": [e.id for e in entries]})
            except BaseException as exc:  # handed to the consumer
                put(exc)
            finally:
                put(None)

        worker = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            while (item := await events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            await worker


    async def remove(self, name: str) -> ModelEntry:
        """Unload ``name`` (waiting for its requests, as an unload does) and forget it; its files stay."""
        entry = self.registry.stored_entry(name)
        out = await self.unload_one(entry.id)
        if out["status"] == "confirm_required":
            raise LocalmError(409, out["detail"], code="model_busy")
        return self.registry.remove(entry.id)
