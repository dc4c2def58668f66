"""
title: Word Guard
author: localm tests
version: 2.0
description: Refuses requests that hold a banned word; a toggle filter, run only when asked for.
"""

from typing import Optional

from pydantic import BaseModel, Field
from open_webui.utils.misc import get_last_user_message


class Filter:
    class Valves(BaseModel):
        banned: str = Field(default="durian", description="Comma-separated words refused")
        api_secret: str = Field(default="hunter2", json_schema_extra={"input": {"type": "password"}})
        mode: str = Field(default="strict", json_schema_extra={"input": {"type": "select",
                                                                          "options": ["strict", "lenient"]}})

    def __init__(self):
        self.valves = self.Valves()
        self.toggle = True
        self.icon = "data:image/svg+xml;base64,PHN2Zz48L3N2Zz4="

    def inlet(self, body: dict, __user__: Optional[dict] = None) -> dict:
        text = (get_last_user_message(body["messages"]) or "").lower()
        assert text == body["messages"][-1]["content"].lower()  # text-only content is a string, on every API
        for word in self.valves.banned.split(","):
            if word.strip() and word.strip() in text:
                raise Exception(f"The word '{word.strip()}' is not allowed here.")
        return body
