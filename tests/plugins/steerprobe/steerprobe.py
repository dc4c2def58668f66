"""A forward_interventions hook: ``probe_delta: {"layer": L, "delta": [...]}`` (or a list of
them) on a chat or text completion adds each delta at its layer's output for this request
only. The steering bench uses it too."""

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
    probes = probe if isinstance(probe, list) else [probe]
    for one in probes:
        register(int(one["layer"]), [float(x) for x in one["delta"]])
    register.header("X-Steerprobe", ",".join(str(one["layer"]) for one in probes))
