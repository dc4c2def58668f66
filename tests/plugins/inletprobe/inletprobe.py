"""A chat inlet hook: records the route of every chat request it sees and adds a system
note to the conversation, so a test can tell whether a surface went through the chat
pipeline."""

from localm import sdk

NOTE = ("Note from the inlet probe: this sentence was added by a chat inlet hook, so every surface that "
        "shares the chat pipeline sends it to the model, and its prompt grows by these tokens.")
seen: list[str] = []


@sdk.get("/inletprobe/seen", scope=None, access="open_read")
async def routes_seen(request: sdk.Request) -> dict:
    return {"routes": seen}


@sdk.hookimpl
def chat_inlet(request, context):
    seen.append(context.get("route", ""))
    if "messages" not in request:
        return None  # a text completion: its prompt goes to the model as written
    return {**request, "messages": [{"role": "system", "content": NOTE}, *request["messages"]]}


@sdk.hookimpl
def register_routes(register):
    register(routes_seen)
