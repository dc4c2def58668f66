"""A zero-cost OpenAI-compatible upstream for bench/remote.py --echo: every POST is answered at
once with a one-token stream (or a one-token reply), and the time each request fully arrived is
kept; ``GET /arrivals`` returns those times (epoch seconds) and forgets them. It keeps every
connection open, as vLLM's and SGLang's servers do.

    python bench/echo_upstream.py PORT
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

ARRIVALS: list[float] = []
MODELS = {"object": "list", "data": [{"id": "echo", "object": "model", "owned_by": "echo", "max_model_len": 2048}]}


def _reply(status: str, kind: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, path = lines[0].split()[:2]
        length = next((int(line.split(":", 1)[1]) for line in lines[1:] if line.lower().startswith("content-length:")), 0)
        body = json.loads(await reader.readexactly(length)) if length else {}
        if method == "GET":
            if path.endswith("/models"):
                writer.write(_reply("200 OK", "application/json", json.dumps(MODELS).encode()))
            elif path == "/arrivals":
                writer.write(_reply("200 OK", "application/json", json.dumps(ARRIVALS).encode()))
                ARRIVALS.clear()
            else:
                writer.write(_reply("404 Not Found", "text/plain", b"not found"))
            await writer.drain()
            continue
        ARRIVALS.append(time.time())
        chat = path.endswith("/chat/completions")
        piece = {"delta": {"content": "1"}} if chat else {"text": "1"}
        end = {"delta": {}} if chat else {"text": ""}
        if not body.get("stream"):
            message = {"message": {"role": "assistant", "content": "1"}} if chat else {"text": "1"}
            whole = {"id": "echo", "object": "chat.completion" if chat else "text_completion", "model": "echo",
                     "choices": [{"index": 0, **message, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            writer.write(_reply("200 OK", "application/json", json.dumps(whole).encode()))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in ({"choices": [{"index": 0, **piece, "finish_reason": None}]},
                          {"choices": [{"index": 0, **end, "finish_reason": "length"}]}):
                writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()


async def main(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
