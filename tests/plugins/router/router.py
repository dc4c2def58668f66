"""An inlet that changes the model: a request's ``route_to`` field names the model to answer."""

from localm import sdk


@sdk.hookimpl
def chat_inlet(request, context):
    context.use("route_to")
    target = request.pop("route_to", None)
    if target:
        request["model"] = target
        return request
    return None
