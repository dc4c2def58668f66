"""Speculative decoding on the llama.cpp engine (speculation.py), through a real server with
the real SmolLM2-135M GGUF and the official SDKs: n-gram drafting and a draft model (an
early-exit copy of SmolLM2 written by ``draft_fixtures.write_draft``: its first layers, the
same vocabulary) keep greedy output exactly what it is without drafting, on every surface,
streamed and not; ``usage.speculation`` counts what was drafted and kept; structured output
stays valid; a stop sequence still reports the counts; a draft model with another vocabulary,
or none at all, is reported unavailable with the spec's reason. Each reply is computed afresh
(``cache_prompt: false``: a prompt read over a reused cache can differ in the last bits, with or
without drafting), and stays short (a prompt and reply under 256 tokens): past that llama.cpp's CPU attention reduces a one-token
step across threads and a checked draft in one pass, so a near-tie can go either way (the
determinism note in docs/models.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from draft_fixtures import write_draft
from localm.sdk.testing import LocalmServer, plugin_module
from project_fixtures import offline_cli

pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
           "trimmed the wick and polished the great lens until it shone. Ships passing the rocks saw the "
           "beam sweep across the water and knew they were close to home.")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result = result + item.price\n"
        "    return result\n")
PROMPTS = [
    [{"role": "user", "content": f"Repeat this passage exactly, word for word:\n\n{PASSAGE}"}],
    [{"role": "user", "content": f"Rename the variable result to subtotal in this code and return the whole "
                                 f"function:\n\n{CODE}"}],
    [{"role": "user", "content": "Write two sentences about the sea."}],
]
MAX_TOKENS = 96


def _config(data_dir: Path, settings: dict[str, Any]) -> None:
    # spec_adaptive off: every step with a draft drafts, whatever the (shared, busy) machine
    # measures; the choice itself is tested on given costs below
    settings = {"spec_adaptive": False, **settings}
    (data_dir / "config.json").write_text(json.dumps({"plugins": {"llamacpp": settings}}))


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("drafts")
    return {"same": write_draft(folder / "draft-same.gguf", layers=30),
            "other": write_draft(folder / "draft-other.gguf", layers=2, vocabulary="other")}


@pytest.fixture(scope="module")
def server(module_server, drafts: dict[str, Path]) -> Iterator[LocalmServer]:
    yield module_server(prepare=lambda d: _config(d, {"n_threads": 2, "spec_draft_model": str(drafts["same"])}),
                        plugins=["chat", "llamacpp", "openai", "anthropic", "responses", "ollama"])


@pytest.fixture(scope="module")
def client(server: LocalmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)


def chat(client: openai.OpenAI, messages: list[dict], source: str, **kw: Any) -> tuple[str, dict[str, Any], Any]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                                           temperature=0, extra_body={"spec_source": source, "cache_prompt": False}, **kw)
    return reply.choices[0].message.content, reply.usage.model_extra["speculation"], reply


def streamed(client: openai.OpenAI, messages: list[dict], source: str) -> tuple[str, dict[str, Any]]:
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"spec_source": source, "cache_prompt": False}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.model_extra["speculation"]


def test_greedy_output_is_the_same_with_ngram_and_with_a_draft_model(client: openai.OpenAI) -> None:
    drafted_somewhere = {"ngram": 0, "draft": 0}
    for messages in PROMPTS:
        plain, none, reply = chat(client, messages, "off")
        assert none is None
        for source in ("ngram", "draft"):
            text, report, again = chat(client, messages, source)
            assert text == plain, (source, messages[0]["content"][:40])
            assert again.usage.completion_tokens == reply.usage.completion_tokens
            assert report["source"] == source and report["state"] in ("on", "idle"), report
            assert report["paused_steps"] == 0
            assert 0 <= report["accepted"] <= report["drafted"]
            # every kept draft token is a token of the reply
            assert report["accepted"] <= again.usage.completion_tokens
            drafted_somewhere[source] += report["accepted"]
            text, report = streamed(client, messages, source)
            assert text == plain and report["source"] == source
    # the quote and the edit repeat their prompt: n-gram drafts are kept there; the draft
    # model is the whole model, so nearly every draft is kept
    assert drafted_somewhere["ngram"] > 20 and drafted_somewhere["draft"] > 20


def test_the_quote_speculates_and_counts_add_up(client: openai.OpenAI) -> None:
    text, report, reply = chat(client, PROMPTS[0], "ngram")
    assert report["state"] == "on" and report["reason"] is None
    assert report["drafted"] >= report["accepted"] > 10
    # the quote is drafted from the passage up to its end: the step the reply ends on counts too
    assert report["accepted"] >= 0.8 * reply.usage.completion_tokens, (report, reply.usage)
    full, full_report, full_reply = chat(client, PROMPTS[0], "draft")
    assert full == text and full_report["state"] == "on" and full_report["reason"] == "draft-on-cpu"
    # a draft model that is the model itself is kept (nearly) every time it is confident
    assert full_report["accepted"] >= 0.9 * full_report["drafted"] > 0


def test_every_surface_gives_the_same_text(client: openai.OpenAI, server: LocalmServer) -> None:
    messages = PROMPTS[1]
    prompt_text = messages[0]["content"]
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused")

    def message(source: str) -> tuple[str, Any]:
        reply = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=messages,
                                       extra_body={"spec_source": source, "temperature": 0, "cache_prompt": False})
        return reply.content[0].text, (reply.usage.model_extra or {}).get("speculation")

    def response(source: str) -> tuple[str, Any]:
        reply = client.responses.create(model=MODEL, input=prompt_text, max_output_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"spec_source": source, "cache_prompt": False})
        return reply.output_text, (reply.usage.model_extra or {}).get("speculation")

    def completion(source: str) -> tuple[str, Any]:
        reply = client.completions.create(model=MODEL, prompt=prompt_text, max_tokens=48, temperature=0,
                                          extra_body={"spec_source": source, "cache_prompt": False})
        return reply.choices[0].text, reply.usage.model_extra["speculation"]

    for surface in (message, response, completion):
        plain, none = surface("off")
        assert not none
        for source in ("ngram", "draft"):
            text, report = surface(source)
            assert text == plain, (surface.__name__, source)
            assert report["source"] == source


def test_the_setting_turns_drafting_on_for_requests_that_do_not_ask(module_server, server: LocalmServer) -> None:
    s = module_server(prepare=lambda d: _config(d, {"n_threads": 2, "spec_source": "ngram"}),
                      plugins=["chat", "llamacpp", "openai", "ollama"])
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=300)
    text, report, _ = chat(client, PROMPTS[0], None)  # spec_source null: the setting's
    assert report["source"] == "ngram" and report["accepted"] > 0
    plain, none, _ = chat(client, PROMPTS[0], "off")
    assert none is None and plain == text
    # the Ollama surface drafts with the setting too, and says what it says without (the
    # module's server, whose setting is off), for a prompt neither server has cached
    OLLAMA_ONLY = [{"role": "user", "content": "Copy this line exactly: " + PASSAGE.split(". ")[1]}]
    def ollama(url: str) -> str:
        return httpx.post(url + "/api/chat", json={"model": MODEL, "messages": OLLAMA_ONLY, "stream": False,
                                                   "options": {"temperature": 0, "num_predict": MAX_TOKENS}},
                          timeout=300).json()["message"]["content"]
    assert ollama(s.url) == ollama(server.url)


def test_sampled_output_with_a_seed_is_reproducible_without_drafting(client: openai.OpenAI) -> None:
    def sampled(source: str) -> str:
        return client.chat.completions.create(model=MODEL, messages=PROMPTS[2], max_tokens=48, temperature=0.9,
                                              seed=7, extra_body={"spec_source": source, "cache_prompt": False}).choices[0].message.content
    assert sampled("off") == sampled("off")
    # with drafting the same seeded draws pick each token; the text is a valid sample either way
    assert sampled("ngram")


def test_json_schema_output_stays_valid_with_drafting(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
              "items": {"type": "string"}}}, "required": ["name", "tags"], "additionalProperties": False}
    messages = [{"role": "user", "content": 'Return JSON for the lighthouse keeper: {"name": "lighthouse keeper", '
                                            '"tags": ["lighthouse", "keeper", "lens"]}'}]
    texts = {}
    for source in ("off", "ngram", "draft"):
        text, report, _ = chat(client, messages, source, max_tokens=80,
                               response_format={"type": "json_schema",
                                                "json_schema": {"name": "k", "schema": schema, "strict": True}})
        value = json.loads(text)
        assert set(value) == {"name", "tags"} and isinstance(value["tags"], list)
        texts[source] = text
    assert texts["ngram"] == texts["off"] == texts["draft"]


def test_a_stop_sequence_still_reports_what_drafting_did(client: openai.OpenAI) -> None:
    plain, _, _ = chat(client, PROMPTS[0], "off")
    cut = plain.split(" ")[12]
    text, report, reply = chat(client, PROMPTS[0], "ngram", stop=[cut])
    assert reply.choices[0].finish_reason == "stop" and cut not in text
    assert plain.startswith(text)
    assert report is not None and report["source"] == "ngram" and report["drafted"] > 0


def test_logprobs_are_those_of_the_tokens_kept(client: openai.OpenAI) -> None:
    def run(source: str) -> list[tuple[str, float]]:
        reply = client.chat.completions.create(model=MODEL, messages=PROMPTS[0], max_tokens=40, temperature=0,
                                               logprobs=True, top_logprobs=2, extra_body={"spec_source": source, "cache_prompt": False})
        return [(t.token, t.logprob) for t in reply.choices[0].logprobs.content]
    off, on = run("off"), run("ngram")
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(on, off))


def test_a_draft_model_with_another_vocabulary_is_refused(module_server, drafts: dict[str, Path]) -> None:
    s = module_server(prepare=lambda d: _config(d, {"n_threads": 2, "spec_draft_model": str(drafts["other"])}),
                      plugins=["chat", "llamacpp", "openai"])
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=300)
    text, report, _ = chat(client, PROMPTS[2], "draft", max_tokens=16)
    assert report["state"] == "unavailable" and report["reason"].startswith("draft-vocab-mismatch")
    assert (report["drafted"], report["accepted"]) == (0, 0)
    plain, _, _ = chat(client, PROMPTS[2], "off", max_tokens=16)
    assert text == plain  # the reply itself is served without drafting
    # n-gram drafting does not need the draft model
    assert chat(client, PROMPTS[0], "ngram")[1]["state"] == "on"


def test_no_draft_model_set_is_draft_model_missing(client: openai.OpenAI, module_server) -> None:
    s = module_server(prepare=lambda d: _config(d, {"n_threads": 2}), plugins=["chat", "llamacpp", "openai"])
    other = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=300)
    _, report, _ = chat(other, PROMPTS[2], "draft", max_tokens=8)
    assert report["state"] == "unavailable" and report["reason"].startswith("draft-model-missing")


def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    ngrams = plugin_module("llamacpp", "speculation").Ngrams([1, 2, 3, 4, 5, 9, 2, 3])
    assert ngrams.draft(3) == ([4, 5, 9], 2)  # (2, 3) ended at 4 before: what followed it
    ngrams.extend([4, 7])
    assert ngrams.draft(8) == ([], 0)  # (4, 7) never came before
    ngrams.extend([2, 3, 4])
    assert ngrams.draft(2) == ([7, 2], 3)  # (2, 3, 4) last came before 7: the longest match
    assert plugin_module("llamacpp", "speculation").Ngrams([5]).draft(4) == ([], 0)


def test_prompt_lookup_in_a_loop_drafts_its_next_turns() -> None:
    """A match whose continuation runs into the present is a loop: the draft goes on around it
    rather than stopping after one period."""
    Ngrams = plugin_module("llamacpp", "speculation").Ngrams
    ngrams = Ngrams([8, 1, 2, 3, 1, 2, 3, 1, 2])
    assert ngrams.draft(7) == ([3, 1, 2, 3, 1, 2, 3], 5)  # (1, 2, 3, 1, 2) came 3 tokens back: period 3
    looping = Ngrams([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3, 4])
    assert looping.draft(8) == ([7, 2, 3, 4, 7, 2, 3, 4], 3)
    assert looping.draft(2) == ([7, 2], 3)
    assert Ngrams([5, 5]).draft(4) == ([], 0)  # no n-gram of two tokens before the last two
    assert Ngrams([5, 5, 5]).draft(4) == ([5, 5, 5, 5], 2)  # a run of one token repeats
    # the text so far, then its start again: it goes on as it went the first time, and around
    assert Ngrams([1, 2, 3, 4, 5, 6, 1, 2]).draft(9) == ([3, 4, 5, 6, 1, 2, 3, 4, 5], 2)
    assert Ngrams([1, 2, 3, 4, 5, 6, 7, 1, 2]).draft(3) == ([3, 4, 5], 2)  # a continuation long enough
    # how far the text already goes round the loop: the tokens equal to the one a period back
    ngrams = Ngrams([8, 1, 2, 3, 1, 2, 3, 1, 2])
    ngrams.draft(7)
    assert ngrams.loop == 5
    ngrams.extend([3, 1])
    ngrams.draft(7)
    assert ngrams.loop == 7
    copying = Ngrams([1, 2, 3, 4, 5, 6, 7, 1, 2])
    copying.draft(3)
    assert copying.loop == 0  # a copy of earlier text, not a loop
    starting = Ngrams([1, 2, 3, 4, 5, 6, 1, 2])
    starting.draft(9)
    assert starting.loop == 0  # its draft goes round, but the text has not gone round once yet

def test_drafting_goes_as_far_as_the_measured_costs_pay() -> None:
    costs = plugin_module("llamacpp", "speculation").Costs()
    for _ in range(3):
        costs.add(1, 0.010)
        costs.add(5, 0.014)
    assert costs.of(3) == pytest.approx(0.012)  # between the sizes measured
    length, rate = costs.best(0.9, 8)
    assert length >= 4 and rate > 2
    assert costs.best(0.05, 8) == (0, 1.0)  # a draft that is nearly always wrong never pays
    # one slow step (something else ran) does not stop drafting of that length
    costs.add(9, 5.0)
    assert costs.of(9) < 0.03
    assert costs.can_pay("ngram", 8) is True
    for _ in range(9):  # a machine where checking n tokens costs n steps
        for n in range(2, 6):
            costs.add(n, 0.010 * n)
    assert costs.best(0.9, 4)[0] == 0 and costs.can_pay("ngram", 4) is False


def _cpu_like(S: Any, sizes: range) -> Any:
    """Costs measured on a CPU where a checked row costs 0.35 of a step."""
    costs = S.Costs()
    for _ in range(3):
        for n in sizes:
            costs.add(n, 0.010 + 0.0035 * (n - 1))
    return costs


def test_a_size_past_the_measured_ones_is_tried_once_going_round_a_loop() -> None:
    """A decode can get cheaper a row past some size (llama.cpp's CPU flash attention takes a
    tiled kernel from 64 rows): a loop tries the longest draft allowed once where it would beat
    one-token steps at its estimated cost, then drafts it while it measures cheap, and a size
    only a loop drafts is never taken to be cheaper than the rows below it grow."""
    S = plugin_module("llamacpp", "speculation")
    costs = _cpu_like(S, range(1, 28))
    assert costs.best(0.995, 63)[0] == 26  # the 64-row step's cost is extrapolated: it does not pay
    assert costs.best(0.995, 63, explore=True)[0] == 63  # never decoded: tried
    assert costs.best(0.995, 26, explore=True)[0] == 26  # nothing longer is allowed
    assert costs.best(0.5, 63, explore=True)[0] < 63  # it would not even beat one-token steps
    costs.add(64, 0.17)  # a quarter less a row than the rows below
    assert costs.best(0.995, 63)[0] == 63
    assert costs.of(40) >= costs.of(17) + 0.0035 * 23 * 0.99  # not interpolated toward the cheap size
    assert costs.best(0.9, 63)[0] < 16  # at a copy's acceptance it still does not pay
    slow = _cpu_like(S, range(1, 28))
    slow.add(64, 1.0)  # tried and slower than the estimate
    assert slow.best(0.995, 63, explore=True)[0] == 26  # not tried again


def test_a_loop_drafts_further_the_longer_the_text_has_followed_it() -> None:
    """Going round a loop, a draft may expect what the rule of succession says of the tokens the
    text has followed it for; a copy of earlier text drafts at most DRAFT_MOST a step."""
    S = plugin_module("llamacpp", "speculation")
    costs = _cpu_like(S, range(1, 65))
    assert [costs.best(0.8, 63, run=run)[0] for run in (0, 4, 30, 200)] == [3, 4, 10, 27]
    state = S.Speculating("ngram", 0.6)
    state.history = [1, 2, 3]
    for _ in range(20):
        state.checked(16, 16, 8)  # copies kept whole so far
    cheap = _cpu_like(S, range(1, 2))
    for _ in range(3):
        cheap.add(64, 0.020)  # rows nearly free at every size measured: drafting as far as allowed pays
        cheap.add(17, 0.015)
    assert state.length(cheap, 63, 8, first=7, most=63) == S.DRAFT_MOST
    assert state.length(cheap, 63, 8, first=7, most=63, loop=30) == 63


def test_a_paused_step_learns_from_the_token_it_draws() -> None:
    """A match length whose prior acceptance does not pay is still measured while paused: each
    paused step's proposal is compared with the token drawn next, so a reply going round a loop
    starts drafting without waiting for a probe, and a wrong proposal keeps it paused."""
    S = plugin_module("llamacpp", "speculation")
    costs = S.Costs()
    for _ in range(3):  # a machine where a checked row costs most of a step: 80% does not pay
        costs.add(1, 0.010)
        for n in range(2, 18):
            costs.add(n, 0.010 + 0.0085 * (n - 1))
    assert costs.best(0.8, 16)[0] == 0

    def paused_steps(history: list[int], follows: list[int]) -> list[int]:
        state = S.Speculating("ngram", 0.6)
        state.history = list(history)
        lengths = []
        for token in follows:
            lengths.append(state.length(costs, 16, 8, first=7))  # the proposal always begins with 7
            state.history.append(token)
        return lengths

    looping = paused_steps([1, 2, 3], [7] * 12)
    assert looping[0] == 0 and looping[-1] > 0  # it came back on its own
    assert paused_steps([1, 2, 3], [5] * 12) == [0] * 12
    # a checked draft is counted once: the step's own proposal is not compared again
    state = S.Speculating("ngram", 0.6)
    state.history = [1, 2, 3]
    assert state.length(costs, 16, 8, first=7) == 0
    state.checked(2, 0, 8)
    state.history.append(7)
    before = state.acceptance(8)
    state.length(costs, 16, 8, first=7)
    assert state.acceptance(8) == before


def test_only_the_owner_names_the_draft_model_file(localm_server, tmp_path: Path) -> None:
    # spec_draft_model names a file the server opens: a config:write key neither sees nor sets it
    data_dir = tmp_path / "data"
    offline_cli(data_dir, "key", "generate")
    writer = offline_cli(data_dir, "key", "create", "--scope", "config:write").strip()
    s = localm_server(data_dir=data_dir, plugins=["chat", "llamacpp"])
    listed = {p["plugin"]: p for p in s.client(writer).get("/v1/plugins/settings").json()["plugins"]}
    keys = {f["key"] for f in listed["llamacpp"]["fields"]}
    assert "spec_source" in keys and "spec_draft_model" not in keys
    refused = s.client(writer).post("/v1/plugins/llamacpp/settings", json={"spec_draft_model": "/etc/passwd"})
    assert refused.status_code == 403
    assert not (data_dir / "config.json").exists()  # nothing was written
    assert s.client(writer).post("/v1/plugins/llamacpp/settings", json={"spec_source": "ngram"}).status_code == 200
    assert json.loads((data_dir / "config.json").read_text())["plugins"]["llamacpp"] == {"spec_source": "ngram"}
