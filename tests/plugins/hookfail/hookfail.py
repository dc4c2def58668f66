"""Chat hooks with a defect, on request: the inlet raises when a message says "explode", the
stream hook on the first text event of a request that sends ``"fail_stream": true``."""

from localm import sdk


@sdk.hookimpl
def chat_inlet(request, context):
    context.use("fail_stream")
    context.state["fail"] = bool(request.get("fail_stream"))
    if any("explode" in str(m.get("content")) for m in request.get("messages", [])):
        raise RuntimeError("internal detail: /srv/secret/path")


@sdk.hookimpl
async def chat_stream(event, context):
    if context.state.get("fail") and event["type"] == "text":
        raise KeyError("another internal detail")
