"""A slow chat_inlet hook, written from docs/plugins.md: a request with ``"slow": seconds``
waits that long in the hook, sending a status before it waits; with ``"refuse": status`` it
then refuses the request with that status. Both fields are claimed. A request without
``slow`` passes untouched and at once."""

import asyncio

from localm import sdk


@sdk.hookimpl
async def chat_inlet(request, context):
    context.use("slow", "refuse")
    slow = request.get("slow")
    if not slow:
        return None
    context.status("slowinlet", "Thinking it over")
    await asyncio.sleep(float(slow))
    context.header("X-Slowinlet", "done")
    if request.get("refuse"):
        raise sdk.LocalmError(int(request["refuse"]), "Refused by slowinlet after thinking it over",
                              code="slow_refusal")
    return None
