"""The kernel names no plugin: no plugin id in its code, no plugin-owned file format or pull
source. Adding an engine, a model format or a pull source is a plugin's work alone.

The words checked are string literals and imported names in kernel/*.py (comments and
docstrings may mention plugins: they explain, they do not depend). ``chat`` is exempt: it is
the kernel's own word for a model role and a kind of route, not the chat plugin.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL = ROOT / "kernel"
#: what plugins own beyond their ids: their file formats, engines' names and pull schemes
PLUGIN_WORDS = {"ct2", "piper", "faster_whisper", "whisper", "openai+http", "openai+https", "remote"}
EXEMPT = {"chat"}
#: a word that is the kernel's own in one file: the OpenAPI document's "responses" key
OWN_WORDS = {("openapi.py", "responses")}


def plugin_ids() -> set[str]:
    out = set()
    for manifest in (ROOT / "plugins").glob("*/plugin.toml"):
        for line in manifest.read_text().splitlines():
            if line.startswith("id = "):
                out.add(line.split("=", 1)[1].strip().strip('"'))
    return out


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string nodes that are docstrings."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def named(path: Path, words: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value.strip().lower()
            hits = {w for w in words if text == w or text.startswith((w + ".", w + ":", w + "/"))
                    or f"plugins.{w}" in text or f"localm_plugins.{w}" in text}
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {w!r}" for w in sorted(hits)
                      if (path.name, w) not in OWN_WORDS]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                                                   else [])
            for name in names:
                parts = set(name.split("."))
                for w in sorted(parts & words):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_the_kernel_names_no_plugin() -> None:
    words = (plugin_ids() | PLUGIN_WORDS) - EXEMPT
    assert "llamacpp" in words and "openwebui" in words
    found = [hit for path in sorted(KERNEL.rglob("*.py")) for hit in named(path, words)]
    assert found == []


def test_the_check_finds_a_plugin_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""The llamacpp engine is mentioned here, which is fine."""\n'
                   'ENGINES = {"gguf": ("llamacpp",)}\nSOURCE = "openai+http://host/v1#m"\n'
                   'from localm.plugins.voice import formats\nRUNTIME = "openwebui"\n')
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = named(bad, {"llamacpp", "openai+http", "voice", "openwebui"})
    finally:
        ROOT = saved
    assert found == ["bad.py:2: 'llamacpp'", "bad.py:3: 'openai+http'", "bad.py:4: imports localm.plugins.voice",
                     "bad.py:5: 'openwebui'"]
