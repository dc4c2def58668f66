"""The ComfyUI backend: one already running at ``comfy_url``, or one localm launches from
``comfy_path`` with ``comfy_python`` on first use (a free loopback port, its own output,
input, user and temp folders under the plugin's data folder). ComfyUI is a separate
process reached over HTTP and its websocket; none of its code is imported.

``Comfy.run`` submits one graph to ``/prompt`` with a client id, follows the websocket
(``progress_state``, ``executing``, ``executed``, ``execution_error``,
``execution_interrupted``) and reads the outputs from ``/history`` and ``/view``. Its
refusals are LocalmErrors: ComfyUI's validation errors a 400 naming the node and input,
an execution error a 502 with ComfyUI's message, ComfyUI down a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

import httpx
from localm import sdk

log = logging.getLogger("localm.plugin.images")

STATUS_TIMEOUT = 5.0
STOP_TIMEOUT = 10.0

_prctl = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        _prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: ComfyUI stops when localm does, however it ends


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Down(sdk.LocalmError):
    def __init__(self, detail: str) -> None:
        super().__init__(503, detail, code="comfy_unavailable")


class Interrupted(sdk.LocalmError):
    def __init__(self, detail: str) -> None:
        super().__init__(409, detail, code="cancelled")


def validation_error(body: Any) -> sdk.LocalmError:
    """ComfyUI's 400 from POST /prompt, as a 400 that names the node and the input."""
    error = body.get("error") if isinstance(body, dict) else None
    node_errors = body.get("node_errors") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": str(body)[:500]}
    parts: list[str] = []
    first: dict[str, Any] = {}
    for node_id, found in (node_errors or {}).items():
        if not isinstance(found, dict):
            continue
        for e in found.get("errors") or []:
            if not isinstance(e, dict):
                continue
            inp = (e.get("extra_info") or {}).get("input_name")
            where = f"node {node_id} ({found.get('class_type', '?')})" + (f", input {inp}" if inp else "")
            what = e.get("message", "invalid")
            details = e.get("details")
            parts.append(f"{where}: {what}" + (f" ({details})" if details and details != inp else ""))
            if not first:
                first = {"node": str(node_id), "class_type": found.get("class_type"), "input": inp,
                         "comfy_type": e.get("type")}
    if not parts:
        info = error.get("extra_info") or {}
        where = f"node {info['node_id']} ({info.get('class_type', '?')}): " if info.get("node_id") else ""
        details = error.get("details")
        parts.append(where + str(error.get("message", "invalid workflow")) + (f" ({details})" if details else ""))
        first = {"node": info.get("node_id"), "class_type": info.get("class_type"), "input": None,
                 "comfy_type": error.get("type")}
    param = f"{first['node']}.{first['input']}" if first.get("node") and first.get("input") else None
    return sdk.LocalmError(400, "ComfyUI refused the workflow: " + "; ".join(parts), code="workflow_invalid",
                           param=param, comfy_error=first)


def execution_error(data: dict[str, Any]) -> sdk.LocalmError:
    node, kind = data.get("node_id"), data.get("node_type")
    message = str(data.get("exception_message") or "").strip()
    exc_type = data.get("exception_type")
    detail = f"ComfyUI failed running node {node} ({kind}): " + (f"{exc_type}: " if exc_type else "") + message
    return sdk.LocalmError(502, detail, code="generation_failed",
                           comfy_error={"node": node, "class_type": kind, "exception_type": exc_type})


class Run:
    """What one submitted graph produced."""

    def __init__(self, prompt_id: str) -> None:
        self.prompt_id = prompt_id
        self.images: list[dict[str, Any]] = []  # {"filename", "subfolder", "type"} as ComfyUI reports them
        self.cached: set[str] = set()


class Comfy:
    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.proc: subprocess.Popen[bytes] | None = None
        self.launched_url: str | None = None
        self.launched_dirs: dict[str, Path] = {}
        self.stopping = False
        self.ready = False  # the launched ComfyUI has answered
        self.ready_by = 0.0
        self.exit_note: str | None = None  # why the launched ComfyUI is gone, when it died on its own
        self._start_lock = asyncio.Lock()
        self._log_file: Any = None
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0), trust_env=False)

    # --- where ComfyUI is ---------------------------------------------------------------
    @property
    def settings(self) -> dict[str, Any]:
        return self.plugin.settings

    def external_url(self) -> str | None:
        url = (self.settings.get("comfy_url") or "").strip().rstrip("/")
        return url or None

    def launch_mode(self) -> bool:
        return self.external_url() is None and bool((self.settings.get("comfy_path") or "").strip())

    @property
    def launched_by_localm(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run_dir(self) -> Path:
        return self.plugin.data_dir / "comfy"

    def output_dir(self) -> Path | None:
        """Where this ComfyUI writes its images on this machine, when localm knows it."""
        if self.external_url() is None:
            return self.launched_dirs.get("output")
        configured = (self.settings.get("comfy_output_dir") or "").strip()
        return Path(configured).expanduser() if configured else None

    def file_of(self, image: dict[str, Any]) -> Path | None:
        """Where an image ComfyUI reported lies on this machine, when localm knows."""
        kind = image.get("type") or "output"
        if kind == "output":
            root = self.output_dir()
        elif kind == "temp" and self.external_url() is None and "temp" in self.launched_dirs:
            root = self.launched_dirs["temp"] / "temp"  # --temp-directory X writes into X/temp
        else:
            root = None
        if root is None:
            return None
        path = (root / (image.get("subfolder") or "") / image["filename"]).resolve()
        return path if path.is_relative_to(root.resolve()) else None

    def _crash_note(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None and not self.stopping:
            if self.exit_note is None:
                self.exit_note = (f"ComfyUI (launched by localm on {self.launched_url}) exited with code "
                                  f"{self.proc.returncode}; POST /v1/comfy/restart starts it again."
                                  + self._log_tail())
        return self.exit_note

    def _log_tail(self, lines: int = 8) -> str:
        try:
            with open(self.run_dir() / "comfy.log", "rb") as f:
                tail = deque(f, maxlen=lines)
        except OSError:
            return ""
        text = b"".join(tail).decode(errors="replace").strip()
        return f" Its log ends: {text}" if text else ""

    async def url(self, *, launch: bool = True) -> str:
        """The base URL of a live ComfyUI (launching it on first use); 503 when there is none."""
        external = self.external_url()
        if external is not None:
            if not await self.alive(external):
                raise Down(f"ComfyUI is not answering at {external} (comfy_url)")
            return external
        if not self.launch_mode():
            raise Down("No ComfyUI is configured: set comfy_url to a running ComfyUI, or comfy_path (and "
                       "comfy_python) for localm to start one (POST /v1/media/config/images)")
        note = self._crash_note()
        if note is not None:
            raise Down(note)
        if self.launched_by_localm and self.launched_url is not None and self.ready:
            return self.launched_url
        if not launch:
            raise Down("ComfyUI is not running")
        try:
            return await self.start()
        except sdk.LocalmError as exc:
            if exc.status == 504:
                raise Down(exc.detail) from exc
            raise

    async def alive(self, url: str) -> bool:
        try:
            r = await self.http.get(f"{url}/system_stats", timeout=STATUS_TIMEOUT)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def status(self) -> dict[str, Any]:
        external = self.external_url()
        if external is not None:
            return {"alive": await self.alive(external), "launched_by_localm": False, "url": external}
        if self.launched_by_localm and self.launched_url is not None:
            return {"alive": await self.alive(self.launched_url), "launched_by_localm": True,
                    "url": self.launched_url}
        out: dict[str, Any] = {"alive": False, "launched_by_localm": False, "url": None}
        note = self._crash_note()
        if note is not None:
            out["message"] = note
        return out

    # --- launching ------------------------------------------------------------------------
    def _command(self, port: int) -> tuple[list[str], Path]:
        path = Path(self.settings["comfy_path"]).expanduser()
        if not (path / "main.py").is_file():
            raise Down(f"comfy_path {path} holds no ComfyUI (no main.py)")
        python = (self.settings.get("comfy_python") or "").strip()
        if not python:
            found = next((p for p in (path / "venv" / "bin" / "python", path / ".venv" / "bin" / "python",
                                      path.parent / "venv" / "bin" / "python") if p.is_file()), None)
            if found is None:
                raise Down(f"Set comfy_python: no virtualenv was found beside {path} to run ComfyUI with")
            python = str(found)
        run = self.run_dir()
        dirs = {"output": run / "output", "input": run / "input", "user": run / "user", "temp": run / "temp"}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        self.launched_dirs = dirs
        cmd = [python, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
               "--output-directory", str(dirs["output"]), "--input-directory", str(dirs["input"]),
               "--user-directory", str(dirs["user"]), "--temp-directory", str(dirs["temp"])]
        try:
            args_source = (path / "comfy" / "cli_args.py").read_text(errors="replace")
        except OSError:
            args_source = ""
        if "--database-url" in args_source:  # its default database lives in the user folder it no longer has
            cmd += ["--database-url", "sqlite:///:memory:"]
        cmd += [str(a) for a in self.settings.get("comfy_args") or []]
        return cmd, path

    async def start(self) -> str:
        """Start ComfyUI (unless it is starting or running already) and wait until it answers."""
        async with self._start_lock:
            if self.launched_by_localm and self.launched_url is not None:
                if self.ready:
                    return self.launched_url
            else:
                self._spawn()
            assert self.proc is not None and self.launched_url is not None
            url = self.launched_url
            while time.monotonic() < self.ready_by:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.proc, self.launched_url = None, None
                    raise Down(f"ComfyUI exited with code {code} while starting." + self._log_tail())
                if await self.alive(url):
                    self.ready = True
                    log.info("ComfyUI is up on %s", url)
                    return url
                await asyncio.sleep(0.25)
            await self._terminate()
            raise sdk.LocalmError(504, "ComfyUI did not start within start_timeout seconds." + self._log_tail(),
                                  code="comfy_start_timeout")

    def _spawn(self) -> None:
        port = _free_port()
        cmd, cwd = self._command(port)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("LOCALM_") and k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        self.run_dir().mkdir(parents=True, exist_ok=True)
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self.run_dir() / "comfy.log", "wb")
        self.stopping, self.exit_note, self.ready = False, None, False
        try:
            # spawned from the event loop's thread, which lives as long as the server
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                         stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        except OSError as exc:
            self.proc = None
            raise Down(f"Could not start ComfyUI with {cmd[0]}: {exc}") from exc
        self.launched_url = f"http://127.0.0.1:{port}"
        self.ready_by = time.monotonic() + float(self.settings.get("start_timeout") or 120)
        log.info("starting ComfyUI (pid %s) on %s", self.proc.pid, self.launched_url)

    async def _terminate(self) -> bool:
        proc = self.proc
        if proc is None:
            return False
        self.stopping = True
        was_running = proc.poll() is None
        if was_running:
            proc.terminate()
            deadline = time.monotonic() + STOP_TIMEOUT
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if proc.poll() is None:
                proc.kill()
                while proc.poll() is None:
                    await asyncio.sleep(0.05)
        self.proc, self.launched_url, self.exit_note, self.ready = None, None, None, False
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return was_running

    async def stop(self) -> dict[str, Any]:
        external = self.external_url()
        if external is not None and self.proc is None:
            return {"ok": False, "message": f"The ComfyUI at {external} (comfy_url) was not started by localm: "
                                            "stop it where it runs"}
        async with self._start_lock:
            if await self._terminate():
                return {"ok": True, "message": "Stopped the ComfyUI localm launched"}
        return {"ok": True, "message": "ComfyUI was not running"}

    async def restart(self) -> dict[str, Any]:
        external = self.external_url()
        if external is not None:
            return {"ok": False, "message": f"The ComfyUI at {external} (comfy_url) was not started by localm: "
                                            "restart it where it runs"}
        if not self.launch_mode():
            return {"ok": False, "message": "No ComfyUI is configured: set comfy_path (and comfy_python) first"}
        async with self._start_lock:
            await self._terminate()
        url = await self.start()
        return {"ok": True, "message": f"ComfyUI is running on {url}"}

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._terminate()
        await self.http.aclose()

    # --- one generation ---------------------------------------------------------------------
    async def object_input(self, url: str, class_type: str, name: str) -> dict[str, Any]:
        """The options (min, max, default...) of one input of a node class, from /object_info."""
        try:
            r = await self.http.get(f"{url}/object_info/{class_type}", timeout=STATUS_TIMEOUT)
            info = r.json().get(class_type, {}).get("input", {})
        except (httpx.HTTPError, ValueError, AttributeError):
            return {}
        for group in ("required", "optional"):
            spec = (info.get(group) or {}).get(name)
            if isinstance(spec, list) and len(spec) > 1 and isinstance(spec[1], dict):
                return spec[1]
        return {}

    async def _post(self, url: str, path: str, body: dict[str, Any]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(f"{url}{path}", json=body, timeout=STATUS_TIMEOUT)

    async def interrupt(self, url: str, prompt_id: str) -> None:
        """Stop ``prompt_id``: interrupt it if it runs, take it off the queue if it waits."""
        await self._post(url, "/interrupt", {"prompt_id": prompt_id})
        await self._post(url, "/queue", {"delete": [prompt_id]})

    async def forget(self, url: str, prompt_id: str) -> None:
        await self._post(url, "/history", {"delete": [prompt_id]})

    async def run(self, url: str, graph: dict[str, Any], *, timeout: float, prompt_id: str,
                  on_event: Callable[[str, dict[str, Any]], Awaitable[None] | None]) -> Run:
        """Run one graph (as ``prompt_id``) to its end; its outputs are in the returned Run."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, WebSocketException

        client_id = uuid.uuid4().hex
        parts = urlsplit(url)
        ws_url = f"{'wss' if parts.scheme == 'https' else 'ws'}://{parts.netloc}{parts.path}/ws?clientId={client_id}"
        try:
            ws = await connect(ws_url, max_size=None, open_timeout=10, proxy=None)
        except (OSError, WebSocketException, asyncio.TimeoutError) as exc:
            raise Down(await self._why_down(url) or f"ComfyUI's websocket at {url} did not open: {exc}") from exc
        submitted = False
        finished = False
        try:
            try:
                r = await self.http.post(f"{url}/prompt", json={"prompt": graph, "client_id": client_id,
                                                                 "prompt_id": prompt_id})
            except httpx.HTTPError as exc:
                raise Down(f"ComfyUI at {url} did not take the workflow: {exc}") from exc
            if r.status_code == 400:
                try:
                    raise validation_error(r.json())
                except ValueError:
                    raise sdk.LocalmError(400, f"ComfyUI refused the workflow: {r.text[:300]}",
                                          code="workflow_invalid") from None
            if r.status_code != 200:
                raise sdk.LocalmError(502, f"ComfyUI answered {r.status_code} to POST /prompt: {r.text[:300]}",
                                      code="generation_failed")
            submitted = True
            accepted = r.json()
            prompt_id = str(accepted.get("prompt_id") or prompt_id)
            if accepted.get("node_errors"):
                # ComfyUI runs the outputs that validate and drops the others: a workflow one
                # of whose outputs is refused is refused whole
                raise validation_error({"error": {"message": "Prompt outputs failed validation"},
                                        "node_errors": accepted["node_errors"]})
            out = Run(prompt_id)
            try:
                async with asyncio.timeout(timeout):
                    async for raw in ws:
                        if isinstance(raw, bytes):
                            continue  # previews from samplers
                        try:
                            message = json.loads(raw)
                        except ValueError:
                            continue
                        kind, data = message.get("type"), message.get("data") or {}
                        if not isinstance(data, dict) or data.get("prompt_id") != prompt_id:
                            continue
                        if kind == "execution_error":
                            raise execution_error(data)
                        if kind == "execution_interrupted":
                            raise Interrupted(f"ComfyUI interrupted the generation at node {data.get('node_id')} "
                                              f"({data.get('node_type')})")
                        if kind == "execution_cached":
                            out.cached.update(str(n) for n in data.get("nodes") or [])
                        result = on_event(kind, data)
                        if asyncio.iscoroutine(result):
                            await result
                        if kind == "executing" and data.get("node") is None:
                            finished = True
                            break
            except TimeoutError:
                raise sdk.LocalmError(502, f"The generation did not finish within {timeout:g} s (timeout); "
                                           "ComfyUI was interrupted", code="generation_timeout") from None
            except ConnectionClosed:
                pass
            if not finished:
                # the websocket went away: ComfyUI stopped, or only the socket did
                if not await self.alive(url):
                    raise Down(await self._why_down(url) or f"ComfyUI at {url} stopped during the generation")
            await self._outputs(url, out, wait=not finished, timeout=timeout)
            return out
        except BaseException:
            if submitted and not finished:
                await asyncio.shield(self.interrupt(url, prompt_id))
            raise
        finally:
            with contextlib.suppress(Exception):
                await ws.close()

    async def _why_down(self, url: str) -> str | None:
        """Why the ComfyUI localm launched went away, when it did (waiting a moment for a
        process that is still exiting)."""
        if self.proc is None or url != self.launched_url:
            return None
        for _ in range(30):
            if self.proc.poll() is not None:
                return self._crash_note()
            await asyncio.sleep(0.1)
        return None

    async def _outputs(self, url: str, out: Run, *, wait: bool, timeout: float) -> None:
        deadline = time.monotonic() + (timeout if wait else 10.0)
        while True:
            try:
                r = await self.http.get(f"{url}/history/{out.prompt_id}", timeout=STATUS_TIMEOUT)
                entry = r.json().get(out.prompt_id)
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                raise Down(f"ComfyUI at {url} did not report the generation's outputs: {exc}") from exc
            if entry:
                break
            if time.monotonic() > deadline:
                raise sdk.LocalmError(502, "ComfyUI did not report the generation's outputs",
                                      code="generation_failed")
            await asyncio.sleep(0.25)
        status = entry.get("status") or {}
        if status.get("status_str") == "error":
            for kind, data in status.get("messages") or []:
                if kind == "execution_error":
                    raise execution_error(data)
                if kind == "execution_interrupted":
                    raise Interrupted("ComfyUI interrupted the generation")
            raise sdk.LocalmError(502, "ComfyUI reported the generation failed", code="generation_failed")
        order = list((entry.get("outputs") or {}).keys())
        for node_id in order:
            for image in (entry["outputs"][node_id] or {}).get("images") or []:
                if isinstance(image, dict) and image.get("filename"):
                    out.images.append(image)

    async def view(self, url: str, image: dict[str, Any]) -> bytes:
        params = {"filename": image["filename"], "subfolder": image.get("subfolder") or "",
                  "type": image.get("type") or "output"}
        try:
            r = await self.http.get(f"{url}/view", params=params)
        except httpx.HTTPError as exc:
            raise Down(f"ComfyUI at {url} did not send the image: {exc}") from exc
        if r.status_code != 200:
            raise sdk.LocalmError(502, f"ComfyUI answered {r.status_code} for the image {image['filename']}",
                                  code="generation_failed")
        return r.content
