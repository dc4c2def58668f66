"""The settings of Open WebUI's ``open_webui.env`` that Functions read (log levels, timeouts)."""

import logging
import os

GLOBAL_LOG_LEVEL = os.environ.get("GLOBAL_LOG_LEVEL", "INFO").upper()
if GLOBAL_LOG_LEVEL not in logging.getLevelNamesMapping():
    GLOBAL_LOG_LEVEL = "INFO"

LOG_SOURCES = ["AUDIO", "COMFYUI", "CONFIG", "DB", "IMAGES", "MAIN", "MODELS", "OLLAMA", "OPENAI", "RAG",
               "WEBHOOK", "SOCKET", "OAUTH"]
SRC_LOG_LEVELS = {source: os.environ.get(f"{source}_LOG_LEVEL", GLOBAL_LOG_LEVEL).upper() for source in LOG_SOURCES}


def _seconds(name: str, default: int | None) -> int | None:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        return default


AIOHTTP_CLIENT_TIMEOUT = _seconds("AIOHTTP_CLIENT_TIMEOUT", 300)
AIOHTTP_CLIENT_TIMEOUT_MODEL_LIST = _seconds("AIOHTTP_CLIENT_TIMEOUT_MODEL_LIST", 10)
AIOHTTP_CLIENT_SESSION_SSL = os.environ.get("AIOHTTP_CLIENT_SESSION_SSL", "true").lower() == "true"
ENABLE_FORWARD_USER_INFO_HEADERS = os.environ.get("ENABLE_FORWARD_USER_INFO_HEADERS", "false").lower() == "true"
OFFLINE_MODE = True  # localm fetches nothing on a Function's behalf
WEBUI_NAME = "localm"
DATA_DIR = os.environ.get("DATA_DIR", "")
