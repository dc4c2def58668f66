"""Image generation benchmark: what localm's images plugin adds to a ComfyUI generation.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/images.py                  # 64x64, 15 rounds
    .venv/bin/python bench/images.py --rounds 30 --size 512

It uses the ComfyUI 0.30.0 that tests/comfyui_env.py builds (building it first if the cache
has none) and starts ``localm serve --plugins chat,images`` with the plugin pointed at it, so
localm launches ComfyUI itself. Both sides then make the same weightless image (EmptyImage →
SaveImage, with the prompt through a PrimitiveStringMultiline into a PreviewAny; the colour
changes every request, so ComfyUI never answers from its cache), one at a time, alternating
which goes first each round:

- direct: a client of ComfyUI's own API, as one would write it: open the websocket, POST
  /prompt, wait for ``executing`` with node null, read /history, fetch the PNG from /view
  (one httpx client kept alive, as localm keeps its own);
- localm: POST /v1/images/generations with ``response_format: b64_json`` (the job, the
  websocket, the gallery write and the base64 answer included).

It prints the median and the spread of each, and the ratio localm / direct; the difference
is localm's overhead per image. The machine's other processes disturb a CPU benchmark, so
both are measured in the same run, interleaved.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from websockets.sync.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import comfyui_env  # noqa: E402
from localm.sdk.testing import LocalmServer  # noqa: E402

GRAPH = {
    "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "bench"}},
    "3": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": ""}},
    "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 0]}},
}
MAPPING = {"prompt": "3.value", "seed": "1.color", "width": "1.width", "height": "1.height"}


def direct(http: httpx.Client, url: str, size: int, colour: int, prompt: str) -> bytes:
    graph = json.loads(json.dumps(GRAPH))
    graph["1"]["inputs"].update(width=size, height=size, color=colour)
    graph["3"]["inputs"]["value"] = prompt
    client_id = uuid.uuid4().hex
    host = url.split("://", 1)[1]
    with connect(f"ws://{host}/ws?clientId={client_id}", max_size=None) as ws:
        r = http.post(f"{url}/prompt", json={"prompt": graph, "client_id": client_id}, timeout=60)
        r.raise_for_status()
        prompt_id = r.json()["prompt_id"]
        while True:
            raw = ws.recv(timeout=60)
            if isinstance(raw, bytes):
                continue
            message = json.loads(raw)
            data = message.get("data") or {}
            if message.get("type") == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                break
    entry = http.get(f"{url}/history/{prompt_id}", timeout=10).json()[prompt_id]
    image = entry["outputs"]["2"]["images"][0]
    r = http.get(f"{url}/view", params={"filename": image["filename"], "subfolder": image["subfolder"],
                                         "type": image["type"]}, timeout=10)
    r.raise_for_status()
    return r.content


def through_localm(client: httpx.Client, size: int, colour: int, prompt: str) -> bytes:
    r = client.post("/v1/images/generations", json={"prompt": prompt, "size": f"{size}x{size}", "seed": colour,
                                                    "response_format": "b64_json"}, timeout=120)
    r.raise_for_status()
    return base64.b64decode(r.json()["data"][0]["b64_json"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (a multiple of 8, 64 to 2048)")
    args = parser.parse_args()
    comfy = comfyui_env.ensure()
    data_dir = Path(tempfile.mkdtemp(prefix="bench-images-")) / "data"
    folder = data_dir / "plugin-data" / "images" / "workflows"
    folder.mkdir(parents=True)
    (folder / "bench.json").write_text(json.dumps(GRAPH))
    (folder / "bench.map.json").write_text(json.dumps(MAPPING))
    server = LocalmServer(data_dir, process=True, plugins=["chat", "images"]).start()
    try:
        owner = server.owner()
        owner.post("/api/plugins/images/enable").raise_for_status()
        owner.post("/v1/media/config/images", json={
            "comfy_path": str(comfy.path), "comfy_python": str(comfy.python), "workflow": "bench",
            "comfy_args": ["--cpu", "--disable-api-nodes", "--disable-all-custom-nodes"]}).raise_for_status()
        client = server.client()
        started = time.perf_counter()
        through_localm(client, args.size, 1, "warm-up")  # launches ComfyUI
        print(f"ComfyUI start + first image through localm: {time.perf_counter() - started:.1f} s")
        url = owner.get("/v1/comfy/status").json()["url"]
        http = httpx.Client(trust_env=False)  # one client, kept alive, as localm keeps its own
        direct(http, url, args.size, 2, "warm-up")
        times: dict[str, list[float]] = {"direct": [], "localm": []}
        for i in range(args.rounds):
            order = ("direct", "localm") if i % 2 == 0 else ("localm", "direct")
            for side in order:
                colour = (i * 2 + (side == "localm")) * 7919 % 0xFFFFFF + 3
                t = time.perf_counter()
                png = direct(http, url, args.size, colour, f"round {i}") if side == "direct" else \
                    through_localm(client, args.size, colour, f"round {i}")
                times[side].append(time.perf_counter() - t)
                assert png.startswith(b"\x89PNG")
        for side, values in times.items():
            ms = sorted(v * 1000 for v in values)
            print(f"{side:7s} median {statistics.median(ms):7.1f} ms   min {ms[0]:7.1f}   max {ms[-1]:7.1f}"
                  f"   ({len(ms)} images of {args.size}x{args.size})")
        ratio = statistics.median(times["localm"]) / statistics.median(times["direct"])
        extra = (statistics.median(times["localm"]) - statistics.median(times["direct"])) * 1000
        print(f"localm / direct: {ratio:.2f} (localm adds {extra:.1f} ms per image)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
