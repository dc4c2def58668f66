"""
title: Second Stamp
author: localm tests
version: 0.3
"""

from pydantic import BaseModel, Field


class Filter:
    class Valves(BaseModel):
        priority: int = Field(default=10)

    def __init__(self):
        self.valves = self.Valves()

    def outlet(self, body: dict) -> dict:
        body["messages"][-1]["content"] += " [second]"
        return body
