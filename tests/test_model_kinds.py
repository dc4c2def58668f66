"""A plugin teaches the registry a model format, serves a pull source and runs its models:
the kernel names none of them (tests/test_kernel_names_no_plugin.py), so a third party's
format works as the builtin plugins' do. Written from docs/plugins.md's hook table."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import offline_cli
from localm.sdk.testing import LocalmServer

PLUGIN_TOML = '''id = "parrot"
version = "0.1.0"
entry = "parrot"
requires = ["chat"]
model_formats = ["parrot"]
model_sources = ["parrot"]
'''

PLUGIN_PY = '''import json
import time
from pathlib import Path

from localm import sdk
from localm.sdk import engines


def is_parrot(path):
    return path.suffix == ".parrot" and path.is_file()


def inspect(path):
    words = json.loads(path.read_text())["words"]
    return {"words": len(words)}, "chat"


@sdk.hookimpl
def register_model_formats(register):
    register(sdk.ModelFormat("parrot", detect=is_parrot, inspect=inspect, describe="a .parrot file"))


FORGOTTEN = []


@sdk.hookimpl
def register_model_providers(register, plugin):
    def pull(source, *, registry, name=None, log=lambda line: None):
        word = source.split(":", 1)[1]
        entry = sdk.ModelEntry(id=sdk.model_id(name or "parrot-" + word), path="", source=source, type="parrot",
                               capabilities={"words": 1, "word": word}, created=time.time())
        return [registry.add(entry)]

    def forget(entry):
        (plugin.data_dir / "forgotten.txt").write_text(entry.source)

    async def describe(entries):
        return {e.id: {"parrot": {"word": e.capabilities.get("word")}} for e in entries}

    register("parrot", pull, forget=forget, describe=describe)


class Parrot:
    engine = "parrot"
    capabilities = engines.Capabilities(context_window=0, messages=True)
    busy = 0

    def __init__(self, entry):
        self.words = ([entry.capabilities["word"]] if "word" in entry.capabilities
                      else json.loads(Path(entry.path).read_text())["words"])

    async def generate(self, request):
        for n, word in enumerate(self.words):
            yield engines.Token(id=-1, text=word if n == 0 else " " + word)
        yield engines.Finished(reason="stop", prompt_tokens=0, completion_tokens=len(self.words))

    def close(self):
        pass


@sdk.hookimpl
def register_engines(register):
    register("parrot", lambda entry, options: Parrot(entry), formats=["parrot"])
'''


def make_plugin(root: Path, toml: str = PLUGIN_TOML) -> Path:
    folder = root / "parrot"
    folder.mkdir(parents=True)
    (folder / "plugin.toml").write_text(toml)
    (folder / "parrot.py").write_text(PLUGIN_PY)
    return folder


def test_a_plugins_format_and_source_pull_list_answer_and_forget(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    offline_cli(data, "plugin", "install", str(make_plugin(tmp_path / "src")))
    model = tmp_path / "models" / "polly.parrot"
    model.parent.mkdir()
    model.write_text(json.dumps({"words": ["pieces", "of", "eight"]}))
    # the CLI, with no server: it imports the plugin because plugin.toml lists the format
    assert "Registered polly (parrot, chat" in offline_cli(data, "pull", str(model.parent))
    assert "Registered parrot-cracker (parrot, chat" in offline_cli(data, "pull", "parrot:cracker")
    server = LocalmServer(data, plugins=["chat", "ollama", "parrot"]).start()
    try:
        owner = server.owner()
        for name, text in (("polly", "pieces of eight"), ("parrot-cracker", "cracker")):
            reply = owner.post("/v1/chat/completions", json={"model": name, "messages": [
                {"role": "user", "content": "say it"}]})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == text
        listed = {m["id"]: m for m in owner.get("/v1/models").json()["data"]}
        assert listed["parrot-cracker"]["parrot"] == {"word": "cracker"} and "parrot" not in listed["polly"]
        # through the running server too (POST /api/pull reaches the same source)
        pulled = owner.post("/api/pull", json={"model": "parrot:seed", "stream": False})
        assert pulled.status_code == 200, pulled.text
        assert owner.request("DELETE", "/api/delete", json={"model": "parrot-seed"}).status_code == 200
        assert (data / "plugin-data" / "parrot" / "forgotten.txt").read_text() == "parrot:seed"
        # a file no plugin reads is refused, naming the formats that are known
        (tmp_path / "notes.txt").write_text("hello")
        refused = owner.post("/api/pull", json={"model": str(tmp_path / "notes.txt"), "stream": False})
        assert refused.status_code == 400 and "a .parrot file" in refused.json()["error"], refused.text
    finally:
        server.stop()


def test_a_format_not_listed_in_plugin_toml_fails_the_plugins_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    folder = make_plugin(tmp_path / "src", PLUGIN_TOML.replace('model_formats = ["parrot"]\n', ""))
    offline_cli(data, "plugin", "install", str(folder))
    server = LocalmServer(data, plugins=["chat", "ollama", "parrot"]).start()
    try:
        found = {p["name"]: p for p in server.owner().get("/api/plugins").json()["plugins"]}
        assert not found["parrot"]["active"]
        assert "model_formats does not list" in found["parrot"]["error"], found["parrot"]
    finally:
        server.stop()
