"""
title: OpenAI-compatible Proxy
author: localm tests
version: 1.0.0
description: Answers through any OpenAI-compatible server named in its valves.
requirements: requests
"""

import json
from typing import Generator, Iterator, Union

import requests
from pydantic import BaseModel, Field


class Pipe:
    class Valves(BaseModel):
        OPENAI_API_BASE_URL: str = Field(default="https://api.openai.com/v1")
        OPENAI_API_KEY: str = Field(default="", json_schema_extra={"input": {"type": "password"}})
        MODEL: str = Field(default="gpt-4o-mini", description="The upstream model every request goes to")

    def __init__(self):
        self.valves = self.Valves()

    def pipe(self, body: dict, __user__: dict) -> Union[str, dict, Generator, Iterator]:
        headers = {"Authorization": f"Bearer {self.valves.OPENAI_API_KEY}", "Content-Type": "application/json"}
        payload = {**body, "model": self.valves.MODEL}
        payload.pop("user", None)
        try:
            r = requests.post(f"{self.valves.OPENAI_API_BASE_URL}/chat/completions", json=payload, headers=headers,
                              stream=bool(body.get("stream")), timeout=120)
            r.raise_for_status()
            if body.get("stream"):
                return r.iter_lines()
            return r.json()
        except Exception as e:
            return f"Error: {e}"
