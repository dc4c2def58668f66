"""The images plugin against a real ComfyUI 0.30.0 (built once into a cache folder by
tests/comfyui_env.py, started by localm itself on a free loopback port), driven with the
official openai SDK's ``images.generate`` and httpx.

The workflows are weightless (no model files exist here): EmptyImage → SaveImage, whose
width, height and colour receive the request's size and seed, with the prompt going through
a PrimitiveStringMultiline into a PreviewAny output; a slow one of ImageBlur nodes to
cancel and to kill ComfyUI under; one that fails while it runs. One localm server and one
ComfyUI serve the whole module; the tests run in file order (open mode first, then keys).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from PIL import Image

import comfyui_env
from localm.sdk.testing import LocalmServer

PLUGINS = ["chat", "llamacpp", "images"]
CHAT_MODEL = "smollm2-135m-instruct"
COMFY_ARGS = ["--cpu", "--disable-api-nodes", "--disable-all-custom-nodes"]

SOLID = {  # the size and the seed (as the colour) by a sidecar
    "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "solid"}},
    "3": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": ""}},
    "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}},
}
SOLID_MAP = {"prompt": "3.value", "seed": "1.color", "width": "1.width", "height": "1.height",
             "batch_size": "1.batch_size"}
BLURS = 20
SLOW = {  # the same fields by node titles; each blur takes 0.3 to 1 s here, and every test
    # that runs it stops it early
    "1": {"class_type": "EmptyImage", "inputs": {"width": 384, "height": 384, "batch_size": 1, "color": 0},
          "_meta": {"title": "localm:size localm:seed=color"}},
    **{str(10 + i): {"class_type": "ImageBlur",
                     "inputs": {"image": ["1" if i == 0 else str(9 + i), 0], "blur_radius": 31, "sigma": 10.0}}
       for i in range(BLURS)},
    "2": {"class_type": "SaveImage", "inputs": {"images": [str(9 + BLURS), 0], "filename_prefix": "slow"}},
    "3": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": ""}, "_meta": {"title": "localm:prompt=value"}},
    "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}},
}
BROKEN = {  # passes validation, then ImageToMask finds no alpha channel
    "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}},
    "2": {"class_type": "ImageToMask", "inputs": {"image": ["1", 0], "channel": "alpha"}},
    "3": {"class_type": "MaskToImage", "inputs": {"mask": ["2", 0]}},
    "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "broken"}},
    "5": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": ""}},
    "6": {"class_type": "PreviewAny", "inputs": {"source": ["5", 0]}},
}
BROKEN_MAP = {"prompt": "5.value"}
NOSIZE_MAP = {"prompt": "3.value", "seed": "1.color"}  # SOLID's graph, with no size input mapped
NEGATIVE = {**SOLID,  # SOLID with a second text, which the negative prompt goes to
            "5": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": ""}},
            "6": {"class_type": "PreviewAny", "inputs": {"source": ["5", 0]}}}
NEGATIVE_MAP = {**SOLID_MAP, "negative_prompt": "5.value"}


def colour(seed: int) -> tuple[int, int, int]:
    return (seed >> 16) & 0xFF, (seed >> 8) & 0xFF, seed & 0xFF


def decode(png: bytes) -> Image.Image:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    image = Image.open(io.BytesIO(png))
    image.load()
    return image


def pixels(png: bytes) -> tuple[tuple[int, int], set[Any]]:
    image = decode(png).convert("RGB")
    return image.size, {c for _, c in image.getcolors(maxcolors=1 << 24)}


def comfy_child(server: LocalmServer) -> int | None:
    """The pid of the ComfyUI the localm server started (its child process)."""
    for task in Path(f"/proc/{server.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"main.py" in cmdline:
                return int(pid)
    return None


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited: every thread of it (a killed process's main thread
    is a zombie while the others still exit)."""
    try:
        threads = list(Path(f"/proc/{pid}/task").iterdir())
        states = {(t / "stat").read_text().split(")")[-1].split()[0] for t in threads}
    except OSError:
        return True
    return states <= {"Z", "X"}


def eventually(check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


# --- the server, ComfyUI and the keys -------------------------------------------------------

@pytest.fixture(scope="module")
def comfy() -> comfyui_env.ComfyEnv:
    reason = comfyui_env.unavailable()
    if reason is not None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"CI={os.environ['CI']} (.ci/run builds ComfyUI first): {reason}", pytrace=False)
        pytest.skip(reason)
    return comfyui_env.env()


@pytest.fixture(scope="module")
def server(module_server: Any, comfy: comfyui_env.ComfyEnv) -> LocalmServer:
    def prepare(data_dir: Path) -> None:
        folder = data_dir / "plugin-data" / "images" / "workflows"
        folder.mkdir(parents=True)
        for name, graph, mapping in (("solid", SOLID, SOLID_MAP), ("slow", SLOW, None),
                                     ("broken", BROKEN, BROKEN_MAP), ("nosize", SOLID, NOSIZE_MAP),
                                     ("negative", NEGATIVE, NEGATIVE_MAP)):
            (folder / f"{name}.json").write_text(json.dumps(graph))
            if mapping is not None:
                (folder / f"{name}.map.json").write_text(json.dumps(mapping))
    return module_server(plugins=PLUGINS, prepare=prepare)


@pytest.fixture(scope="module")
def owner(server: LocalmServer) -> httpx.Client:
    return server.owner()


def settings(owner: httpx.Client, **values: Any) -> dict[str, Any]:
    r = owner.post("/v1/media/config/images", json=values)
    assert r.status_code == 200, r.text
    return {f["key"]: f["value"] for f in r.json()["fields"]}


@pytest.fixture(scope="module")
def images(server: LocalmServer, owner: httpx.Client, comfy: comfyui_env.ComfyEnv) -> LocalmServer:
    """The server with the plugin enabled and pointed at the ComfyUI folder."""
    assert owner.post("/api/plugins/images/enable").status_code == 200
    settings(owner, comfy_path=str(comfy.path), comfy_python=str(comfy.python), comfy_args=COMFY_ARGS,
             workflow="solid")
    return server


@pytest.fixture(scope="module")
def keys(images: LocalmServer, owner: httpx.Client) -> dict[str, str]:
    """Keys, minted after the open-mode test: the owner key, two image keys, and others."""
    made = {"owner": owner.post("/api/auth/key/rotate").json()["key"]}
    for name, scopes in (("a", ["image"]), ("b", ["image"]), ("models", ["models:read"]),
                         ("config", ["config:read", "config:write"])):
        r = owner.post("/v1/keys", json={"name": name, "scopes": scopes})
        assert r.status_code == 200, r.text
        made[name] = r.json()["key"]
    return made


def sdk_client(server: LocalmServer, key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "none", max_retries=0, timeout=120)


def comfy_url(owner: httpx.Client) -> str:
    status = owner.get("/v1/comfy/status").json()
    assert status["alive"] and status["url"], status
    return status["url"]


def comfy_history(owner: httpx.Client) -> dict[str, Any]:
    return httpx.get(f"{comfy_url(owner)}/history", params={"max_items": 64}, timeout=10).json()


def runs_of(owner: httpx.Client, prompt: str) -> list[dict[str, Any]]:
    """ComfyUI's history entries of the graphs that carried ``prompt``."""
    return [entry for entry in comfy_history(owner).values()
            if any(node["inputs"].get("value") == prompt for node in entry["prompt"][2].values())]


def job_events(client: httpx.Client, job_id: str) -> Iterator[dict[str, Any]]:
    with client.stream("GET", f"/api/jobs/{job_id}/events", timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[6:])


# --- shipped disabled -------------------------------------------------------------------------

def test_ships_disabled_and_its_routes_404(server: LocalmServer, owner: httpx.Client) -> None:
    listed = {p["name"]: p for p in owner.get("/api/plugins").json()["plugins"]}
    assert listed["images"]["enabled"] is False and listed["images"]["scopes"] == ["image"]
    for method, path in (("POST", "/v1/images/generations"), ("POST", "/api/imagine"),
                         ("GET", "/api/imagine/gallery"), ("GET", "/api/imagine/file/x.png"),
                         ("GET", "/v1/comfy/status"), ("POST", "/v1/comfy/restart"), ("GET", "/v1/media/config"),
                         ("POST", "/v1/media/config/images")):
        r = owner.request(method, path, json={"prompt": "a cat"} if method == "POST" else None)
        assert r.status_code == 404, (method, path, r.text)


# --- open mode: b64_json -----------------------------------------------------------------------

def test_open_mode_generates_b64_with_size_seed_and_n(images: LocalmServer, owner: httpx.Client) -> None:
    client = sdk_client(images, None)
    started = time.monotonic()
    result = client.images.generate(model="any", prompt="a lighthouse at dusk", size="64x128",
                                    extra_body={"seed": 0xFF8800})
    first = time.monotonic() - started
    assert isinstance(result.created, int) and len(result.data) == 1 and result.data[0].url is None
    png = base64.b64decode(result.data[0].b64_json)
    assert pixels(png) == ((64, 128), {(255, 136, 0)})
    status = owner.get("/v1/comfy/status").json()
    assert status["alive"] is True and status["launched_by_localm"] is True
    assert status["url"].startswith("http://127.0.0.1:")
    # the prompt reached the input it is mapped to
    assert any(e["prompt"][2]["1"]["inputs"]["color"] == 0xFF8800 for e in runs_of(owner, "a lighthouse at dusk"))
    # one seed twice: the same image; another seed: another image
    again = client.images.generate(prompt="a lighthouse at dusk", size="64x128", extra_body={"seed": 0xFF8800})
    other = client.images.generate(prompt="a lighthouse at dusk", size="64x128", extra_body={"seed": 0x0088FF})
    assert pixels(base64.b64decode(again.data[0].b64_json)) == pixels(png)
    assert pixels(base64.b64decode(other.data[0].b64_json)) == ((64, 128), {(0, 136, 255)})
    # n=3: three images, one seed after another
    three = client.images.with_raw_response.generate(prompt="three", n=3, size="80x64", extra_body={"seed": 1000})
    assert three.headers["x-localm-seed"] == "1000, 1001, 1002"
    got = [pixels(base64.b64decode(d.b64_json)) for d in three.parse().data]
    assert got == [((80, 64), {colour(s)}) for s in (1000, 1001, 1002)]
    # no seed: a random one, within what the mapped input takes
    free = client.images.with_raw_response.generate(prompt="any colour")
    seed = int(free.headers["x-localm-seed"])
    assert 0 <= seed <= 0xFFFFFF
    assert pixels(base64.b64decode(free.parse().data[0].b64_json)) == ((64, 64), {colour(seed)})
    # url cannot be served without a key
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt="a cat", response_format="url")
    assert "No API key is configured" in str(refused.value)
    # the images are in the gallery; ComfyUI's own copies are gone
    listing = owner.get("/api/imagine/gallery").json()["images"]
    assert len(listing) == 7 and {i["workflow"] for i in listing} == {"solid"}
    out = images.data_dir / "plugin-data" / "images" / "comfy" / "output"
    assert out.is_dir() and not [p for p in out.rglob("*.png")]
    print(f"first generation (ComfyUI start included): {first:.1f} s")


# --- keys: url mode and the gallery -----------------------------------------------------------

def test_url_mode_and_the_gallery_belong_to_the_key(images: LocalmServer, keys: dict[str, str]) -> None:
    a = sdk_client(images, keys["a"])
    result = a.images.generate(model="dall-e-3", prompt="a red square", size="64x64", quality="hd", style="vivid",
                               user="someone", extra_body={"seed": 0xFF0000})
    url = result.data[0].url
    assert url and url.startswith(f"{images.url}/api/imagine/file/") and result.data[0].b64_json is None
    name = url.rsplit("/", 1)[1]
    with images.client(keys["a"]) as mine:
        r = mine.get(url)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert pixels(r.content) == ((64, 64), {(255, 0, 0)})
        [item] = [i for i in mine.get("/api/imagine/gallery").json()["images"] if i["name"] == name]
        assert item["prompt"] == "a red square" and item["workflow"] == "solid" and item["seed"] == 0xFF0000
        assert (item["width"], item["height"]) == (64, 64) and item["created"] > 0 and "owner" not in item
        assert item["url"] == f"/api/imagine/file/{name}"
        # the sidecar beside the image
        sidecar = json.loads((images.data_dir / "plugin-data" / "images" / "gallery" / f"{name[:-4]}.json")
                             .read_text())
        assert sidecar["prompt"] == "a red square" and sidecar["seed"] == 0xFF0000
        # b64_json on request, with a key
        b64 = a.images.generate(prompt="a red square", size="64x64", response_format="b64_json",
                                extra_body={"seed": 0xFF0000})
        assert pixels(base64.b64decode(b64.data[0].b64_json)) == ((64, 64), {(255, 0, 0)})
    with images.client(keys["b"]) as other:
        assert other.get(url).status_code == 404
        assert name not in [i["name"] for i in other.get("/api/imagine/gallery").json()["images"]]
        assert other.delete(f"/api/imagine/gallery/{name}").status_code == 404
    with images.client(keys["models"]) as unscoped:
        assert unscoped.get(url).status_code == 403
        with pytest.raises(openai.PermissionDeniedError):
            sdk_client(images, keys["models"]).images.generate(prompt="a cat")
    with images.client(None) as nobody:
        assert nobody.get(url).status_code == 401
    with images.client(keys["owner"]) as owner_key:
        assert owner_key.get(url).status_code == 200
        # the owner sees every image, with the key that made it
        key_a = [k["id"] for k in owner_key.get("/v1/keys").json()["keys"] if k["name"] == "a"]
        assert len(key_a) == 1
        [made] = [i for i in owner_key.get("/api/imagine/gallery").json()["images"] if i["name"] == name]
        assert made["owner"] == key_a[0] == sidecar["owner"]
    with images.client(keys["a"]) as mine:
        assert mine.delete(f"/api/imagine/gallery/{name}").json() == {"status": "deleted", "name": name}
        assert mine.get(url).status_code == 404
        assert mine.get("/api/imagine/file/..%2Fconfig.json").status_code == 404


# --- refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "status", "says"), [
    ({"prompt": ""}, 400, "prompt must not be empty"),
    ({"prompt": "   "}, 400, "prompt must not be empty"),
    ({"prompt": "x" * 32001}, 400, "at most 32000"),
    ({}, 422, "prompt"),
    ({"prompt": 7}, 422, "prompt"),
    ({"prompt": "a", "n": 0}, 422, "n: must be from 1 to 4"),
    ({"prompt": "a", "n": 5}, 422, "n: must be from 1 to 4"),
    ({"prompt": "a", "n": "2"}, 422, "n: must be an integer"),
    ({"prompt": "a", "n": True}, 422, "n: must be an integer"),
    ({"prompt": "a", "size": "big"}, 400, "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "56x64"}, 400, "64 to 2048"),
    ({"prompt": "a", "size": "2056x64"}, 400, "64 to 2048"),
    ({"prompt": "a", "size": "68x64"}, 400, "multiple of 8"),
    ({"prompt": "a", "size": 64}, 422, "size"),
    ({"prompt": "a", "response_format": "jpeg"}, 400, "b64_json or url"),
    ({"prompt": "a", "output_format": "webp"}, 400, "only png"),
    ({"prompt": "a", "background": "transparent"}, 400, "background"),
    ({"prompt": "a", "stream": True}, 400, "not supported"),
    ({"prompt": "a", "seed": -1}, 422, "seed"),
    ({"prompt": "a", "seed": "1"}, 422, "seed"),
    ({"prompt": "a", "negative_prompt": "blur"}, 400, "no negative prompt input"),
    ({"prompt": "a", "colour": "red"}, 400, "Unknown field(s): colour"),
])
def test_a_bad_request_is_refused_and_changes_nothing(images: LocalmServer, keys: dict[str, str], body: dict,
                                                      status: int, says: str) -> None:
    with images.client(keys["a"]) as client:
        before = (len(client.get("/api/jobs").json()["jobs"]), len(client.get("/api/imagine/gallery").json()["images"]))
        r = client.post("/v1/images/generations", json=body)
        assert r.status_code == status and says in r.json()["detail"], r.text
        assert r.json()["error"]["message"] == r.json()["detail"]  # the OpenAI error object, for the SDKs
        if status == 422:
            assert r.json()["errors"]
        after = (len(client.get("/api/jobs").json()["jobs"]), len(client.get("/api/imagine/gallery").json()["images"]))
        assert after == before


def test_body_and_workflow_refusals(images: LocalmServer, keys: dict[str, str], owner: httpx.Client) -> None:
    with images.client(keys["a"]) as client:
        r = client.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
        assert client.post("/v1/images/generations", json=["a"]).status_code == 422
        assert client.post("/api/imagine", json={"prompt": "a", "response_format": "url"}).status_code == 400
        settings(owner, workflow="nosize")
        try:
            r = client.post("/v1/images/generations", json={"prompt": "a", "size": "128x128"})
            assert r.status_code == 400 and "cannot take a size" in r.json()["detail"]
            ok = client.post("/v1/images/generations", json={"prompt": "a", "size": "auto", "seed": 255,
                                                              "response_format": "b64_json"})
            assert ok.status_code == 200, ok.text
            assert pixels(base64.b64decode(ok.json()["data"][0]["b64_json"])) == ((64, 64), {(0, 0, 255)})
        finally:
            settings(owner, workflow="solid")
        listed = client.get("/api/imagine/workflows").json()
        assert listed["active"] == "solid"
        by_name = {w["name"]: w for w in listed["workflows"]}
        assert by_name["solid"]["fields"]["seed"] == ["1.color"] and by_name["solid"]["mapped_by"]["seed"] == "sidecar"
        assert by_name["slow"]["fields"]["width"] == ["1.width"] and by_name["slow"]["mapped_by"]["prompt"] == "title"
        assert by_name["nosize"]["takes_size"] is False
        shipped = by_name["txt2img-sd"]["fields"]
        assert shipped["prompt"] == ["6.text"] and shipped["seed"] == ["3.seed"] and shipped["width"] == ["5.width"]


def test_the_negative_prompt_reaches_its_mapped_input(images: LocalmServer, keys: dict[str, str],
                                                      owner: httpx.Client) -> None:
    settings(owner, workflow="negative")
    try:
        with images.client(keys["a"]) as client:
            r = client.post("/v1/images/generations", json={
                "prompt": "a calm sea", "negative_prompt": "no storms", "size": "64x64", "seed": 0x00FF00,
                "response_format": "b64_json"})
            assert r.status_code == 200, r.text
            assert pixels(base64.b64decode(r.json()["data"][0]["b64_json"])) == ((64, 64), {(0, 255, 0)})
            [run] = runs_of(owner, "a calm sea")
            assert run["prompt"][2]["5"]["inputs"]["value"] == "no storms"
            [kept] = [i for i in client.get("/api/imagine/gallery").json()["images"] if i["prompt"] == "a calm sea"]
            assert kept["negative_prompt"] == "no storms" and kept["workflow"] == "negative"
            # the job route takes it too; left out, the input keeps the workflow's own value
            job_id = client.post("/api/imagine", json={"prompt": "a calm lake", "negative_prompt": "no fog",
                                                       "seed": 2}).json()["job_id"]
            assert list(job_events(client, job_id))[-1]["status"] == "done"
            assert client.post("/v1/images/generations", json={"prompt": "a calm pond", "seed": 3}).status_code == 200
            [lake], [pond] = runs_of(owner, "a calm lake"), runs_of(owner, "a calm pond")
            assert lake["prompt"][2]["5"]["inputs"]["value"] == "no fog"
            assert pond["prompt"][2]["5"]["inputs"]["value"] == ""
            listed = {w["name"]: w for w in client.get("/api/imagine/workflows").json()["workflows"]}
            assert listed["negative"]["fields"]["negative_prompt"] == ["5.value"]
    finally:
        settings(owner, workflow="solid")


# --- ComfyUI's own errors -----------------------------------------------------------------------

def test_comfy_validation_and_execution_errors(images: LocalmServer, keys: dict[str, str],
                                               owner: httpx.Client) -> None:
    a = sdk_client(images, keys["a"])
    with pytest.raises(openai.BadRequestError) as invalid:
        a.images.generate(prompt="too bright", extra_body={"seed": 0x1000000})
    body = invalid.value.body
    assert "node 1 (EmptyImage), input color" in body["message"] and "bigger than max" in body["message"]
    assert body["param"] == "1.color" and body["code"] == "workflow_invalid"
    # the shipped workflow, in a real ComfyUI: its checkpoint is refused by name
    settings(owner, workflow="txt2img-sd", checkpoint="mine.safetensors")
    try:
        with images.client(keys["a"]) as client:
            r = client.post("/v1/images/generations", json={"prompt": "a lighthouse", "size": "512x768"})
            assert r.status_code == 400, r.text
            assert "node 4 (CheckpointLoaderSimple), input ckpt_name" in r.json()["detail"]
            assert "mine.safetensors" in r.json()["detail"]
        settings(owner, workflow="broken", checkpoint="")
        with pytest.raises(openai.InternalServerError) as failed:
            a.images.generate(prompt="no alpha here")
        assert failed.value.status_code == 502
        assert "node 2 (ImageToMask)" in str(failed.value) and "out of bounds" in str(failed.value)
    finally:
        settings(owner, workflow="solid", checkpoint="")


# --- jobs: progress, cancel, a client that leaves -------------------------------------------------

def test_imagine_job_progress_then_cancel_interrupts_comfy(images: LocalmServer, keys: dict[str, str],
                                                           owner: httpx.Client) -> None:
    with images.client(keys["a"]) as client:
        r = client.post("/api/imagine", json={"prompt": "a quick one", "size": "64x64", "seed": 4})
        assert r.status_code == 200 and r.json()["private"] is False
        events = list(job_events(client, r.json()["job_id"]))
        end = events[-1]
        assert end["type"] == "end" and end["status"] == "done", end
        [item] = end["result"]["images"]
        assert item["seed"] == 4 and (item["width"], item["height"]) == (64, 64) and item["url"].endswith(".png")
        progress = [e for e in events if e["type"] == "progress"]
        assert progress[-1]["progress"] == 1.0
        assert any(e.get("node_type") == "EmptyImage" and e.get("images") == 1 for e in progress)
        assert client.get(item["url"]).status_code == 200
        job = client.get(f"/api/jobs/{r.json()['job_id']}").json()
        assert job["kind"] == "image" and job["plugin"] == "images"

        settings(owner, workflow="slow")
        try:
            job_id = client.post("/api/imagine", json={"prompt": "cancel me", "seed": 9}).json()["job_id"]
            for event in job_events(client, job_id):
                if event["type"] == "progress" and event.get("node_type") == "ImageBlur":
                    assert client.post(f"/api/jobs/{job_id}/cancel").status_code == 200
                if event["type"] == "end":
                    assert event["status"] == "cancelled", event
            interrupted = eventually(lambda: runs_of(owner, "cancel me"))  # at the next node boundary
            assert len(interrupted) == 1 and interrupted[0]["status"]["status_str"] == "error"
            assert "execution_interrupted" in [m[0] for m in interrupted[0]["status"]["messages"]]
            assert httpx.get(f"{comfy_url(owner)}/queue").json() == {"queue_running": [], "queue_pending": []}

            # the same job behind /v1/images/generations: cancelled through the job's route -> 409
            answer: dict[str, Any] = {}

            def call() -> None:
                answer["r"] = client.post("/v1/images/generations", json={"prompt": "cancel the route"})
            thread = threading.Thread(target=call)
            thread.start()
            running = eventually(lambda: [j for j in client.get("/api/jobs").json()["jobs"]
                                          if j["kind"] == "image" and j["status"] == "running"
                                          and (j["message"] or "").find("ImageBlur") >= 0])
            assert running, "the generation did not start"
            client.post(f"/api/jobs/{running[0]['id']}/cancel")
            thread.join(60)
            assert answer["r"].status_code == 409 and "cancelled" in answer["r"].json()["detail"]

            # a client that leaves cancels the generation
            payload = json.dumps({"prompt": "nobody waits"}).encode()
            with socket.create_connection(("127.0.0.1", images.port)) as sock:
                sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             + f"Authorization: Bearer {keys['a']}\r\nContent-Type: application/json\r\n"
                               f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                assert eventually(lambda: [j for j in client.get("/api/jobs").json()["jobs"]
                                           if j["title"] == "Image: nobody waits" and j["status"] == "running"
                                           and "ImageBlur" in (j["message"] or "")])
            left = eventually(lambda: [j for j in client.get("/api/jobs").json()["jobs"]
                                       if j["title"] == "Image: nobody waits" and j["status"] == "cancelled"])
            assert left, client.get("/api/jobs").json()
            aborted = eventually(lambda: runs_of(owner, "nobody waits"))
            assert aborted and aborted[0]["status"]["status_str"] == "error"
        finally:
            settings(owner, workflow="solid")


# --- chat models step aside --------------------------------------------------------------------

def test_chat_models_are_unloaded_for_a_generation_and_loaded_again(images: LocalmServer, keys: dict[str, str],
                                                                    owner: httpx.Client) -> None:
    assert owner.post("/v1/models/load", params={"model": CHAT_MODEL}).status_code == 200
    settings(owner, unload_chat_models=True)
    try:
        with images.client(keys["a"]) as client:
            job_id = client.post("/api/imagine", json={"prompt": "make room", "seed": 1}).json()["job_id"]
            events = list(job_events(client, job_id))
        assert events[-1]["status"] == "done"
        assert any(e["type"] == "log" and e["line"].startswith(f"Unloaded {CHAT_MODEL}") for e in events)

        def loaded() -> bool:
            models = owner.get("/v1/models").json()["data"]
            return any(m["id"] == CHAT_MODEL and m["loaded"] for m in models)
        assert eventually(loaded), "the chat model was not loaded again"
    finally:
        settings(owner, unload_chat_models=False)


# --- privacy mode ------------------------------------------------------------------------------

def test_privacy_mode_keeps_nothing(images: LocalmServer, keys: dict[str, str], owner: httpx.Client) -> None:
    with images.client(keys["config"]) as config:
        r = config.post("/v1/media/config/images", json={"privacy_mode": True})
        assert r.status_code == 403 and "owner-only" in r.json()["detail"]
    gallery_before = len(owner.get("/api/imagine/gallery").json()["images"])
    settings(owner, privacy_mode=True)
    try:
        a = sdk_client(images, keys["a"])
        result = a.images.generate(prompt="a secret sketch", n=2, size="64x72", extra_body={"seed": 77})
        assert [pixels(base64.b64decode(d.b64_json)) for d in result.data] == \
            [((64, 72), {colour(77)}), ((64, 72), {colour(78)})]
        with pytest.raises(openai.BadRequestError) as refused:
            a.images.generate(prompt="a secret sketch", response_format="url")
        assert "Privacy mode" in str(refused.value)
        with images.client(keys["a"]) as client:
            r = client.post("/api/imagine", json={"prompt": "another secret", "seed": 5})
            assert r.json()["private"] is True
            end = list(job_events(client, r.json()["job_id"]))[-1]
            assert end["status"] == "done" and end["result"]["private"] is True
            assert pixels(base64.b64decode(end["result"]["images"][0]["b64_json"])) == ((64, 64), {colour(5)})
            assert "name" not in end["result"]["images"][0]
            job = client.get(f"/api/jobs/{r.json()['job_id']}").json()
            assert "secret" not in job["title"]
        assert len(owner.get("/api/imagine/gallery").json()["images"]) == gallery_before
        out = images.data_dir / "plugin-data" / "images" / "comfy" / "output"
        assert not list(out.rglob("*.png")) and not [p for p in out.iterdir() if "private" in p.name]
        assert not [e for e in comfy_history(owner).values() if "secret" in json.dumps(e["prompt"][2])]
    finally:
        settings(owner, privacy_mode=False)


# --- settings and ComfyUI's routes ----------------------------------------------------------------

def test_media_config_and_comfy_status(images: LocalmServer, keys: dict[str, str], owner: httpx.Client) -> None:
    every = owner.get("/v1/media/config").json()["plugins"]
    assert [p["plugin"] for p in every] == ["images"] and every[0]["label"] == "Images"
    fields = {f["key"]: f for f in every[0]["fields"]}
    assert fields["comfy_path"]["owner_only"] is True and fields["workflow"]["value"] == "solid"
    assert fields["timeout"]["type"] == "integer" and fields["timeout"]["min"] == 1
    with images.client(keys["config"]) as config:
        seen = {f["key"] for f in config.get("/v1/media/config").json()["plugins"][0]["fields"]}
        assert "workflow" in seen and not {"comfy_path", "comfy_url", "comfy_python", "privacy_mode"} & seen
        assert config.post("/v1/media/config/images", json={"comfy_url": "http://x"}).status_code == 403
        assert config.post("/v1/media/config/music", json={"timeout": 5}).status_code == 404
        for bad in ({"timeout": "5"}, {"timeout": 0}, {"workflow": "nope"}, {"no_such": 1},
                    {"unload_chat_models": 1}):
            r = config.post("/v1/media/config/images", json=bad)
            assert r.status_code == 400, (bad, r.text)
        r = config.post("/v1/media/config/images", json={"timeout": 300})
        assert r.status_code == 200 and {f["key"]: f["value"] for f in r.json()["fields"]}["timeout"] == 300
        r = config.post("/v1/media/config/images", json={"timeout": ""})  # a blank value clears the override
        assert {f["key"]: f["value"] for f in r.json()["fields"]}["timeout"] == 600
        status = config.get("/v1/comfy/status").json()
        assert status["alive"] is True and status["launched_by_localm"] is True
    r = owner.post("/v1/media/config/images", json={"comfy_path": "/nowhere"})
    assert r.status_code == 400 and "no main.py" in r.json()["detail"]
    with images.client(keys["a"]) as image_only:
        assert image_only.get("/v1/comfy/status").status_code == 403
        assert image_only.post("/v1/comfy/stop").status_code == 403
        assert image_only.get("/v1/media/config").status_code == 403


def test_comfy_killed_is_a_503_until_restarted(images: LocalmServer, keys: dict[str, str],
                                               owner: httpx.Client) -> None:
    a = sdk_client(images, keys["a"])
    # killed while it draws: that generation is a 503
    settings(owner, workflow="slow")
    try:
        answer: dict[str, Any] = {}
        with images.client(keys["a"]) as client:
            def call() -> None:
                answer["r"] = client.post("/v1/images/generations", json={"prompt": "crash mid-way"})
            thread = threading.Thread(target=call)
            thread.start()
            assert eventually(lambda: [j for j in client.get("/api/jobs").json()["jobs"]
                                       if j["status"] == "running" and "ImageBlur" in (j["message"] or "")])
            pid = comfy_child(images)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            thread.join(60)
        assert answer["r"].status_code == 503, answer["r"].text
        assert eventually(lambda: gone(pid))
    finally:
        settings(owner, workflow="solid")
    # and every generation after it, until it is restarted
    with pytest.raises(openai.APIStatusError) as down:
        a.images.generate(prompt="after the crash")
    assert down.value.status_code == 503 and "exited" in str(down.value) and "/v1/comfy/restart" in str(down.value)
    status = owner.get("/v1/comfy/status").json()
    assert status["alive"] is False and status["launched_by_localm"] is False and "exited" in status["message"]
    restarted = owner.post("/v1/comfy/restart").json()
    assert restarted["ok"] is True and "running on http://127.0.0.1:" in restarted["message"]
    result = a.images.generate(prompt="back again", response_format="b64_json", extra_body={"seed": 3})
    assert pixels(base64.b64decode(result.data[0].b64_json)) == ((64, 64), {colour(3)})
    # stopped, the next generation starts it again (first use)
    stopped = owner.post("/v1/comfy/stop").json()
    assert stopped == {"ok": True, "message": "Stopped the ComfyUI localm launched"}
    assert owner.get("/v1/comfy/status").json() == {"alive": False, "launched_by_localm": False, "url": None}
    assert owner.post("/v1/comfy/stop").json()["message"] == "ComfyUI was not running"
    result = a.images.generate(prompt="first use again", response_format="b64_json", extra_body={"seed": 8})
    assert pixels(base64.b64decode(result.data[0].b64_json)) == ((64, 64), {colour(8)})


def test_an_external_comfy_url(images: LocalmServer, keys: dict[str, str], owner: httpx.Client) -> None:
    url = comfy_url(owner)  # the one localm launched, used as if someone else ran it
    settings(owner, comfy_url=url)
    try:
        status = owner.get("/v1/comfy/status").json()
        assert status == {"alive": True, "launched_by_localm": False, "url": url}
        restart = owner.post("/v1/comfy/restart").json()
        assert restart["ok"] is False and "not started by localm" in restart["message"]
        a = sdk_client(images, keys["a"])
        result = a.images.generate(prompt="from outside", response_format="b64_json", extra_body={"seed": 12})
        assert pixels(base64.b64decode(result.data[0].b64_json)) == ((64, 64), {colour(12)})
        settings(owner, privacy_mode=True)
        with pytest.raises(openai.APIStatusError) as refused:
            a.images.generate(prompt="private, elsewhere")
        assert refused.value.status_code == 503 and "comfy_output_dir" in str(refused.value)
        settings(owner, privacy_mode=False, comfy_url="http://127.0.0.1:9")
        with pytest.raises(openai.APIStatusError) as down:
            a.images.generate(prompt="nobody there")
        assert down.value.status_code == 503 and "not answering" in str(down.value)
    finally:
        settings(owner, comfy_url="", privacy_mode=False)


HANGING_MAIN = """import socket, sys, time

# stands in for ComfyUI's main.py: takes connections on its port and never answers
port = int(sys.argv[sys.argv.index("--port") + 1])
server = socket.socket()
server.bind(("127.0.0.1", port))
server.listen(16)
time.sleep(600)
"""


def test_a_comfy_that_never_answers(images: LocalmServer, owner: httpx.Client, comfy: comfyui_env.ComfyEnv,
                                    tmp_path: Path) -> None:
    # comfy_url at a socket that takes connections and never answers: not alive, said within
    # the status route's own limit (its check gives up first, so this is not a 504)
    hanging = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        settings(owner, comfy_url=f"http://127.0.0.1:{hanging.getsockname()[1]}")
        started = time.monotonic()
        status = owner.get("/v1/comfy/status", timeout=60)
        assert status.status_code == 200 and status.json()["alive"] is False, status.text
        assert time.monotonic() - started < 15
    finally:
        settings(owner, comfy_url="")
        hanging.close()
    # a ComfyUI localm launches that never answers: restarting it is a 504 once start_timeout passes
    fake = tmp_path / "ComfyUI"
    fake.mkdir()
    (fake / "main.py").write_text(HANGING_MAIN)
    settings(owner, comfy_path=str(fake), comfy_python=sys.executable, start_timeout=5)
    try:
        r = owner.post("/v1/comfy/restart", timeout=120)
        assert r.status_code == 504, r.text
        assert "did not start within start_timeout" in r.json()["detail"]
        assert owner.get("/v1/comfy/status").json() == {"alive": False, "launched_by_localm": False, "url": None}
    finally:
        settings(owner, comfy_path=str(comfy.path), comfy_python=str(comfy.python), start_timeout="")
        restarted = owner.post("/v1/comfy/restart", timeout=300).json()
    assert restarted["ok"] is True, restarted


def test_disabled_the_routes_404_and_comfy_stops(images: LocalmServer, keys: dict[str, str],
                                                 owner: httpx.Client) -> None:
    pid = comfy_child(images)
    assert pid is not None
    assert owner.post("/api/plugins/images/disable").status_code == 200
    with images.client(keys["a"]) as client:
        assert client.post("/v1/images/generations", json={"prompt": "a cat"}).status_code == 404
        assert client.get("/api/imagine/gallery").status_code == 404
    assert owner.get("/v1/comfy/status").status_code == 404
    assert eventually(lambda: gone(pid)), "ComfyUI outlived its plugin"
