"""Workflows: ComfyUI API-format graphs in the plugin's data folder, and which node input
takes each field of a request.

A workflow is ``<name>.json`` (a graph as ComfyUI's "Export (API)" writes it: node id →
``{"class_type", "inputs", "_meta"}``). Which input takes each field is said, in order of
precedence, by

1. a sidecar ``<name>.map.json``: ``{"prompt": "6.text", "seed": ["3.seed", "9.seed"], ...}``
   (``NODE.INPUT``, or a list of them; ``null`` says the workflow has no such input);
2. node titles (``_meta.title``) holding ``localm:FIELD`` or ``localm:FIELD=INPUT``
   (``localm:size`` is width and height);
3. the usual nodes: ``EmptyLatentImage``/``EmptySD3LatentImage`` (width, height, batch
   size), ``KSampler`` (seed; the ``CLIPTextEncode`` nodes on its positive and negative
   inputs take the prompt and negative prompt), ``KSamplerAdvanced``/``RandomNoise``
   (noise_seed), ``CheckpointLoaderSimple`` (the checkpoint).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localm import sdk
from localm.sdk.storage import atomic_write_bytes, read_json

FIELDS = ("prompt", "negative_prompt", "width", "height", "seed", "batch_size", "checkpoint")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SIDECAR = ".map.json"
_TITLE = re.compile(r"localm:([a-z_]+)(?:=([A-Za-z0-9_]+))?")
_DEFAULT_INPUT = {"prompt": ("text",), "negative_prompt": ("text",), "seed": ("seed", "noise_seed"),
                  "width": ("width",), "height": ("height",), "batch_size": ("batch_size",),
                  "checkpoint": ("ckpt_name",)}
SIZE_NODES = ("EmptyLatentImage", "EmptySD3LatentImage")
SEED_NODES = {"KSampler": "seed", "KSamplerAdvanced": "noise_seed", "RandomNoise": "noise_seed",
              "SamplerCustom": "noise_seed"}
SAMPLER_NODES = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "CFGGuider")
TEXT_NODES = ("CLIPTextEncode",)


class WorkflowError(sdk.LocalmError):
    def __init__(self, name: str, problem: str) -> None:
        super().__init__(409, f"The workflow {name} cannot be used: {problem}", code="workflow_unusable")


Target = tuple[str, str]  # (node id, input name)


@dataclass
class Workflow:
    name: str
    graph: dict[str, Any]
    #: field -> the inputs that take it (empty: the workflow has none)
    mapping: dict[str, list[Target]] = field(default_factory=dict)
    #: field -> where the mapping came from: "sidecar", "title" or "auto"
    source: dict[str, str] = field(default_factory=dict)

    def takes(self, name: str) -> bool:
        return bool(self.mapping.get(name))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "nodes": len(self.graph),
                "fields": {k: [f"{n}.{i}" for n, i in v] for k, v in self.mapping.items() if v},
                "mapped_by": {k: self.source[k] for k, v in self.mapping.items() if v},
                "takes_size": self.takes("width") and self.takes("height")}

    def apply(self, values: dict[str, Any], *, prefix: str) -> dict[str, Any]:
        """A copy of the graph with ``values`` (field -> value) written to their inputs and
        every ``filename_prefix`` set to ``prefix``, so each run saves a file of its own."""
        graph = copy.deepcopy(self.graph)
        for name, value in values.items():
            for node, inp in self.mapping.get(name, ()):
                graph[node]["inputs"][inp] = value
        for node in graph.values():
            inputs = node.get("inputs", {})
            if isinstance(inputs.get("filename_prefix"), str):
                inputs["filename_prefix"] = prefix
        return graph


def folder_of(data_dir: Path) -> Path:
    path = data_dir / "workflows"
    path.mkdir(parents=True, exist_ok=True)
    return path


def names(folder: Path) -> list[str]:
    return sorted(p.name[:-5] for p in folder.glob("*.json")
                  if not p.name.endswith(SIDECAR) and NAME.match(p.name[:-5]))


def _graph(name: str, path: Path) -> dict[str, Any]:
    graph = read_json(path, None, what=f"The workflow file {path.name}")
    if graph is None:
        raise sdk.LocalmError(400, f"No workflow named {name}", code="unknown_workflow")
    if not isinstance(graph, dict):
        raise WorkflowError(name, "the file is not a JSON object")
    if "nodes" in graph and "links" in graph:
        raise WorkflowError(name, "it is in ComfyUI's UI format; save it with Export (API) instead")
    if isinstance(graph.get("prompt"), dict) and all(isinstance(v, dict) for v in graph["prompt"].values()):
        graph = graph["prompt"]  # the body of a POST /prompt
    for node_id, node in graph.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str) \
                or not isinstance(node.get("inputs", {}), dict):
            raise WorkflowError(name, f"node {node_id} is not {{\"class_type\": ..., \"inputs\": {{...}}}}")
        node.setdefault("inputs", {})
    if not graph:
        raise WorkflowError(name, "it has no nodes")
    return graph


def _target(name: str, graph: dict[str, Any], spec: Any, fld: str) -> Target:
    if not isinstance(spec, str) or "." not in spec:
        raise WorkflowError(name, f"the sidecar's {fld} must be \"NODE.INPUT\" (or a list of them), not {spec!r}")
    node, _, inp = spec.rpartition(".")
    if node not in graph:
        raise WorkflowError(name, f"the sidecar's {fld} names node {node}, which the graph does not have")
    if inp not in graph[node]["inputs"]:
        raise WorkflowError(name, f"the sidecar's {fld} names input {inp} of node {node} "
                                  f"({graph[node]['class_type']}), which has no such input")
    if isinstance(graph[node]["inputs"][inp], list):
        raise WorkflowError(name, f"input {inp} of node {node} is linked to another node; map the node that "
                                  "makes its value")
    return node, inp


def _from_sidecar(name: str, graph: dict[str, Any], path: Path) -> dict[str, list[Target]]:
    sidecar = read_json(path, None, what=f"The workflow sidecar {path.name}")
    if sidecar is None:
        return {}
    if not isinstance(sidecar, dict):
        raise WorkflowError(name, "the sidecar is not a JSON object")
    unknown = sorted(set(sidecar) - set(FIELDS))
    if unknown:
        raise WorkflowError(name, f"the sidecar names unknown field(s) {', '.join(unknown)} "
                                  f"(known: {', '.join(FIELDS)})")
    out: dict[str, list[Target]] = {}
    for fld, spec in sidecar.items():
        specs = [] if spec is None else spec if isinstance(spec, list) else [spec]
        out[fld] = [_target(name, graph, s, fld) for s in specs]
    return out


def _from_titles(graph: dict[str, Any]) -> dict[str, list[Target]]:
    out: dict[str, list[Target]] = {}
    for node_id, node in graph.items():
        title = (node.get("_meta") or {}).get("title")
        if not isinstance(title, str):
            continue
        for fld, inp in _TITLE.findall(title):
            wanted = ["width", "height"] if fld == "size" else [fld]
            for one in wanted:
                if one not in FIELDS:
                    continue
                candidates = (inp,) if inp and fld != "size" else _DEFAULT_INPUT[one]
                found = next((c for c in candidates if c in node["inputs"]
                              and not isinstance(node["inputs"][c], list)), None)
                if found is not None:
                    out.setdefault(one, []).append((node_id, found))
    return out


def _linked_text(graph: dict[str, Any], link: Any) -> Target | None:
    if isinstance(link, list) and len(link) == 2 and str(link[0]) in graph:
        node = graph[str(link[0])]
        if node["class_type"] in TEXT_NODES and isinstance(node["inputs"].get("text"), str):
            return str(link[0]), "text"
    return None


def _auto(graph: dict[str, Any]) -> dict[str, list[Target]]:
    out: dict[str, list[Target]] = {}

    def add(fld: str, target: Target | None) -> None:
        if target is not None and target not in out.setdefault(fld, []):
            out[fld].append(target)

    for node_id, node in graph.items():
        kind, inputs = node["class_type"], node["inputs"]
        if kind in SIZE_NODES:
            for fld in ("width", "height", "batch_size"):
                if fld in inputs and not isinstance(inputs[fld], list):
                    add(fld, (node_id, fld))
        if kind in SEED_NODES and SEED_NODES[kind] in inputs and not isinstance(inputs[SEED_NODES[kind]], list):
            add("seed", (node_id, SEED_NODES[kind]))
        if kind in SAMPLER_NODES:
            add("prompt", _linked_text(graph, inputs.get("positive")))
            add("negative_prompt", _linked_text(graph, inputs.get("negative")))
        if kind == "CheckpointLoaderSimple" and isinstance(inputs.get("ckpt_name"), str):
            add("checkpoint", (node_id, "ckpt_name"))
    return {k: v for k, v in out.items() if v}


def load(folder: Path, name: str) -> Workflow:
    """The workflow ``name`` and its field mapping (400 for an unknown name, 409 for a file
    that cannot be used)."""
    if not NAME.match(name) or name.endswith(".map"):
        raise sdk.LocalmError(400, f"No workflow named {name}", code="unknown_workflow")
    graph = _graph(name, folder / f"{name}.json")
    wf = Workflow(name=name, graph=graph)
    layers = (("sidecar", _from_sidecar(name, graph, folder / f"{name}{SIDECAR}")),
              ("title", _from_titles(graph)), ("auto", _auto(graph)))
    for fld in FIELDS:
        for source, mapping in layers:
            if fld in mapping:
                wf.mapping[fld] = mapping[fld]
                wf.source[fld] = source
                break
    return wf


def listing(folder: Path) -> list[dict[str, Any]]:
    out = []
    for name in names(folder):
        try:
            out.append(load(folder, name).describe())
        except sdk.LocalmError as exc:
            out.append({"name": name, "error": exc.detail})
    return out


def install_shipped(shipped: Path, folder: Path) -> None:
    """Copy the workflows the plugin ships into the data folder, keeping any the user changed."""
    for src in sorted(shipped.glob("*.json")):
        dest = folder / src.name
        if not dest.exists():
            atomic_write_bytes(dest, src.read_bytes())
