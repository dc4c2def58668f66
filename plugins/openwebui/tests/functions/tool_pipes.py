"""
title: Text Tools
author: localm tests
version: 0.4.1
description: A manifold of small text models.
"""

from typing import AsyncGenerator

from pydantic import BaseModel, Field


class Pipe:
    class Valves(BaseModel):
        extra_model: str = Field(default="", description="Also offer this model id (a copy of echo)")

    def __init__(self):
        self.type = "manifold"
        self.name = "Tools: "
        self.valves = self.Valves()

    def pipes(self) -> list[dict]:
        models = [{"id": "echo", "name": "Echo"}, {"id": "reverse", "name": "Reverse"},
                  {"id": "count", "name": "Count"}]
        if self.valves.extra_model:
            models.append({"id": self.valves.extra_model, "name": "Extra"})
        return models

    async def pipe(self, body: dict, __user__: dict, __event_emitter__=None, __task__=None):
        model = body["model"][body["model"].find(".") + 1:]
        last = body["messages"][-1]["content"]
        if isinstance(last, list):
            last = " ".join(p.get("text", "") for p in last if p.get("type") == "text")
        if model == "reverse":
            return self._reverse(last, __event_emitter__)
        if model == "count":
            await __event_emitter__({"type": "status", "data": {"description": "Counting", "done": True}})
            return {"choices": [{"message": {"role": "assistant", "content": f"{len(last.split())} words"}}]}
        return f"echo: {last}"

    async def _reverse(self, text: str, emit) -> AsyncGenerator[str, None]:
        await emit({"type": "status", "data": {"description": "Reversing", "done": False}})
        for word in reversed(text.split()):
            yield word[::-1] + " "
