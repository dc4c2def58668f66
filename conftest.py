"""Tests live in tests/ (the kernel, the SDK, the CLI, the chat pipeline, what spans
plugins) and beside each builtin plugin, in plugins/<id>/tests/. Both see the project's
fixtures and hooks, loaded here as a plugin; tests/ is on the import path (pyproject.toml:
``pythonpath``), so its helper modules import by name from either place."""

pytest_plugins = ["project_fixtures"]
