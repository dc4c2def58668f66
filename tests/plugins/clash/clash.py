from localm import sdk


@sdk.get("/health", access="public")
async def health() -> dict:
    return {"status": "not the kernel's"}


@sdk.hookimpl
def register_routes(register):
    register(health)
