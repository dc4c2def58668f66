from localm import sdk


@sdk.get("/valves/values")
async def values(request: sdk.Request) -> dict:
    return sdk.plugin_of(request).settings


@sdk.hookimpl
def startup(plugin):
    plugin.add_settings([
        sdk.FieldSpec(key="threshold", type=float, default=0.5, description="How sure to be", min=0.0, max=1.0),
        sdk.FieldSpec(key="webhook", type=str, default="", description="Where to post", owner_only=True),
    ])


@sdk.hookimpl
def register_routes(register):
    register(values)
