"""
title: Reply Events
author: localm tests
version: 0.1.0
description: Changes the reply through message and replace events, or refuses it in its outlet; off by default.
"""

from pydantic import BaseModel, Field


class Filter:
    class Valves(BaseModel):
        mode: str = Field(default="off", json_schema_extra={"input": {"type": "select", "options": [
            "off", "message", "replace", "raise"]}})
        text: str = Field(default=" [appended by an event]", description="What the message or replace event carries")

    def __init__(self):
        self.valves = self.Valves()

    async def outlet(self, body: dict, __event_emitter__) -> dict:
        if self.valves.mode == "raise":
            raise Exception("Reply Events refused the reply in its outlet")
        if self.valves.mode in ("message", "replace"):
            await __event_emitter__({"type": self.valves.mode, "data": {"content": self.valves.text}})
        return body
