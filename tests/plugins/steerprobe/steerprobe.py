"""A forward_interventions hook: ``probe_delta: {"layer": L, "delta": [...]}`` on a chat or
text completion adds that delta at layer L's output for this request only."""

from localm import sdk


@sdk.hookimpl
def forward_interventions(request, model, register):
    probe = request.get("probe_delta")
    if probe is None:
        return
    register.use("probe_delta")
    if model.engine == "llamacpp":
        raise sdk.LocalmError(400, "probe_delta cannot be honoured: llama.cpp cannot steer",
                              code="field_not_honoured", field="probe_delta")
    register(int(probe["layer"]), [float(x) for x in probe["delta"]])
    register.header("X-Steerprobe", str(probe["layer"]))
