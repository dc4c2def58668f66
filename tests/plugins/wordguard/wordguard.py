"""A guard written from docs/plugins.md: a chat_inlet hook that refuses any request whose
messages (or raw prompt) hold a banned word, from its settings or from the request's own
``banned`` field, which it claims. A request it lets through gets a header, a response field
and a status event; it records what it saw for the tests."""

import attrs

from localm import sdk


@attrs.frozen
class Settings:
    banned: list[str] = sdk.setting(factory=lambda: ["zebra"], description="Words no chat may hold")


@sdk.hookimpl
def register_settings(register):
    register(Settings)


seen: list[dict] = []


def texts(request: dict) -> list[str]:
    if "prompt" in request:
        return [request["prompt"]]
    out = []
    for message in request["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [part.get("text", "") for part in content if isinstance(part, dict)]
    return out


@sdk.hookimpl
def chat_inlet(request, context, plugin):
    context.use("banned")
    banned = [*plugin.settings["banned"], *request.get("banned", [])]
    seen.append({"route": context.route, "surface": context.surface, "streamed": context.streamed,
                 "keys": sorted(request), "prompt": "prompt" in request, "owner_tag": context.owner_tag})
    for text in texts(request):
        for word in banned:
            if word.lower() in text.lower():
                raise sdk.LocalmError(400, f"This chat holds a banned word: {word}", code="banned_word")
    context.header("X-Wordguard", "passed")
    context.field("wordguard", {"checked": len(banned)})
    context.status("wordguard", "Checked by wordguard")


@sdk.get("/api/wordguard/seen", scope=None, access="open_read")
async def seen_route() -> dict:
    return {"seen": seen}


@sdk.hookimpl
def register_routes(register):
    register(seen_route)
