"""Images: text to image through ComfyUI workflows.

Routes POST /v1/images/generations (the OpenAI Images API), POST /api/imagine (the same
generation as a job), the gallery (/api/imagine/gallery, /api/imagine/file/<name>), the
workflows (/api/imagine/workflows), GET /v1/comfy/status, POST /v1/comfy/stop and
/v1/comfy/restart, GET /v1/media/config and POST /v1/media/config/images. ComfyUI runs as a
separate process (``comfy.py``); workflows and their field mapping are in ``workflows.py``,
the generation job in ``generate.py``. docs/images.md describes it for users.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import attrs
from localm import sdk

from . import workflows
from .comfy import Comfy
from .gallery import Gallery

DEFAULT_WORKFLOW = "txt2img-sd"
SHIPPED = Path(__file__).resolve().parent / "workflows"


@attrs.frozen
class Settings:
    comfy_url: str = sdk.setting(
        "", owner_only=True, description="A ComfyUI that is already running (http://127.0.0.1:8188); empty: "
                                         "localm starts one from comfy_path")
    comfy_path: str = sdk.setting(
        "", owner_only=True, description="A ComfyUI folder (the one holding main.py) that localm starts on first "
                                         "use, on a free loopback port")
    comfy_python: str = sdk.setting(
        "", owner_only=True, description="The Python that runs comfy_path (empty: a venv or .venv in or beside it)")
    comfy_args: list[str] = sdk.setting(
        factory=list, owner_only=True, description="More arguments for the ComfyUI localm starts (--cpu, "
                                                   "--lowvram, ...)")
    comfy_output_dir: str = sdk.setting(
        "", owner_only=True, description="Where the ComfyUI at comfy_url saves images, on this machine (privacy "
                                         "mode deletes each image there)")
    start_timeout: int = sdk.setting(120, min=5, max=1800,
                                     description="Seconds the ComfyUI localm starts has to answer")
    workflow: str = sdk.setting(DEFAULT_WORKFLOW, description="The active workflow (a file in the plugin's "
                                                              "workflows folder, without .json)")
    checkpoint: str = sdk.setting("", description="The checkpoint file the workflow loads (empty: the "
                                                  "workflow's own)")
    timeout: int = sdk.setting(600, min=1, max=86400, description="Seconds one image may take")
    unload_chat_models: bool = sdk.setting(
        False, description="Unload the loaded chat models before each generation (the GPU is ComfyUI's while it "
                           "draws) and load them again after")
    privacy_mode: bool = sdk.setting(
        False, owner_only=True, description="Keep nothing: images go to a private folder that is deleted before "
                                            "the answer, returned as b64_json only, never in the gallery")


class Images:
    """The plugin's running state."""

    def __init__(self, host: Any, plugin: Any) -> None:
        self.host = host
        self.plugin = plugin
        self.comfy = Comfy(plugin)
        self.workflows = workflows.folder_of(plugin.data_dir)
        self.gallery = Gallery(plugin.data_dir / "gallery")
        #: one generation at a time: ComfyUI runs one graph at a time, and the chat models a
        #: generation unloads are loaded again before the next one starts
        self.turn = asyncio.Lock()

    def start(self) -> None:
        workflows.install_shipped(SHIPPED, self.workflows)
        self.plugin.add_settings([], validate=_validator(self.plugin, self.workflows))

    async def stop(self) -> None:
        await self.comfy.close()

    @property
    def settings(self) -> dict[str, Any]:
        return self.plugin.settings


def _validator(plugin: Any, folder: Path) -> Any:
    """Checks a change to the settings: only the values that change are checked, so a
    workflow file removed since does not block changing something else."""
    def check(block: dict[str, Any]) -> dict[str, Any]:
        before = plugin.stored_settings
        changed = {k: v for k, v in block.items() if before.get(k) != v}
        if "workflow" in changed:
            workflows.load(folder, changed["workflow"])  # 400 unknown, 409 unusable
        url = changed.get("comfy_url")
        if url and not (url.startswith("http://") or url.startswith("https://")):
            raise ValueError("comfy_url must start with http:// or https://")
        path = changed.get("comfy_path")
        if path and not (Path(path).expanduser() / "main.py").is_file():
            raise ValueError(f"comfy_path {path} holds no ComfyUI (no main.py)")
        python = changed.get("comfy_python")
        if python and not Path(python).expanduser().is_file():
            raise ValueError(f"comfy_python {python} is not a file")
        out_dir = changed.get("comfy_output_dir")
        if out_dir and not Path(out_dir).expanduser().is_dir():
            raise ValueError(f"comfy_output_dir {out_dir} is not a folder")
        return block
    return check


@sdk.hookimpl
def create_service(host: Any, plugin: Any) -> Images:
    """ComfyUI, the workflows and the gallery (routes: ``sdk.service_of(request)``)."""
    return Images(host, plugin)


@sdk.hookimpl
def register_settings(register: Any) -> None:
    register(Settings)


@sdk.hookimpl
def register_scopes(register: Any) -> None:
    register("image", "Generate images, and see and delete the ones this key made")


@sdk.hookimpl
def register_routes(register: Any) -> None:
    from . import routes
    register(*routes.HANDLERS)
