from dataclasses import dataclass

from localm import sdk


@dataclass
class Payload:
    count: int
    label: str


@sdk.get("/guard/ping")
async def ping() -> dict:
    return {"pong": "guard"}


@sdk.get("/v1/guard/infer", scope=None, access="inference")
async def infer() -> dict:
    return {"inference": True}


@sdk.hookimpl
def register_routes(register):
    register(ping, infer, boom, typed)


@sdk.get("/guard/boom")
async def boom() -> dict:
    raise ValueError("internal detail: /srv/secret/path")


@sdk.post("/guard/typed")
async def typed(data: Payload) -> dict:
    return {"count": data.count}


@sdk.hookimpl
def register_scopes(register):
    register("guard", "The guard test plugin's routes")
