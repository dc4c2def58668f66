"""Schema-driven fuzzing (schemathesis) of a real server on loopback: no generated request,
valid or not, gets a server error.

One server runs on a throwaway data dir with an owner key, the llama.cpp engine on the
default model and the plugins that serve the API surfaces (chat, ollama, anthropic,
responses, rag, memory). Every operation in /openapi/openapi.json gets generated cases,
valid data then invalid data, except routes that end the process or change the owner key.
The plugins' routes run first, then the kernel's (whose config writes come last). Each test
prints how many cases got a 2xx, per route group, and asserts floors there, so a document
that stops describing its bodies (and so stops reaching the handlers) fails.

The plugins' run narrows a copy of the document, never the server's: reply caps (max_tokens
and its other names) at most MAX_REPLY so a generation stays short on two CPU cores; no
num_ctx or keep_alive (a new window or an unload after every reply would make each case a
model reload); strings of at most MAX_TEXT characters, lists of at most MAX_ITEMS items and
no fields beyond the documented ones, so a prompt stays a few dozen tokens; model names a
registered model, a collection name the one prepared here, and the paths to index a small
folder prepared here; no previous_response_id (a stored id is never guessed). Invalid data
is generated from that narrowed copy too. The routes that run the model get MODEL_EXAMPLES
cases a mode, the others PLUGIN_EXAMPLES.
"""

from __future__ import annotations

import collections
import copy
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import offline_cli

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("llama_cpp")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES = 100  # per kernel operation and mode (valid data, then invalid data)
PLUGIN_EXAMPLES = 60  # per plugin operation and mode
MODEL_EXAMPLES = 25  # per operation and mode that runs the model (generates or embeds)
MAX_REPLY = 3
MAX_TEXT = 40  # characters in a generated string of a plugin body
MAX_ITEMS = 3  # items in a generated list of a plugin body
PLUGINS = ["chat", "llamacpp", "ollama", "anthropic", "responses", "rag", "memory"]
DEFAULT_MODEL = "smollm2-135m-instruct"
COLLECTION = "fuzz"
#: Operations that stop the server or take the owner key away from the rest of the run.
SKIPPED = {("POST", "/v1/server/shutdown"), ("POST", "/v1/server/restart"), ("POST", "/api/auth/key/rotate"),
           ("POST", "/api/auth/key/clear")}
#: Operations that answer 501 on purpose (a feature this server lacks).
NOT_IMPLEMENTED = {("POST", "/api/push")}
#: Run last in their test: plugin state the run must not toggle early (an engine switched off
#: would turn every later load into a 503), and deletions of what the other operations use.
LAST = {("PATCH", "/v1/config"), ("DELETE", "/api/rag/collections/{name}"), ("DELETE", "/api/delete")}
#: The plugins' routes, by the plugin that serves them.
PLUGIN_ROUTES = {"chat": ("/v1/chat/", "/v1/completions", "/v1/embeddings", "/v1/rerank"),
                 "ollama": ("/api/chat", "/api/generate", "/api/embed", "/api/tags", "/api/ps", "/api/show",
                            "/api/pull", "/api/copy", "/api/delete", "/api/version", "/api/create", "/api/push",
                            "/api/blobs/"),
                 "anthropic": ("/v1/messages",), "responses": ("/v1/responses",), "rag": ("/api/rag/",),
                 "memory": ("/api/memory",)}
RUNS_THE_MODEL = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/api/chat"),
                  ("POST", "/api/generate"), ("POST", "/v1/messages"), ("POST", "/v1/responses"),
                  ("POST", "/v1/embeddings"), ("POST", "/api/embed"), ("POST", "/api/embeddings")}
#: The least number of 2xx answers each plugin's routes must get (about half what a run gets).
PLUGIN_2XX_FLOOR = {"chat": 25, "ollama": 45, "anthropic": 40, "responses": 8, "rag": 90, "memory": 120}
PLUGIN_CASES_FLOOR = 2000


def plugin_of(path: str) -> str | None:
    if path == "/":
        return "ollama"
    return next((name for name, prefixes in PLUGIN_ROUTES.items()
                 if any(path == p.rstrip("/") or path.startswith(p) for p in prefixes)), None)


def group(path: str) -> str:
    parts = [p for p in path.split("/") if p]
    return "/" + "/".join(parts[:2]) if parts and parts[0] in ("v1", "api") else "/" + (parts[0] if parts else "")


@pytest.fixture(scope="module")
def target(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    owner: list[str] = []

    def prepare(data_dir: Path) -> None:
        owner.append(offline_cli(data_dir, "key", "generate").strip())

    s = module_server(prepare=prepare, plugins=PLUGINS)
    docs = tmp_path_factory.mktemp("fuzz-docs")
    (docs / "notes.md").write_text("# Notes\n\nThe lighthouse keeper logs the tide at dawn.\n")
    (docs / "list.txt").write_text("apples\npears\nplums\n")
    client = s.client(owner[0], timeout=120)
    settings = client.post("/v1/plugins/chat/settings", json={"default_max_tokens": MAX_REPLY,
                                                               "task_max_tokens": MAX_REPLY})
    assert settings.status_code == 200, settings.text
    assert client.post("/api/rag/collections", json={"name": COLLECTION}).status_code == 200
    return s, owner[0], docs


def _refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [value["$ref"]] if isinstance(value.get("$ref"), str) else [r for v in value.values() for r in _refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    return []


def narrowed(doc: dict[str, Any], docs: Path) -> dict[str, Any]:
    """A copy of the document whose plugin bodies the run can serve quickly (see the module docstring)."""
    doc = copy.deepcopy(doc)

    def cap(schema: Any) -> None:
        if isinstance(schema, dict):
            if schema.get("type") == "integer":
                schema["maximum"] = min(schema.get("maximum", MAX_REPLY), MAX_REPLY)
            for branch in schema.get("anyOf", []):
                cap(branch)

    def small(schema: Any) -> None:
        """Short strings and lists, no fields beyond the documented ones (prompts stay a few dozen tokens)."""
        if isinstance(schema, dict):
            if schema.get("type") == "string" and "enum" not in schema and "pattern" not in schema:
                schema["maxLength"] = min(schema.get("maxLength", MAX_TEXT), MAX_TEXT)
            if schema.get("type") == "array":
                schema["maxItems"] = min(schema.get("maxItems", MAX_ITEMS), MAX_ITEMS)
            if schema.get("type") == "object" and "properties" in schema:
                schema["additionalProperties"] = False
            for value in schema.values():
                if isinstance(value, (dict, list)):
                    small(value)
        elif isinstance(schema, list):
            for value in schema:
                small(value)

    components = doc.get("components", {}).get("schemas", {})
    plugin_bodies = {ref.rsplit("/", 1)[1] for path, item in doc.get("paths", {}).items() if plugin_of(path)
                     for ref in _refs(item)}
    seen: set[str] = set()
    while plugin_bodies - seen:  # the components the plugins' bodies use, at any depth
        name = (plugin_bodies - seen).pop()
        seen.add(name)
        plugin_bodies |= {ref.rsplit("/", 1)[1] for ref in _refs(components.get(name, {}))}
    for name in seen & set(components):
        small(components[name])
    for name, component in doc.get("components", {}).get("schemas", {}).items():
        props = component.get("properties")
        if not isinstance(props, dict):
            continue
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict"):
            if key in props:
                cap(props[key])
        for key in ("num_ctx", "keep_alive"):
            props.pop(key, None)
            if key in component.get("required", []):
                component["required"].remove(key)
        if "model" in props and name != "ChooseEmbedder":
            if "name" in props and name.startswith("Ollama"):
                props.pop("name")  # the older spelling of model
            props["model"] = {"enum": ["fuzz-copy" if name == "OllamaModelRequest" else DEFAULT_MODEL]}
        if name == "OllamaCopyRequest":
            props["source"], props["destination"] = {"enum": [DEFAULT_MODEL]}, {"enum": ["fuzz-copy"]}
        if name == "AddPaths":
            props["paths"] = {"enum": [str(docs), [str(docs / "notes.md"), str(docs / "list.txt")]]}
        if name == "ResponsesRequest":  # a stored response id is never guessed: each would be a 404
            props.pop("previous_response_id", None)
            props["input"] = {"anyOf": [b for b in props["input"].get("anyOf", [props["input"]])
                                        if b.get("type") != "null"]}
            component["required"] = [*component.get("required", []), "input"]
        if name == "NewCollection":
            props["name"] = {"enum": [COLLECTION]}
    for path, item in doc.get("paths", {}).items():
        if not path.startswith("/api/rag/collections/{name}"):
            continue
        for operation in item.values():
            for parameter in operation.get("parameters", []) if isinstance(operation, dict) else []:
                if parameter.get("in") == "path" and parameter.get("name") == "name":
                    parameter["schema"] = {"type": "string", "enum": [COLLECTION]}
    return doc


def fuzz(s: Any, owner: str, doc: dict[str, Any], keep: Callable[[str, str], bool],
         examples: Callable[[str, str], int]) -> tuple[dict[str, collections.Counter[str]], list[str], int]:
    """Run every kept operation of ``doc``; (counts per group, server errors, operations run)."""
    schema = schemathesis.openapi.from_dict(doc)
    headers = {"Authorization": f"Bearer {owner}"}
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if (op.method.upper(), op.path) not in SKIPPED
                  and keep(op.method.upper(), op.path)]
    operations.sort(key=lambda op: (op.method.upper(), op.path) in LAST)
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    errors: list[str] = []
    slow: list[tuple[float, int, str]] = []

    for op, mode in [(op, mode) for op in operations for mode in GenerationMode]:
        key = (op.method.upper(), op.path)
        began = time.monotonic()

        @given(op.as_strategy(mode))
        @settings(max_examples=examples(*key), deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        def run(case: Any) -> None:
            try:
                response = case.call(base_url=s.url, headers=headers, timeout=120)
            except Exception as exc:  # a request the HTTP client itself cannot send
                counts[group(op.path)]["unsendable"] += 1
                if "Connection" in type(exc).__name__ or "Timeout" in type(exc).__name__:
                    raise
                return
            status = response.status_code
            counts[group(op.path)]["cases"] += 1
            counts[group(op.path)]["ms"] += int(response.elapsed * 1000)
            slow.append((response.elapsed, status, f"{case.method} {case.formatted_path} "
                                                                  f"{str(case.body)[:160]}"))
            counts[group(op.path)][f"{status // 100}xx"] += 1
            if status >= 500 and not (status == 501 and key in NOT_IMPLEMENTED):
                errors.append(f"{status} {case.method} {case.formatted_path} query={case.query!r} "
                              f"body={str(case.body)[:300]}: {response.text[:300]}")

        try:
            run()
        except Unsatisfiable:  # nothing in this operation can be made invalid (it takes no input)
            pass
        print(f"  {mode.value:8} {key[0]:6} {key[1]:45} {time.monotonic() - began:5.1f}s", flush=True)
    for seconds, status, what in sorted(slow, reverse=True)[:8]:
        print(f"  slowest: {seconds:5.2f}s {status} {what}")
    return counts, errors, len(operations)


def report(title: str, counts: dict[str, collections.Counter[str]], operations: int, elapsed: float) -> int:
    total = sum(c["cases"] for c in counts.values())
    print(f"\n{title}: {total} cases over {operations} operations in {elapsed:.0f}s")
    for name, c in sorted(counts.items()):
        print(f"  {name:28} {c['cases']:5} cases  2xx {c['2xx']:4}  4xx {c['4xx']:4}  5xx {c['5xx']:3}  "
              f"server {c['ms'] / 1000:6.1f}s")
    return total


def test_plugin_routes_give_no_server_errors(target: Any) -> None:
    s, owner, docs = target
    doc = narrowed(s.client(owner).get("/openapi/openapi.json").json(), docs)
    started = time.monotonic()
    counts, errors, operations = fuzz(
        s, owner, doc, keep=lambda method, path: plugin_of(path) is not None,
        examples=lambda method, path: MODEL_EXAMPLES if (method, path) in RUNS_THE_MODEL else PLUGIN_EXAMPLES)
    total = report("plugin routes", counts, operations, time.monotonic() - started)
    by_plugin: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for name, c in counts.items():
        plugin = plugin_of(name) or plugin_of(name + "/") or name
        by_plugin[plugin].update(c)
    for plugin, c in sorted(by_plugin.items()):
        print(f"  plugin {plugin:21} {c['cases']:5} cases  2xx {c['2xx']:4}")
    assert not errors, "\n".join(errors[:20]) + f"\n\nserver log:\n{s.log()[-3000:]}"
    assert total >= PLUGIN_CASES_FLOOR
    for plugin, floor in PLUGIN_2XX_FLOOR.items():
        assert by_plugin[plugin]["2xx"] >= floor, (plugin, by_plugin[plugin])
    assert s.client(owner).get("/health").status_code == 200  # still serving


def test_kernel_routes_give_no_server_errors(target: Any) -> None:
    s, owner, _ = target
    doc = s.client(owner).get("/openapi/openapi.json").json()
    started = time.monotonic()
    counts, errors, operations = fuzz(s, owner, doc, keep=lambda method, path: plugin_of(path) is None,
                                      examples=lambda method, path: EXAMPLES)
    total = report("kernel routes", counts, operations, time.monotonic() - started)
    assert not errors, "\n".join(errors[:20]) + f"\n\nserver log:\n{s.log()[-3000:]}"
    assert total >= 2000
    assert s.client(owner).get("/health").status_code == 200  # still serving
