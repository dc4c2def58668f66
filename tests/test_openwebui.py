"""Open WebUI Functions run unmodified: installed with `localm plugin install FILE.py` (and
as an export, and as source over HTTP) into a real server, driven with the openai, ollama
and anthropic clients.

The Functions are tests/openwebui/*.py (written in Open WebUI's conventions) and Open
WebUI's own example Filter, read from the open-webui wheel on PyPI: a turn limit with
Valves (priority, max_turns), UserValves (max_turns) and a `request` hook.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp")
pytest.importorskip("pydantic")

HERE = Path(__file__).parent / "openwebui"
MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0, "extra_body": {"cache_prompt": False}}
FUNCTIONS = ["reply_stamp", "second_stamp", "shout_stream", "word_guard", "tool_pipes", "openai_proxy",
             "word_count_action"]
OPEN_WEBUI = "0.12.4"


def example_filter() -> str:
    """Open WebUI's own example Filter (the Function editor's template), from its wheel."""
    cache = Path(os.environ.get("LOCALM_TEST_CACHE") or Path.home() / ".cache" / "localm" / "test-data")
    cache.mkdir(parents=True, exist_ok=True)
    found = cache / f"open_webui-{OPEN_WEBUI}-example-filter.py"
    if found.exists():
        return found.read_text()
    from filelock import FileLock

    with FileLock(str(cache / ".open-webui.lock")):
        wheel = next(cache.glob(f"open_webui-{OPEN_WEBUI}-*.whl"), None)
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(cache),
                            f"open-webui=={OPEN_WEBUI}"], check=True)
            wheel = next(cache.glob(f"open_webui-{OPEN_WEBUI}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("open_webui/frontend/_app/immutable/") and name.endswith(".js"):
                    match = re.search(r'`("""\ntitle: Example Filter\n.*?)`', z.read(name).decode("utf-8", "replace"),
                                      re.S)
                    if match:
                        source = match.group(1).replace("\\`", "`").replace("\\${", "${").replace("\\\\", "\\")
                        found.write_text(source)
                        return source
    raise AssertionError(f"the open-webui {OPEN_WEBUI} wheel holds no example Filter")


@pytest.fixture(scope="module")
def upstream(module_server: Any) -> Any:
    """A second localm, the OpenAI-compatible server the proxy Pipe forwards to."""
    return module_server(plugins=["chat", "llamacpp"])


@pytest.fixture(scope="module")
def server(module_server: Any) -> Any:
    s = module_server()  # every plugin: an installed Function runs beside the builtin ones
    for name in FUNCTIONS:
        done = s.cli("plugin", "install", str(HERE / f"{name}.py"))
        assert done.returncode == 0, done.stderr + done.stdout
        assert "It is active." in done.stdout, done.stdout
    done = s.owner().post("/api/plugins/install-external", json={"content": example_filter(), "id": "turn_limit"})
    assert done.status_code == 200, done.text
    return s


@pytest.fixture(scope="module")
def owner(server: Any) -> httpx.Client:
    return server.owner()


@pytest.fixture(scope="module")
def clients(server: Any) -> dict[str, Any]:
    return {"openai": openai.OpenAI(base_url=server.url + "/v1", api_key=server.token, timeout=120, max_retries=0),
            "ollama": ollama.Client(host=server.url, timeout=120, headers={"Authorization": f"Bearer {server.token}"}),
            "anthropic": anthropic.Anthropic(base_url=server.url, api_key=server.token, timeout=120, max_retries=0)}


def valves(owner: httpx.Client, fid: str, **values: Any) -> httpx.Response:
    return owner.post(f"/v1/plugins/{fid}/settings", json=values)


def say(clients: dict[str, Any], surface: str, messages: list[dict[str, Any]], *, model: str = MODEL,
        max_tokens: int = 6, **extra: Any) -> str:
    """One non-streamed chat turn on ``surface``: the reply's text."""
    if surface == "openai":
        reply = clients["openai"].chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                          extra_body=extra or None)
        return reply.choices[0].message.content
    if surface == "ollama":
        return clients["ollama"].chat(model=model, messages=messages, options={"num_predict": max_tokens})[
            "message"]["content"]
    reply = clients["anthropic"].messages.create(model=model, messages=messages, max_tokens=max_tokens,
                                                 extra_body=extra or None)
    return "".join(block.text for block in reply.content if block.type == "text")


def eventually(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def refusal(call: Any) -> str:
    """The message a refused call carries, whatever the client's error type."""
    with pytest.raises(Exception) as caught:
        call()
    error = caught.value
    assert getattr(error, "status_code", 400) == 400, error
    return str(error)


# --- installing and managing --------------------------------------------------------------------

def test_functions_are_plugins_with_their_type(owner: httpx.Client) -> None:
    listed = {p["name"]: p for p in owner.get("/api/plugins").json()["plugins"]}
    assert {n: listed[n]["type"] for n in FUNCTIONS + ["turn_limit"]} == {
        "reply_stamp": "filter", "second_stamp": "filter", "shout_stream": "filter", "word_guard": "filter",
        "tool_pipes": "pipe", "openai_proxy": "pipe", "word_count_action": "action", "turn_limit": "filter"}
    assert all(listed[n]["active"] for n in FUNCTIONS + ["turn_limit"])
    assert listed["reply_stamp"]["version"] == "1.2.0" and listed["reply_stamp"]["label"] == "Reply Stamp"
    assert listed["reply_stamp"]["author"] == "localm tests"
    assert listed["openai_proxy"]["requirements"] == ["requests"]  # the frontmatter's, installed by install-deps
    assert listed["turn_limit"]["author"] == "open-webui" and listed["turn_limit"]["version"] == "0.1"
    functions = {f["id"]: f for f in owner.get("/api/functions").json()["functions"]}
    assert functions["word_guard"]["toggle"] is True and functions["turn_limit"]["has_user_valves"] is True
    assert functions["tool_pipes"]["models"] == ["tool_pipes.echo", "tool_pipes.reverse", "tool_pipes.count"]


def test_a_function_that_cannot_load_is_reported_and_the_server_keeps_serving(
        server: Any, owner: httpx.Client, clients: dict[str, Any]) -> None:
    broken = server.cli("plugin", "install", str(HERE / "broken_syntax.py"))
    assert broken.returncode == 1
    assert "broken_syntax.py is not valid Python (line 8" in broken.stderr and "expected ':'" in broken.stderr
    assert "broken_syntax" not in {p["name"] for p in owner.get("/api/plugins").json()["plugins"]}
    needs = server.cli("plugin", "install", str(HERE / "needs_open_webui_db.py"))
    assert needs.returncode == 1 and "failed to start" in needs.stderr
    [entry] = [p for p in owner.get("/api/plugins").json()["plugins"] if p["name"] == "needs_open_webui_db"]
    assert entry["active"] is False and "open_webui.models" in entry["error"]
    assert "provides only open_webui.constants" in entry["error"]
    assert say(clients, "openai", [{"role": "user", "content": "Hi"}], max_tokens=2)  # still serving
    assert owner.post("/api/plugins/needs_open_webui_db/uninstall").status_code == 200
    not_python = owner.post("/api/plugins/install-external", json={"content": "print('hi')\n", "id": "plain"})
    assert not_python.status_code == 400 and "no class Pipe, Filter or Action" in not_python.json()["detail"]
    no_id = owner.post("/api/plugins/install-external", json={"content": "class Filter: pass\n"})
    assert no_id.status_code == 400 and "id is required" in no_id.json()["detail"]
    taken = owner.post("/api/plugins/install-external", json={"content": "class Filter: pass\n", "id": "chat"})
    assert taken.status_code == 400 and "builtin" in taken.json()["detail"]
    again = owner.post("/api/plugins/install-external", json={"source": str(HERE / "second_stamp.py")})
    assert again.status_code == 400 and "already installed" in again.json()["detail"]


def test_a_functions_requirements_wait_for_install_deps(server: Any, owner: httpx.Client) -> None:
    source = (HERE / "second_stamp.py").read_text().replace(
        'version: 0.3\n', 'version: 0.3\nrequirements: localm-test-absent-package>=1, requests\n')
    done = owner.post("/api/plugins/install-external", json={"content": source, "id": "needs_a_package"})
    assert done.status_code == 200, done.text
    try:
        [entry] = [p for p in owner.get("/api/plugins").json()["plugins"] if p["name"] == "needs_a_package"]
        assert entry["requirements"] == ["localm-test-absent-package>=1", "requests"]
        assert entry["missing_deps"] == ["localm-test-absent-package>=1"] and entry["active"] is False
        listed = server.cli("plugin", "list")
        assert "needs_a_package" in listed.stdout
    finally:
        assert owner.post("/api/plugins/needs_a_package/uninstall").status_code == 200


def test_an_export_installs_several_functions_with_their_valves(server: Any, owner: httpx.Client,
                                                                clients: dict[str, Any]) -> None:
    export = [{"id": "Export_Stamp", "name": "Export Stamp", "type": "filter",
               "content": (HERE / "second_stamp.py").read_text().replace("[second]", "[exported]"),
               "valves": {"priority": 20}},
              {"id": "export_pipe", "name": "Export Pipe", "type": "pipe",
               "content": (HERE / "tool_pipes.py").read_text(), "valves": {"extra_model": "again"}}]
    path = server.data_dir.parent / "functions-export.json"
    path.write_text(json.dumps(export))
    done = server.cli("plugin", "install", str(path))
    assert done.returncode == 0, done.stderr
    assert "Installed export_stamp (an Open WebUI filter)." in done.stdout
    assert "Installed export_pipe (an Open WebUI pipe)." in done.stdout
    try:
        models = {m["id"] for m in owner.get("/v1/models").json()["data"]}
        assert "export_pipe.again" in models  # its stored valve named one more model
        text = say(clients, "openai", [{"role": "user", "content": "hello there"}], model="export_pipe.echo")
        assert text == "echo: hello there [stamped] [second] [exported]"
    finally:
        for name in ("export_stamp", "export_pipe"):
            assert owner.post(f"/api/plugins/{name}/uninstall").status_code == 200
    assert "export_pipe.echo" not in {m["id"] for m in owner.get("/v1/models").json()["data"]}


def test_disabling_a_pipe_takes_its_models_away(owner: httpx.Client, clients: dict[str, Any]) -> None:
    assert owner.post("/api/plugins/tool_pipes/disable").status_code == 200
    try:
        assert not any(m["id"].startswith("tool_pipes.") for m in owner.get("/v1/models").json()["data"])
        with pytest.raises(openai.NotFoundError):
            say(clients, "openai", [{"role": "user", "content": "x"}], model="tool_pipes.echo")
    finally:
        assert owner.post("/api/plugins/tool_pipes/enable").status_code == 200
    assert say(clients, "openai", [{"role": "user", "content": "back"}], model="tool_pipes.echo").startswith(
        "echo: back")


# --- Valves and UserValves ----------------------------------------------------------------------

def test_valves_are_settings_checked_by_the_functions_own_model(server: Any, owner: httpx.Client) -> None:
    fields = {p["plugin"]: {f["key"]: f for f in p["fields"]} for p in owner.get("/v1/plugins/settings").json()[
        "plugins"]}
    shout = fields["shout_stream"]
    assert shout["enabled"]["type"] == "boolean" and shout["enabled"]["default"] is True
    assert shout["delay_ms"]["min"] == 0 and shout["delay_ms"]["max"] == 1000
    assert shout["delay_ms"]["description"] == "Sleep this long on each chunk (a slow filter)"
    guard = fields["word_guard"]
    assert guard["mode"]["choices"] == ["strict", "lenient"] and guard["api_secret"]["owner_only"] is True
    refused = valves(owner, "shout_stream", delay_ms=5000)
    assert refused.status_code == 400
    assert refused.json()["detail"] == "Invalid valves: delay_ms: Input should be less than or equal to 1000"
    assert valves(owner, "shout_stream", delay_ms="soon").status_code == 400
    assert valves(owner, "shout_stream", delay_ms=3).status_code == 200
    config = json.loads((server.data_dir / "config.json").read_text())
    assert config["plugins"]["shout_stream"] == {"delay_ms": 3}  # only what was set explicitly
    assert valves(owner, "shout_stream", delay_ms=None).status_code == 200
    assert "shout_stream" not in json.loads((server.data_dir / "config.json").read_text()).get("plugins", {})
    # a password valve is the owner's: never shown to another key, nor set by one
    key = owner.post("/v1/keys", json={"name": "settings", "scopes": ["config:read"]}).json()["key"]
    seen = {p["plugin"]: {f["key"] for f in p["fields"]} for p in server.client(key).get(
        "/v1/plugins/settings").json()["plugins"]}
    assert "api_secret" not in seen["word_guard"] and "banned" in seen["word_guard"]
    assert "OPENAI_API_KEY" not in seen["openai_proxy"]


def test_a_valve_change_reaches_the_next_request(owner: httpx.Client, clients: dict[str, Any]) -> None:
    hi = [{"role": "user", "content": "Say hi"}]
    assert say(clients, "openai", hi).endswith(" [stamped] [second]")
    assert valves(owner, "reply_stamp", stamp="[checked]").status_code == 200
    try:
        assert say(clients, "openai", hi).endswith(" [checked] [second]")
        # priority orders filters (lower first, then the id): second_stamp moves ahead
        assert valves(owner, "second_stamp", priority=1).status_code == 200
        assert say(clients, "ollama", hi).endswith(" [second] [checked]")
    finally:
        valves(owner, "reply_stamp", stamp=None)
        valves(owner, "second_stamp", priority=None)
    assert say(clients, "anthropic", hi).endswith(" [stamped] [second]")


def test_open_webuis_example_filter_limits_turns_with_valves_and_user_valves(
        server: Any, owner: httpx.Client, clients: dict[str, Any]) -> None:
    def turns(n: int) -> list[dict[str, str]]:
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(n)]

    assert say(clients, "openai", turns(3), max_tokens=1)
    # UserValves max_turns 4 (the owner's, by default) < Valves max_turns 8
    for surface in ("openai", "ollama", "anthropic"):
        message = refusal(lambda: say(clients, surface, turns(5), max_tokens=1))
        assert "Conversation turn limit exceeded. Max turns: 4" in message, (surface, message)
    user = owner.post("/api/functions/turn_limit/valves/user", json={"max_turns": 12})
    assert user.status_code == 200 and user.json()["values"] == {"max_turns": 12}
    assert owner.get("/api/functions/turn_limit/valves/user").json()["values"] == {"max_turns": 12}
    assert say(clients, "openai", turns(5), max_tokens=1)
    assert "Max turns: 8" in refusal(lambda: say(clients, "openai", turns(9), max_tokens=1))  # the Valves' cap
    assert valves(owner, "turn_limit", max_turns=20).status_code == 200
    try:
        assert say(clients, "openai", turns(9), max_tokens=1)
        # another key has its own UserValves: the default 4
        key = owner.post("/v1/keys", json={"name": "other-user", "scopes": ["chat"]}).json()["key"]
        other = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert "Max turns: 4" in refusal(lambda: other.chat.completions.create(model=MODEL, messages=turns(5),
                                                                              max_tokens=1))
        assert server.client(key).get("/api/functions/turn_limit/valves/user").json()["values"] == {}
        bad = owner.post("/api/functions/turn_limit/valves/user", json={"max_turns": "many"})
        assert bad.status_code == 400 and bad.json()["detail"].startswith("Invalid valves: max_turns: ")
        assert owner.post("/api/functions/turn_limit/valves/user", json={"nope": 1}).status_code == 400
        assert owner.get("/api/functions/reply_stamp/valves/user").status_code == 404
    finally:
        valves(owner, "turn_limit", max_turns=None)
        owner.post("/api/functions/turn_limit/valves/user", json={"max_turns": None})


# --- filters --------------------------------------------------------------------------------------

def stream_openai(server: Any, body: dict[str, Any]) -> tuple[str, list[str], dict[str, Any]]:
    """(text, status texts, the last chunk's extra fields) of a streamed OpenAI chat."""
    text, statuses, extra = "", [], {}
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {server.token}"}) as h:
        with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("status_code") == "function":
                        statuses.append(delta["status"])
                    text += delta.get("content") or ""
                extra.update({k: v for k, v in chunk.items() if k.startswith("localm_")})
    return text, statuses, extra


def test_event_emitter_statuses_reach_the_stream_and_the_reply(server: Any, owner: httpx.Client,
                                                               clients: dict[str, Any]) -> None:
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "cache_prompt": False,
            "messages": [{"role": "user", "content": "Say hi"}]}
    assert valves(owner, "shout_stream", enabled=False).status_code == 200
    try:
        text, statuses, extra = stream_openai(server, body)
    finally:
        valves(owner, "shout_stream", enabled=None)
    assert statuses == ["Stamping for Owner", f"Stamped a reply of {MODEL}"]
    assert text.endswith(" [stamped] [second]")
    assert [e["data"]["description"] for e in extra["localm_events"]] == statuses
    whole = clients["openai"].chat.completions.create(model=MODEL, max_tokens=6, messages=body["messages"], **GREEDY)
    assert whole.choices[0].message.content == text  # the same reply, streamed or not
    events = whole.model_extra["localm_events"]
    assert [(e["function"], e["type"], e["data"]["done"]) for e in events] == [
        ("reply_stamp", "status", False), ("reply_stamp", "status", True)]


def test_a_stream_filter_rewrites_the_streamed_text(server: Any, clients: dict[str, Any]) -> None:
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "cache_prompt": False,
            "messages": [{"role": "user", "content": "Tell me about cats"}]}
    streamed, _, _ = stream_openai(server, body)
    whole = clients["openai"].chat.completions.create(model=MODEL, max_tokens=8, messages=body["messages"],
                                                      **GREEDY).choices[0].message.content
    generated = whole[:-len(" [stamped] [second]")]
    assert generated.upper() != generated  # the model wrote lower case; only the stream was shouted
    assert streamed == generated.upper() + " [stamped] [second]"
    with clients["ollama"]._client.stream("POST", "/api/chat", json={  # the Ollama stream goes through it too
            "model": MODEL, "messages": body["messages"], "options": {"num_predict": 8, "temperature": 0}}) as r:
        said = "".join(json.loads(line)["message"]["content"] for line in r.iter_lines() if line)
    assert said.startswith(generated.upper()[:4])


def test_a_stream_filter_that_raises_ends_the_stream_in_band(server: Any, owner: httpx.Client,
                                                            clients: dict[str, Any]) -> None:
    assert valves(owner, "shout_stream", give_up_after=3).status_code == 200
    try:
        for _ in range(2):  # the count is each reply's own, so both give up at the same chunk
            with httpx.Client(base_url=server.url, timeout=120,
                              headers={"Authorization": f"Bearer {server.token}"}) as h, h.stream(
                    "POST", "/v1/chat/completions", json={"model": MODEL, "max_tokens": 12, "stream": True,
                                                          "messages": [{"role": "user", "content": "Tell a story"}]}
            ) as r:
                assert r.status_code == 200
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")
                        and c["choices"][0].get("finish_reason")]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
            assert finishes == ["error"] and "Shout gave up after 3 chunks" in text
        # a whole reply has no stream calls
        assert say(clients, "openai", [{"role": "user", "content": "Tell a story"}], max_tokens=12)
    finally:
        valves(owner, "shout_stream", give_up_after=None)


def test_a_slow_sync_filter_runs_off_the_event_loop(server: Any, owner: httpx.Client) -> None:
    assert valves(owner, "shout_stream", delay_ms=400).status_code == 200
    events: list[str] = []
    try:
        first = threading.Event()

        def slow() -> None:
            with httpx.Client(base_url=server.url, timeout=120,
                              headers={"Authorization": f"Bearer {server.token}"}) as h, h.stream(
                    "POST", "/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, "stream": True,
                                                          "messages": [{"role": "user", "content": "Count"}]}) as r:
                for line in r.iter_lines():
                    if '"content"' in line:
                        first.set()
                events.append("stream ended")
        worker = threading.Thread(target=slow)
        worker.start()
        assert first.wait(60)
        assert owner.get("/v1/models").status_code == 200  # answered while the filter sleeps in its thread
        events.append("models answered")
        worker.join(120)
    finally:
        valves(owner, "shout_stream", delay_ms=None)
    assert events == ["models answered", "stream ended"]


def test_a_toggle_filter_runs_only_when_a_request_asks_for_it(server: Any, clients: dict[str, Any]) -> None:
    durian = [{"role": "user", "content": "I would like a durian smoothie"}]
    assert say(clients, "openai", durian, max_tokens=1)  # not asked for: it does not run
    message = refusal(lambda: say(clients, "openai", durian, max_tokens=1, filter_ids=["word_guard"]))
    assert "The word 'durian' is not allowed here." in message
    message = refusal(lambda: say(clients, "anthropic", durian, max_tokens=1, filter_ids=["word_guard"]))
    assert "The word 'durian' is not allowed here." in message
    r = httpx.post(server.url + "/api/chat", headers={"Authorization": f"Bearer {server.token}"}, timeout=120, json={
        "model": MODEL, "messages": durian, "stream": False, "filter_ids": ["word_guard"]})
    assert r.status_code == 400 and r.json() == {"error": "The word 'durian' is not allowed here."}
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {server.token}"}) as h:
        r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": durian, "stream": True,
                                                 "filter_ids": ["word_guard"]})
    assert r.status_code == 400 and r.json()["code"] == "function_refused"


# --- pipes ----------------------------------------------------------------------------------------

def test_pipes_are_models_on_every_surface(server: Any, owner: httpx.Client, clients: dict[str, Any]) -> None:
    listed = {m["id"] for m in owner.get("/v1/models").json()["data"]}
    assert {"tool_pipes.echo", "tool_pipes.reverse", "tool_pipes.count", "openai_proxy"} <= listed
    tags = {m.model for m in clients["ollama"].list().models}
    assert {"tool_pipes.echo", "tool_pipes.reverse"} <= tags
    hello = [{"role": "user", "content": "hello big world"}]
    end = " [stamped] [second]"  # the filters still run around a pipe
    for surface in ("openai", "ollama", "anthropic"):
        assert say(clients, surface, hello, model="tool_pipes.echo") == "echo: hello big world" + end
        assert say(clients, surface, hello, model="tool_pipes.count") == "3 words" + end
    # an async generator, streamed through each client
    stream = clients["openai"].chat.completions.create(model="tool_pipes.reverse", messages=hello, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces).lower() == "dlrow gib olleh " + end.lower() and len(pieces) >= 3
    said = "".join(part["message"]["content"] for part in clients["ollama"].chat(
        model="tool_pipes.reverse", messages=hello, stream=True))
    assert said.lower() == "dlrow gib olleh " + end.lower()
    with clients["anthropic"].messages.stream(model="tool_pipes.echo", messages=hello, max_tokens=50) as s:
        assert s.get_final_text() == "ECHO: HELLO BIG WORLD" + end
    # a valve that names one more model
    def models() -> set[str]:
        return {m["id"] for m in owner.get("/v1/models").json()["data"]}

    assert valves(owner, "tool_pipes", extra_model="twin").status_code == 200
    try:
        assert eventually(lambda: "tool_pipes.twin" in models())  # listed again just after the change
    finally:
        valves(owner, "tool_pipes", extra_model=None)
    assert eventually(lambda: "tool_pipes.twin" not in models())
    refused = owner.post("/v1/chat/completions", json={"model": "tool_pipes.echo", "messages": hello,
                                                       "logprobs": True})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "field_not_honoured"
    # a pipe gets the request itself, images included; a text-only model refuses them
    pixel = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    seeing = [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                           {"type": "image_url", "image_url": {"url": pixel}}]}]
    assert say(clients, "openai", seeing, model="tool_pipes.echo") == "echo: what is this" + end
    refused = owner.post("/v1/chat/completions", json={"model": MODEL, "messages": seeing})
    assert refused.status_code == 400 and "messages[0].content[1]: this model takes text only" in refused.text


def test_a_proxy_pipe_answers_through_another_server(upstream: Any, owner: httpx.Client,
                                                     clients: dict[str, Any]) -> None:
    assert valves(owner, "openai_proxy", OPENAI_API_BASE_URL=upstream.url + "/v1", OPENAI_API_KEY="unused",
                  MODEL=MODEL).status_code == 200
    question = [{"role": "user", "content": "Name a colour."}]
    direct = openai.OpenAI(base_url=upstream.url + "/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=question, max_tokens=8, **GREEDY).choices[0].message.content
    via = clients["openai"].chat.completions.create(model="openai_proxy", messages=question, max_tokens=8, **GREEDY)
    assert via.choices[0].message.content == direct + " [stamped] [second]"
    assert via.model == "openai_proxy"
    stream = clients["openai"].chat.completions.create(model="openai_proxy", messages=question, max_tokens=8,
                                                       stream=True, **GREEDY)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed.startswith(direct.upper()[:3]) and streamed.endswith(" [stamped] [second]")


# --- actions --------------------------------------------------------------------------------------

def test_an_action_runs_on_a_message(owner: httpx.Client) -> None:
    body = {"model": MODEL, "id": "msg-1", "chat_id": "", "session_id": "",
            "messages": [{"role": "user", "content": "count these"},
                         {"id": "msg-1", "role": "assistant", "content": "one two three four"}]}
    r = owner.post("/api/functions/word_count_action/action", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["result"] == {"messages": [{"id": "msg-1", "content": "4 words"}], "asked": None, "user": "owner",
                             "action": "word_count_action"}
    assert [e["data"]["description"] for e in out["events"]] == ["Counting words", "Counted"]
    assert valves(owner, "word_count_action", suffix="tokens").status_code == 200
    try:
        assert owner.post("/api/functions/word_count_action/action", json=body).json()["result"]["messages"][0][
            "content"] == "4 tokens"
    finally:
        valves(owner, "word_count_action", suffix=None)
    broken = owner.post("/api/functions/word_count_action/action", json={"messages": []})
    assert broken.status_code == 400 and broken.json()["code"] == "function_refused"
    assert "IndexError" in broken.json()["detail"]
    assert owner.post("/api/functions/nope/action", json=body).status_code == 404
    assert owner.post("/api/functions/reply_stamp/action", json=body).status_code == 404
