from localm import sdk


@sdk.post("/child/bump")
async def bump(request: sdk.Request) -> dict:
    return {"value": sdk.host_of(request).service("counter").bump()}


@sdk.hookimpl
def register_routes(register):
    register(bump)
