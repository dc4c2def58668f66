"""plugin.toml parsing: a malformed manifest names its file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from localm.kernel.manifest import ManifestError, parse_manifest

BASE = 'id = "demo"\nversion = "0.1.0"\nentry = "demo"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plugin.toml"
    path.write_text(text)
    return path


def test_full_manifest(tmp_path: Path) -> None:
    m = parse_manifest(write(tmp_path, BASE + '''
description = "A demo"
scopes = ["demo", "demo:write"]
requires = ["chat"]
requirements = ["humanize>=4", "numpy; python_version < '3'"]
pip_env = { CMAKE_ARGS = "-DGGML_NATIVE=OFF" }
protected = true
ships_disabled = true
commands = ["demo"]
label = "Demo"
group = "Examples"
icon = "star"
'''))
    assert m.id == "demo" and m.scope == "demo" and m.requires == ("chat",) and m.protected and m.ships_disabled
    assert m.requirements == ("humanize>=4", "numpy; python_version < '3'")
    assert m.pip_env == {"CMAKE_ARGS": "-DGGML_NATIVE=OFF"}


@pytest.mark.parametrize("text, message", [
    ('version = "1"\nentry = "x"\n', "field 'id' is required"),
    ('id = "Demo"\nversion = "1"\nentry = "x"\n', "field 'id': must start with a lowercase letter"),
    ('id = "demo"\nversion = "one"\nentry = "x"\n', "field 'version': 'one' is not a version"),
    ('id = "demo"\nversion = 1\nentry = "x"\n', "field 'version': expected a string"),
    (BASE.replace('entry = "demo"', 'entry = "my-module"'), "field 'entry': 'my-module' is not a module path"),
    (BASE + 'scopes = "demo"\n', "field 'scopes': expected a list of strings"),
    (BASE + 'scopes = ["Demo Scope"]\n', "field 'scopes': 'Demo Scope' is not a scope name"),
    (BASE + 'requires = ["Other"]\n', "field 'requires': 'Other' is not a legal plugin id"),
    (BASE + 'requirements = ["not a requirement!!"]\n', "field 'requirements': 'not a requirement!!' is not"),
    (BASE + 'protected = "yes"\n', "field 'protected': expected true or false"),
    (BASE + 'colour = "red"\n', "unknown field(s) 'colour'"),
    (BASE + 'pip_env = { CMAKE_ARGS = 1 }\n', "field 'pip_env': expected a table of strings"),
    ('id = "demo"\nversion = \n', "not valid TOML"),
])
def test_malformed_manifests(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ManifestError) as err:
        parse_manifest(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)
    assert "Traceback" not in str(err.value)
