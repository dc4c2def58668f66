"""The part of Open WebUI's ``open_webui`` package that Functions import and localm provides.

Open WebUI Functions run inside Open WebUI and often import its helpers. localm provides
the few that Functions use for their own work, written afresh for localm: ``open_webui.utils.misc``
(message helpers and OpenAI message templates), ``open_webui.env`` (log levels and timeouts),
``open_webui.constants`` (task names). Any other ``open_webui`` module is a clear ImportError
that names it (see docs/open-webui.md).
"""
