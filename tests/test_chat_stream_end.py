"""A stream hook that holds text back sends it at the end through chat_stream_end, and the
later plugins' stream hooks see it; hook_priority orders one plugin's hooks apart (its
stream hooks first, its outlet last). A real server and SmolLM2, through the openai SDK."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
HOLDBACK_TOML = '''id = "holdback"
version = "0.1.0"
entry = "holdback"
requires = ["chat"]
priority = 50
hook_priority = {chat_stream = -5, chat_stream_end = -5}
'''
HOLDBACK_PY = '''from localm import sdk


@sdk.hookimpl
def chat_stream(event, context):
    if event["type"] != "text":
        return None
    context.state["held"] = context.state.get("held", "") + event["text"]
    return []  # nothing now: everything at the end


@sdk.hookimpl
def chat_stream_end(context):
    held = context.state.get("held", "")
    return [{"type": "text", "text": held.upper()}] if held else None


@sdk.hookimpl
def chat_outlet(response, context):
    response["content"] = (response.get("content") or "") + " [holdback]"
    return response
'''
BRACKETS_TOML = '''id = "brackets"
version = "0.1.0"
entry = "brackets"
requires = ["chat"]
'''
BRACKETS_PY = '''from localm import sdk


@sdk.hookimpl
def chat_stream(event):
    if event["type"] == "text":
        return {"type": "text", "text": "<" + event["text"] + ">"}
    return None


@sdk.hookimpl
def chat_outlet(response):
    response["content"] = (response.get("content") or "") + " [brackets]"
    return response
'''


@pytest.fixture(scope="module")
def server(module_server: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = module_server(plugins=["chat", "llamacpp", "holdback", "brackets"])
    root = tmp_path_factory.mktemp("plugins")
    for name, toml, code in (("holdback", HOLDBACK_TOML, HOLDBACK_PY), ("brackets", BRACKETS_TOML, BRACKETS_PY)):
        folder = root / name
        folder.mkdir()
        (folder / "plugin.toml").write_text(toml)
        (folder / f"{name}.py").write_text(code)
        done = s.cli("plugin", "install", str(folder))
        assert done.returncode == 0 and done.stdout.endswith("It is active.\n"), done.stderr + done.stdout
    return s


def test_held_text_leaves_at_the_end_through_the_later_stream_hooks(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="open", timeout=120, max_retries=0)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi to me."}], "max_tokens": 12,
           "temperature": 0, "extra_body": {"cache_prompt": False}}
    whole = client.chat.completions.create(**ask).choices[0].message.content
    # not streamed: no stream hooks; the outlets run by their plugins' order (brackets 0, then
    # holdback, whose outlet keeps the manifest's priority of 50)
    assert whole.endswith(" [brackets] [holdback]")
    generated = whole[:-len(" [brackets] [holdback]")]
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(**ask, stream=True)
              if c.choices and c.choices[0].delta.content]
    # holdback's stream hook (hook_priority -5) runs before brackets' (0) and holds every
    # piece; at the end its text passes brackets' stream hook once, then the outlets append
    assert pieces[0] == "<" + generated.upper() + ">", pieces
    assert "".join(pieces[1:]) == " [brackets] [holdback]", pieces


def test_a_hook_priority_for_a_hook_run_in_no_order_is_refused(tmp_path: Path) -> None:
    from localm.kernel.manifest import ManifestError, parse_manifest

    (tmp_path / "plugin.toml").write_text(HOLDBACK_TOML.replace("chat_stream_end", "startup"))
    with pytest.raises(ManifestError, match="'startup' is not a hook run in order"):
        parse_manifest(tmp_path / "plugin.toml")
