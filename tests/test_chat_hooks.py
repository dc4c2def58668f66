"""The chat pipeline's plugin seam, end to end: test plugins written as docs/plugins.md says
(tests/plugins/wordguard, footer, stamp, hookfail, router), installed with `localm plugin
install` into a running server, driven on every chat surface (OpenAI chat and text
completions, Ollama, Anthropic Messages, OpenAI Responses) through the official clients.

- wordguard (priority 0): a chat_inlet that refuses a banned word (from its settings, or the
  request's own ``banned`` field, which it claims); it adds a header, a response field and
  a status event, and records what it saw.
- stamp (priority 5) and footer (priority 10): chat_outlet hooks that append " [stamp]" and
  " [footer]"; footer also has a chat_stream hook (counting text events, upper-casing them
  when its ``shout`` setting is on) and records the message its outlet saw.
- hookfail: hooks with a defect, on request. router: an inlet that changes the model.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import httpx
import pytest

from conftest import TEST_STORE

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
HI = "Say hi to me."
ENDING = " [stamp] [footer]"
#: greedy, computed afresh (a reused KV cache can change llama.cpp's numbers slightly)
FRESH = {"temperature": 0, "extra_body": {"cache_prompt": False}}
SURFACES = ["openai", "ollama", "anthropic", "responses"]
PLUGINS = ["wordguard", "stamp", "footer", "hookfail", "router"]


@pytest.fixture(scope="module")
def server(module_server: Callable[..., Any]) -> Any:
    s = module_server()
    for name in PLUGINS:
        done = s.cli("plugin", "install", str(TEST_STORE / name))
        assert done.returncode == 0, done.stderr + done.stdout
        assert done.stdout.endswith("It is active.\n"), done.stdout
    return s


@pytest.fixture(scope="module")
def clients(server: Any) -> dict[str, Any]:
    return {"url": server.url,
            "openai": openai.OpenAI(base_url=server.url + "/v1", api_key="open", timeout=120, max_retries=0),
            "ollama": ollama.Client(host=server.url, timeout=120),
            "anthropic": anthropic.Anthropic(base_url=server.url, api_key="open", timeout=120, max_retries=0)}


class Said:
    """What one request answered: the reply's text, the fields plugins added, headers, statuses."""

    def __init__(self) -> None:
        self.text = ""
        self.fields: dict[str, Any] = {}
        self.headers: dict[str, str] = {}
        self.statuses: list[str] = []


def ask(clients: dict[str, Any], surface: str, content: str, *, stream: bool, max_tokens: int = 8,
        extra: dict[str, Any] | None = None) -> Said:
    """One chat turn on ``surface`` through its official client."""
    said = Said()
    messages = [{"role": "user", "content": content}]
    extra = extra or {}
    if surface == "openai":
        raw = clients["openai"].chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, stream=stream, extra_body=extra)
        said.headers = dict(raw.headers)
        if not stream:
            reply = raw.parse()
            said.text = reply.choices[0].message.content
            said.fields = reply.model_extra or {}
            return said
        for chunk in raw.parse():
            if not chunk.choices:
                said.fields.update(chunk.model_extra or {})
                continue
            delta = chunk.choices[0].delta
            said.text += delta.content or ""
            if (delta.model_extra or {}).get("status_code"):
                said.statuses.append(delta.model_extra["status_code"])
        return said
    if surface == "ollama":
        options = {"num_predict": max_tokens}
        if extra:  # the ollama client sends no fields of its own: these requests go through httpx
            body = {"model": MODEL, "messages": messages, "options": options, "stream": stream, **extra}
            r = httpx.post(clients["url"] + "/api/chat", json=body, timeout=120)
            if r.status_code != 200:
                raise ollama.ResponseError(r.json()["error"], r.status_code)
            said.text = "".join(json.loads(line)["message"]["content"] for line in r.text.splitlines())
            return said
        if not stream:
            said.text = clients["ollama"].chat(model=MODEL, messages=messages, options=options).message.content
        else:
            said.text = "".join(part.message.content for part in clients["ollama"].chat(
                model=MODEL, messages=messages, options=options, stream=True))
        return said
    if surface == "anthropic":
        client = clients["anthropic"]
        if not stream:
            raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=max_tokens, messages=messages,
                                                           extra_body=extra)
            said.headers = dict(raw.headers)
            reply = raw.parse()
            said.text = "".join(block.text for block in reply.content if block.type == "text")
            said.fields = reply.model_extra or {}
            return said
        with client.messages.stream(model=MODEL, max_tokens=max_tokens, messages=messages,
                                    extra_body=extra) as events:
            for event in events:
                if event.type == "message_delta":
                    said.fields = event.model_extra or {}
            said.text = "".join(b.text for b in events.get_final_message().content if b.type == "text")
        return said
    client = clients["openai"]
    if not stream:
        raw = client.responses.with_raw_response.create(model=MODEL, input=content, max_output_tokens=max_tokens,
                                                        extra_body=extra)
        said.headers = dict(raw.headers)
        reply = raw.parse()
        said.text, said.fields = reply.output_text, reply.model_extra or {}
        return said
    for event in client.responses.create(model=MODEL, input=content, max_output_tokens=max_tokens, stream=True,
                                         extra_body=extra):
        if event.type == "response.output_text.delta":
            said.text += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            said.fields = event.response.model_extra or {}
    return said


def refusal(clients: dict[str, Any], surface: str, content: str, *, stream: bool,
            extra: dict[str, Any] | None = None) -> tuple[int, str]:
    """(status, message) of a request its client must see refused."""
    try:
        ask(clients, surface, content, stream=stream, extra=extra)
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        return exc.status_code, exc.message
    except ollama.ResponseError as exc:
        return exc.status_code, exc.error
    raise AssertionError(f"{surface}: {content!r} was not refused")


def plugin_state(server: Any, name: str) -> dict[str, Any]:
    listing = server.owner().get("/api/plugins").json()
    return next(p for p in listing["plugins"] if p["name"] == name) | {"errors": listing["errors"]}


def set_footer(server: Any, **values: Any) -> None:
    r = server.owner().post("/v1/plugins/footer/settings", json=values)
    assert r.status_code == 200, r.text


# --- refusing -----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("surface", SURFACES)
def test_a_guard_refuses_a_banned_word_on_every_surface(server: Any, clients: dict[str, Any], surface: str,
                                                        stream: bool) -> None:
    status, message = refusal(clients, surface, "Tell me about the zebra.", stream=stream)
    assert status == 400 and "banned word: zebra" in message, (status, message)
    # the request's own field, claimed by the guard, bans more
    status, message = refusal(clients, surface, "Tell me about the lighthouse.", stream=stream,
                              extra={"banned": ["lighthouse"]})
    assert status == 400 and "banned word: lighthouse" in message, (status, message)


def test_a_raw_completion_reaches_the_inlet(server: Any, clients: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError, match="banned word: zebra"):
        clients["openai"].completions.create(model=MODEL, prompt="The zebra ran", max_tokens=4)
    with pytest.raises(ollama.ResponseError, match="banned word: zebra"):
        clients["ollama"].generate(model=MODEL, prompt="The zebra ran", raw=True, options={"num_predict": 4})
    text = clients["openai"].completions.create(model=MODEL, prompt="The horse ran", max_tokens=4).choices[0].text
    assert text.endswith(ENDING)
    seen = httpx.get(server.url + "/api/wordguard/seen").json()["seen"]
    raw = [s for s in seen if s["prompt"]]
    assert {s["route"] for s in raw} >= {"completions", "ollama.generate"}
    assert all("messages" not in s["keys"] for s in raw)


# --- the outlet, chaining and the stream --------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("surface", SURFACES)
def test_outlets_chain_in_priority_order_on_every_surface(server: Any, clients: dict[str, Any], surface: str,
                                                          stream: bool) -> None:
    said = ask(clients, surface, HI, stream=stream)
    # stamp (priority 5) runs before footer (priority 10), though "footer" sorts first by id
    assert said.text.endswith(ENDING), said.text
    generated = said.text[: -len(ENDING)]
    last = httpx.get(server.url + "/api/footer/seen").json()["outlets"][-1]
    # footer's outlet saw the whole reply as the client got it, with stamp's change: hooks chain
    assert last["content"] == generated + " [stamp]", (last, said.text)
    assert last["streamed"] is stream and last["model"] == MODEL
    assert last["finish_reason"] in ("stop", "length") and last["error"] is None  # context.outcome
    if stream:
        assert last["events"] >= 1  # the stream hook saw the text events
    if surface != "ollama":  # the ollama client keeps neither headers nor unknown fields
        assert said.fields.get("wordguard") == {"checked": 1}, said.fields
        assert said.fields.get("footer") == {"events": last["events"]}, said.fields
    if said.headers:
        assert said.headers.get("x-wordguard") == "passed"


def test_ollama_lines_carry_the_fields_and_headers(server: Any) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": HI}], "options": {"num_predict": 4}}
    whole = httpx.post(server.url + "/api/chat", json={**body, "stream": False}, timeout=120)
    assert whole.headers["x-wordguard"] == "passed"
    assert whole.json()["wordguard"] == {"checked": 1} and whole.json()["footer"] == {"events": 0}
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=120) as r:
        assert r.headers["x-wordguard"] == "passed"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["wordguard"] == {"checked": 1}
    assert lines[-1]["footer"]["events"] >= 1
    assert "".join(line["message"]["content"] for line in lines).endswith(ENDING)


def test_an_inlet_status_event_opens_the_stream(clients: dict[str, Any]) -> None:
    said = ask(clients, "openai", HI, stream=True)
    assert said.statuses == ["wordguard"]


def test_a_stream_hook_changes_every_event(server: Any, clients: dict[str, Any]) -> None:
    ask_body = {"model": MODEL, "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
                "max_tokens": 12, **FRESH}
    whole = clients["openai"].chat.completions.create(**ask_body).choices[0].message.content
    set_footer(server, shout=True)
    try:
        chunks = clients["openai"].chat.completions.create(**ask_body, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ollama_text = "".join(p.message.content for p in clients["ollama"].chat(
            model=MODEL, messages=ask_body["messages"], stream=True,
            options={"num_predict": 12, "temperature": 0}))
    finally:
        set_footer(server, shout=None)
    generated = whole[: -len(ENDING)]
    assert generated.strip() and generated.upper() != generated
    # every text event went through the hook; what the outlets appended afterwards did not
    assert streamed == generated.upper() + ENDING, (streamed, whole)
    assert ollama_text.endswith(ENDING) and ollama_text[: -len(ENDING)].isupper() is True


def test_logprobs_are_refused_on_a_stream_a_plugin_rewrites(clients: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError, match="rewrites the stream") as caught:
        list(clients["openai"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HI}],
                                                       max_tokens=4, logprobs=True, stream=True))
    assert caught.value.response.json()["code"] == "field_not_honoured"
    # a whole reply an outlet rewrote keeps no log probabilities (they spell another text)
    reply = clients["openai"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HI}],
                                                      max_tokens=4, logprobs=True)
    assert reply.choices[0].logprobs is None and reply.choices[0].message.content.endswith(ENDING)


# --- claimed fields -----------------------------------------------------------------------

def test_a_claimed_field_is_neither_reported_nor_refused(server: Any) -> None:
    strict = {"X-Localm-Strict": "true"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="open", timeout=120, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": HI}], max_tokens=2, extra_body={"banned": ["qqq"]},
        extra_headers=strict)
    assert raw.status_code == 200 and "x-localm-ignored-fields" not in raw.headers
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": HI}], max_tokens=2,
        extra_body={"banned": ["qqq"], "colour": "red"})
    assert raw.headers["x-localm-ignored-fields"] == '"colour"'
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HI}], max_tokens=2,
                                       extra_body={"banned": ["qqq"], "colour": "red"}, extra_headers=strict)
    refused = caught.value.response.json()
    assert refused["code"] == "unused_fields_refused" and refused["fields"] == ["colour"]
    # the same on the Ollama routes, where the guard's field is one Ollama does not know (the
    # ollama client sends no fields of its own, so this one goes through httpx)
    body = {"model": MODEL, "messages": [{"role": "user", "content": HI}], "stream": False,
            "options": {"num_predict": 2}, "banned": ["qqq"]}
    r = httpx.post(server.url + "/api/chat", json=body, headers=strict, timeout=120)
    assert r.status_code == 200 and "x-localm-ignored-fields" not in r.headers, r.text
    r = httpx.post(server.url + "/api/chat", json={**body, "colour": "red"}, headers=strict, timeout=120)
    assert r.status_code == 400 and r.json()["error"] == "Unused fields (X-Localm-Strict): colour"


# --- changing the model -------------------------------------------------------------------

def test_an_inlet_changes_the_model(server: Any, clients: dict[str, Any]) -> None:
    owner = server.owner()
    assert owner.post("/api/copy", json={"source": MODEL, "destination": "smol-copy"}).status_code == 200
    reply = clients["openai"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HI}],
                                                      max_tokens=2, extra_body={"route_to": "smol-copy"})
    assert reply.model == "smol-copy"
    assert httpx.get(server.url + "/api/footer/seen").json()["outlets"][-1]["model"] == "smol-copy"
    with pytest.raises(openai.NotFoundError, match="The router plugin changed the model to 'no-such-model'"):
        clients["openai"].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HI}],
                                                  max_tokens=2, extra_body={"route_to": "no-such-model"})


# --- a hook that fails ----------------------------------------------------------------------

@pytest.mark.parametrize("surface", SURFACES)
def test_a_hook_that_raises_refuses_the_request(server: Any, clients: dict[str, Any], surface: str) -> None:
    status, message = refusal(clients, surface, "Please explode now.", stream=False)
    assert status == 500 and "hookfail" in message and "secret" not in message, (status, message)
    assert "server log" in message  # where its author finds the traceback
    state = plugin_state(server, "hookfail")
    assert state["active"] is True
    assert state["error"] == "chat_inlet hook failed: RuntimeError: internal detail: /srv/secret/path"
    assert state["errors"]["hookfail"] == state["error"]


def test_a_stream_hook_that_raises_ends_the_stream_in_band(server: Any, clients: dict[str, Any]) -> None:
    chunks = list(clients["openai"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": HI}], max_tokens=4, stream=True,
        extra_body={"fail_stream": True}))
    errors = [c.choices[0].model_extra["localm_error"] for c in chunks
              if c.choices and (c.choices[0].model_extra or {}).get("localm_error")]
    assert errors and errors[0]["status"] == 500 and errors[0]["code"] == "plugin_failed"
    assert "secret" not in json.dumps(errors) and "hookfail" in errors[0]["detail"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "error"
    assert plugin_state(server, "hookfail")["error"] == "chat_stream hook failed: KeyError: 'another internal detail'"
    lines = [json.loads(line) for line in httpx.post(server.url + "/api/chat", json={
        "model": MODEL, "messages": [{"role": "user", "content": HI}], "options": {"num_predict": 4},
        "fail_stream": True}, timeout=120).text.splitlines()]
    assert "hookfail" in lines[-1]["error"]


def test_the_outlet_runs_after_a_failed_reply_with_its_outcome(server: Any, clients: dict[str, Any]) -> None:
    seen = server.url + "/api/footer/seen"
    before = len(httpx.get(seen).json()["outlets"])
    chunks = list(clients["openai"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": HI}], max_tokens=4, stream=True,
        extra_body={"fail_stream": True}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "error"
    after = httpx.get(seen).json()["outlets"][before:]
    assert len(after) == 1 and after[0]["finish_reason"] == "error" and "hookfail" in after[0]["error"], after
    assert not any(" [footer]" in (c.choices[0].delta.content or "") for c in chunks if c.choices)  # reaches nobody


def test_the_outlet_runs_after_the_client_leaves(server: Any) -> None:
    import time
    seen = server.url + "/api/footer/seen"
    before = len(httpx.get(seen).json()["outlets"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to a hundred."}],
            "max_tokens": 200, "stream": True, "temperature": 0}
    for stream in (True, False):
        with httpx.Client(base_url=server.url, timeout=120) as c:
            if stream:
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if '"content"' in line:
                            break  # the client leaves after the first words
            else:
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2000}, timeout=0.5)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            after = httpx.get(seen).json()["outlets"][before:]
            if after:
                break
            time.sleep(0.1)
        assert len(after) == 1 and after[0]["finish_reason"] == "abandoned" and after[0]["error"] is None, after
        assert after[0]["streamed"] is stream
        before += 1


def test_a_hook_that_returns_what_it_may_not_fails_closed(server: Any, clients: dict[str, Any]) -> None:
    ask_body = {"model": MODEL, "messages": [{"role": "user", "content": HI}], "max_tokens": 4}
    with pytest.raises(openai.InternalServerError, match="hookfail"):
        clients["openai"].chat.completions.create(**ask_body, extra_body={"break_request": True})
    assert plugin_state(server, "hookfail")["error"] == (
        "chat_inlet hook failed: ValueError: chat_inlet returned a request that cannot be read: messages: must be "
        "a non-empty list of messages.")
    chunks = list(clients["openai"].chat.completions.create(**ask_body, stream=True,
                                                            extra_body={"bad_event": True}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "error"
    assert plugin_state(server, "hookfail")["error"] == (
        "chat_stream hook failed: TypeError: chat_stream returned str; it returns a dict, a list of dicts or None")


def test_disabling_a_plugin_takes_its_hooks_away(server: Any, clients: dict[str, Any]) -> None:
    assert server.cli("plugin", "disable", "stamp").returncode == 0
    try:
        assert ask(clients, "openai", HI, stream=True).text.endswith(" [footer]")
        assert not ask(clients, "openai", HI, stream=False).text.endswith(ENDING)
    finally:
        assert server.cli("plugin", "enable", "stamp").returncode == 0
    assert ask(clients, "openai", HI, stream=False).text.endswith(ENDING)
