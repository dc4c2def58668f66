"""A forward_interventions hook: ``probe_delta: {"layer": L, "delta": [...]}`` (or a list of
them) on a chat or text completion adds each delta at its layer's output for this request
only. ``probe_read: "pre" | "post" | "both"`` reads the residual at the first delta's
layer and answers, in a ``probe`` object, how many positions were read and, for "both",
the largest difference between post - pre and the delta. The steering bench uses it too."""

from localm import sdk


@sdk.hookimpl
def forward_interventions(request, model, register):
    probe = request.get("probe_delta")
    if probe is None:
        return
    register.use("probe_delta")
    probes = probe if isinstance(probe, list) else [probe]
    for one in probes:
        register(int(one["layer"]), [float(x) for x in one["delta"]])
    register.header("X-Steerprobe", ",".join(str(one["layer"]) for one in probes))
    wanted = request.get("probe_read")
    if wanted is None:
        return
    register.use("probe_read")
    layer, delta = int(probes[0]["layer"]), probes[0]["delta"]
    seen = {}

    def reader(point):
        def done(rows, prompt_ids, generated_ids):
            seen[point] = rows
            out = {"positions": int(rows.shape[0]), "prompt": len(prompt_ids), "generated": len(generated_ids)}
            if len(seen) == 2:
                out["max_delta_error"] = float(abs(seen["post"] - seen["pre"] - delta).max())
            return {"probe": out}
        return done

    for point in (("pre", "post") if wanted == "both" else (wanted,)):
        register.read(layer, point, reader(point))
