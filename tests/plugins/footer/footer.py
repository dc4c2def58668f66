"""An outlet that appends a footer to every reply, streamed or not, and a stream hook that
counts the text events (and upper-cases them when the ``shout`` setting is on). It records
each message its outlet saw, how the reply ended, and the events each stream carried, for the
tests."""

import attrs

from localm import sdk


@attrs.frozen
class Settings:
    text: str = sdk.setting(" [footer]", description="Appended to every reply")
    shout: bool = sdk.setting(False, description="Upper-case streamed text")


@sdk.hookimpl
def register_settings(register):
    register(Settings)


outlets: list[dict] = []


@sdk.hookimpl
def chat_stream(event, context, plugin):
    if event["type"] == "text":
        context.state["events"] = context.state.get("events", 0) + 1
        if plugin.settings["shout"]:
            return {**event, "text": event["text"].upper()}
    return None


@sdk.hookimpl
def chat_outlet(response, context, plugin):
    outcome = context.outcome
    outlets.append({"route": context.route, "streamed": context.streamed, "content": response["content"],
                    "events": context.state.get("events", 0), "model": context.model,
                    "finish_reason": outcome["finish_reason"], "error": outcome["error"]})
    context.field("footer", {"events": context.state.get("events", 0)})
    return {**response, "content": response["content"] + plugin.settings["text"]}


@sdk.get("/api/footer/seen", scope=None, access="open_read")
async def seen_route() -> dict:
    return {"outlets": outlets}


@sdk.hookimpl
def register_routes(register):
    register(seen_route)
