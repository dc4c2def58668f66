"""Chat hooks with a defect, on request: the inlet raises when a message says "explode" and
returns a request that cannot be read when the request sends ``"break_request": true``; the
stream hook raises on the first text event of a request that sends ``"fail_stream": true``
and returns a string (not an event) for one that sends ``"bad_event": true``."""

from localm import sdk


@sdk.hookimpl
def chat_inlet(request, context):
    context.use("fail_stream", "bad_event", "break_request")
    context.state["fail"] = bool(request.get("fail_stream"))
    context.state["bad"] = bool(request.get("bad_event"))
    if any("explode" in str(m.get("content")) for m in request.get("messages", [])):
        raise RuntimeError("internal detail: /srv/secret/path")
    if request.get("break_request"):
        return {**request, "messages": "not a list"}
    return None


@sdk.hookimpl
async def chat_stream(event, context):
    if event["type"] != "text":
        return None
    if context.state.get("fail"):
        raise KeyError("another internal detail")
    if context.state.get("bad"):
        return "not an event"
    return None
