"""The one-way dependency rule: plugins import localm.sdk, never localm.kernel or another plugin.
A plugin's tests (its tests/ folder) are not the plugin: they may import anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_ROOTS = [ROOT / "plugins", ROOT / "plugin-store", ROOT / "tests" / "plugins"]


def plugin_dirs() -> list[Path]:
    return sorted(d for root in PLUGIN_ROOTS if root.is_dir() for d in root.iterdir()
                  if (d / "plugin.toml").is_file())


def violations(plugin_dir: Path, others: set[str]) -> list[str]:
    found = []
    for path in plugin_dir.rglob("*.py"):
        if path.relative_to(plugin_dir).parts[0] == "tests":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    # the plugin folder is the root package; level 1 is the module's own package
                    depth = len(path.relative_to(plugin_dir).parts) - 1
                    if node.level > depth + 1:
                        found.append(f"{path}:{node.lineno}: relative import leaves the plugin folder")
                    continue
                names = [node.module or ""]
                if node.module == "localm":
                    names = [f"localm.{a.name}" for a in node.names]
            for name in names:
                top = name.split(".")
                if name.startswith("localm.kernel") or name == "localm.kernel":
                    found.append(f"{path}:{node.lineno}: imports {name}")
                elif top[0] in ("localm_plugins",) or name.startswith(("localm.plugins", "localm.plugin_store")):
                    found.append(f"{path}:{node.lineno}: imports {name}")
                elif top[0] in others:
                    found.append(f"{path}:{node.lineno}: imports the {top[0]} plugin")
    return found


@pytest.mark.parametrize("plugin_dir", plugin_dirs(), ids=lambda d: f"{d.parent.name}/{d.name}")
def test_plugin_imports_only_the_sdk(plugin_dir: Path) -> None:
    others = {d.name for d in plugin_dirs()} - {plugin_dir.name}
    assert violations(plugin_dir, others) == []


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "plugin.toml").write_text('id = "bad"\nversion = "0.1"\nentry = "bad"\n')
    (bad / "bad.py").write_text("from localm.kernel.auth import KeyStore\nimport hello\nfrom localm import kernel\n"
                                "from .. import elsewhere\nfrom . import fine\nfrom localm import sdk\n")
    (bad / "tests").mkdir()
    (bad / "tests" / "test_bad.py").write_text("from localm.kernel.auth import KeyStore\nimport hello\n")
    found = violations(bad, {"hello"})
    assert len(found) == 4


def test_the_kernel_imports_no_heavy_dependency() -> None:
    heavy = {"torch", "transformers", "llama_cpp", "faster_whisper", "chromadb", "numpy"}
    for path in (ROOT / "kernel").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                assert mod.split(".")[0] not in heavy, f"{path} imports {mod}"
