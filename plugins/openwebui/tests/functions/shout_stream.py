"""
title: Shout
author: localm tests
version: 0.1.0
description: Upper-cases streamed replies as they arrive.
"""

import time

from pydantic import BaseModel, Field


class Filter:
    class Valves(BaseModel):
        enabled: bool = Field(default=True, description="Upper-case the streamed text")
        delay_ms: int = Field(default=0, ge=0, le=1000, description="Sleep this long on each chunk (a slow filter)")
        give_up_after: int = Field(default=0, ge=0, description="Raise on this many chunks of one reply (0: never)")

    def __init__(self):
        self.valves = self.Valves()
        self.toggle = False
        self.chunks = 0  # counted per reply: each request has its own copy of this state

    def stream(self, event: dict) -> dict:
        self.chunks += 1
        if self.valves.give_up_after and self.chunks >= self.valves.give_up_after:
            raise Exception(f"Shout gave up after {self.chunks} chunks")
        if self.valves.delay_ms:
            time.sleep(self.valves.delay_ms / 1000)  # blocking: it runs in a worker thread
        if self.valves.enabled:
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content"):
                    delta["content"] = delta["content"].upper()
        return event
