"""
title: Word Count
author: localm tests
version: 0.2.0
description: Counts the words of a message.
"""

from pydantic import BaseModel, Field


class Action:
    class Valves(BaseModel):
        suffix: str = Field(default="words")

    def __init__(self):
        self.valves = self.Valves()

    async def action(self, body: dict, __user__=None, __event_emitter__=None, __event_call__=None,
                     __model__=None, __id__=None) -> dict:
        await __event_emitter__({"type": "status", "data": {"description": "Counting words", "done": False}})
        answer = await __event_call__({"type": "input", "data": {"title": "Anything to add?", "message": ""}})
        last = body["messages"][-1]["content"]
        await __event_emitter__({"type": "status", "data": {"description": "Counted", "done": True}})
        return {"messages": [{"id": body.get("id"), "content": f"{len(last.split())} {self.valves.suffix}"}],
                "asked": answer, "user": __user__["id"], "action": __id__}
