from localm import sdk


@sdk.get("/guard/ping")
async def ping() -> dict:
    return {"pong": "guard"}


@sdk.get("/v1/guard/infer", scope=None, access="inference")
async def infer() -> dict:
    return {"inference": True}


@sdk.hookimpl
def register_routes(register):
    register(ping, infer)
