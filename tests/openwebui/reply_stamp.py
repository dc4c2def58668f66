"""
title: Reply Stamp
author: localm tests
version: 1.2.0
description: Says what it is doing through status events, and stamps each reply.
"""

from pydantic import BaseModel, Field


class Filter:
    class Valves(BaseModel):
        priority: int = Field(default=5, description="Priority level for the filter operations.")
        stamp: str = Field(default="[stamped]", description="Text added to the end of each reply.")

    def __init__(self):
        self.valves = self.Valves()

    async def inlet(self, body: dict, __event_emitter__, __user__: dict, __metadata__: dict, __model__: dict,
                    __id__: str, __task__, __chat_id__, __message_id__) -> dict:
        await __event_emitter__({"type": "status", "data": {"description": f"Stamping for {__user__['name']}",
                                                             "done": False}})
        self.model_seen = __model__["id"]  # kept on self for this request's outlet
        self.user_seen = __user__["id"]
        return body

    async def outlet(self, body: dict, __event_emitter__) -> dict:
        assert "messages" in body
        body["messages"][-1]["content"] += f" {self.valves.stamp}"
        await __event_emitter__({"type": "status", "data": {"description": f"Stamped a reply of {self.model_seen}",
                                                             "done": True}})
        return body
