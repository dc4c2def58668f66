from localm import sdk


@sdk.get("/failstart/ping")
async def ping() -> dict:
    return {"pong": True}


@sdk.hookimpl
def register_routes(register):
    register(ping)


@sdk.hookimpl
def startup():
    raise RuntimeError("cannot reach its backend")
