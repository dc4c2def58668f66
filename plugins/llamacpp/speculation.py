"""Speculative decoding for the llama.cpp engine: a reply decoding alone drafts a few tokens,
the target model checks them in one decode, and every drafted token it would have drawn
itself is kept.

Two draft sources:

- ``ngram`` (prompt lookup, :class:`Ngrams`): the continuation of the latest earlier match of
  the reply's last n tokens (n = 8 down to 2) in the prompt and the reply so far; where that
  continuation runs into the present (the reply is going round a loop), the draft goes on
  around the loop. It costs nothing to propose and pays where a reply repeats its context:
  quoting a passage, editing code, JSON that echoes its input, a list whose items repeat.
- ``draft`` (:class:`DraftModel`): a small GGUF sharing the model's vocabulary, in a context
  of its own, proposing its greedy tokens one at a time while it is confident.

The engine draws each checked row with the request's own sampler, in order, and stops at the
first token that differs from the draft (see ``LlamaEngine._speculate``): greedy output is
the output without drafting, and a sampled reply has the same distribution. With a draft that
proposes one token (both sources do), drawing from the target and keeping the draft while they
agree is speculative sampling's acceptance rule (keep the draft with probability p(draft),
otherwise draw from p without it), with one draw of the request's seeded generator a token.

Whether to draft, and how far, is decided each step from measured costs (:class:`Costs`): the
seconds a decode of n tokens takes for one reply, and the reply's measured acceptance. A step
where the expected tokens per second of drafting do not beat one token a step is decoded
without drafting (a paused step). A copy or a draft model drafts at most ``DRAFT_MOST`` tokens a
step, a loop up to spec_draft_max. A paused step's prompt-lookup proposal is still compared with
the token the step draws (``Speculating.length``), and every ``PROBE_EVERY`` paused steps one
draft is tried, so drafting resumes where the text turns repetitive.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

log = logging.getLogger("localm.plugin.llamacpp")

#: The draft sources this engine runs.
SOURCES = ("ngram", "draft")
#: The n-gram lengths prompt lookup matches, longest first: a longer match predicts better, and
#: each length's acceptance is measured apart.
NGRAM_LONGEST, NGRAM_SHORTEST = 8, 2
#: After this many steps held back by costs, one short draft is tried anyway; each probe that
#: keeps nothing doubles the wait (up to PROBE_MOST). A draft model, which must read everything
#: since its last draft to propose anything, gets DRAFT_PROBES such probes a reply.
PROBE_EVERY, PROBE_MOST, DRAFT_PROBES = 16, 256, 2
#: A draft model stops proposing when its top token's probability falls below this.
DRAFT_P_MIN = 0.5
#: The acceptance at which a source is judged able to pay at all (the spec's ngram-cannot-pay
#: and draft-cannot-pay), and the gain it must then show.
CAN_PAY = {"ngram": 0.90, "draft": 0.85}
CAN_PAY_GAIN = 1.05
#: The most tokens drafted a step, except by prompt lookup going round a loop (up to
#: spec_draft_max): where a copy ends, or where a draft model stops agreeing, cannot be seen
#: coming, and past this the acceptance measured so far overstates what a longer draft keeps.
DRAFT_MOST = 16
#: The acceptance key of prompt-lookup proposals going round a loop, measured apart from copies
#: (whose keys are their match lengths, 2-8; a draft model's is 0).
LOOP = -1


class Ngrams:
    """Where each n-gram of a token sequence last ended before its end, kept up to date as
    tokens are appended: ``draft(k)`` is what followed the latest earlier match of the last
    n tokens (the longest n that matches), and n. A continuation shorter than k that reaches
    the last token is a loop of period (its length): its turns repeat it up to k tokens, and
    ``loop`` says for how many tokens the text already repeats at that period (0: a copy)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens: list[int] = []
        self.loop = 0  # the last draft went round a loop: the tokens that already repeat at its period
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(NGRAM_SHORTEST, NGRAM_LONGEST + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        mine = self.tokens
        for token in tokens:
            end = len(mine)  # the n-grams ending here now have a continuation: this token
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(mine[end - n:end])] = end
            mine.append(token)

    def draft(self, k: int) -> tuple[list[int], int]:
        mine, size = self.tokens, len(self.tokens)
        self.loop = 0
        for n in range(NGRAM_LONGEST, NGRAM_SHORTEST - 1, -1):
            if size < n:
                continue
            end = self._ends[n].get(tuple(mine[size - n:]))
            if end is not None:
                found = mine[end:end + k]
                if len(found) < k and end + len(found) == size:
                    # the match's continuation runs into the present: a loop of period size - end,
                    # whose next turns repeat it
                    period = size - end
                    while len(found) < k:
                        found.append(found[len(found) - period])
                    at = size - 1
                    while at >= period and mine[at] == mine[at - period]:
                        at -= 1
                    if size - 1 - at >= period:  # it went round at least once: a loop, not a copy
                        self.loop = size - 1 - at
                return found, n
        return [], 0


class Costs:
    """Measured seconds of a decode of n tokens for a reply decoding alone, and of one
    draft-model token: the median of the latest ``WINDOW`` of each, so a step slowed by
    something else running on the machine moves nothing."""

    WINDOW = 9
    SURE = 3

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.samples: dict[int, int] = {}
        self._recent: dict[int, list[float]] = {}
        self.draft_token: float | None = None
        self._drafts: list[float] = []

    @classmethod
    def _median(cls, recent: list[float], seconds: float) -> float:
        recent.append(seconds)
        del recent[:-cls.WINDOW]
        ordered = sorted(recent)
        return ordered[len(ordered) // 2]

    def add(self, n: int, seconds: float) -> None:
        self.seconds[n] = self._median(self._recent.setdefault(n, []), seconds)
        self.samples[n] = self.samples.get(n, 0) + 1

    def add_draft(self, seconds: float) -> None:
        self.draft_token = self._median(self._drafts, seconds)

    @property
    def known(self) -> bool:
        return 1 in self.seconds

    def of(self, n: int) -> float:
        """The cost of a decode of ``n`` tokens (see :meth:`table`)."""
        return self.table(n)[n]

    def table(self, most: int) -> list[float]:
        """The cost of a decode of each n = 0..``most`` tokens (0: unused). A size measured at
        least ``SURE`` times costs what was measured. Any other is estimated from the nearest
        sizes measured that often: on the line between the largest below and the smallest
        above, or past the largest, growing from it by the per-token cost measured from one
        token up to it (at least 5% of a token's step). Past ``DRAFT_MOST + 1`` (sizes only a
        loop drafts) a size between two measured ones also costs at least that growth: a
        decode may get cheaper a token from some size on (llama.cpp's CPU flash attention takes
        a tiled kernel from 64 tokens), and a size below that one does not (see :meth:`best`).
        A size measured fewer times counts at most as its estimate, so one slow sample does not
        stop drafting of that length for good."""
        seconds, samples = self.seconds, self.samples
        one = seconds[1]
        sure = sorted(m for m in seconds if m == 1 or samples[m] >= self.SURE)
        out = [0.0] * (most + 1)
        i = 0  # sure[i] is the largest sure size up to n
        for n in range(1, most + 1):
            while i + 1 < len(sure) and sure[i + 1] <= n:
                i += 1
            below = sure[i]
            if below == n:
                out[n] = seconds[n]
                continue
            slope = (seconds[below] - one) / (below - 1) if below > 1 else 0.0
            guess = seconds[below] + max(slope, 0.05 * one) * (n - below)
            if i + 1 < len(sure):
                above = sure[i + 1]
                line = seconds[below] + (n - below) / (above - below) * (seconds[above] - seconds[below])
                guess = max(guess, line) if n > DRAFT_MOST + 1 else line
            out[n] = min(seconds[n], guess) if n in seconds else guess
        return out

    def best(self, acceptance: float, most: int, per_draft: float = 0.0,
             explore: bool = False, run: int = 0) -> tuple[int, float]:
        """The draft length (0..most) with the most expected tokens a second at this per-token
        acceptance, and that rate as a multiple of decoding one token a step.

        A draft going round a loop the text has followed for ``run`` tokens may instead be
        expected to keep what the rule of succession says: the chance that the loop goes on for
        j more tokens is (run + 1) / (run + j + 1), whatever the acceptance measured so far.

        With ``explore``, where a draft of ``most`` has never been decoded and would beat one
        token a step at its estimated cost, ``most`` is returned instead (once: it is measured
        then), since the estimate of a size past the measured ones is only a guess (on a CPU, a
        decode of 64 tokens or more can cost far less a token than the sizes below it)."""
        costs = self.table(most + 1)
        one = costs[1]
        best, rate = 0, 1.0
        a = min(max(acceptance, 0.0), 0.995)
        expected, going, looping = 1.0, 1.0, 0.0
        for length in range(1, most + 1):
            going *= a  # the chance that this many drafted tokens are all kept
            if run:
                looping = (run + 1) / (run + length + 1)
            expected += max(going, looping)
            r = expected * one / (costs[length + 1] + length * per_draft)
            if r > rate:
                best, rate = length, r
        if explore and best < most and r >= 1.0 and not self.samples.get(most + 1):
            return most, rate
        return best, rate

    def can_pay(self, source: str, most: int) -> bool | None:
        """Whether drafting at the spec's acceptance for the source would beat one token a
        step by 5% (None: not measured enough to say)."""
        if not self.known or sum(self.samples.get(n, 0) for n in range(2, most + 2)) < 4:
            return None
        per_draft = 0.0
        if source == "draft":
            if self.draft_token is None:
                return None
            per_draft = self.draft_token
        return self.best(CAN_PAY[source], most, per_draft)[1] >= CAN_PAY_GAIN


class Speculating:
    """One reply's drafting: its source, the counts ``usage.speculation`` reports, and the
    acceptance measured so far (a per-token rate, from a prior the engine keeps), for n-gram
    drafts by the length of the match."""

    def __init__(self, source: str, prior: float) -> None:
        self.source = source
        self.drafted = self.accepted = 0
        self.verified = 0  # steps that checked a draft
        self.paused_steps = 0  # steps held back because drafting did not pay
        self.held = 0  # paused steps since the last draft
        self.probe_every = PROBE_EVERY
        self.probes_left: int | None = DRAFT_PROBES if source == "draft" else None
        self.shared = 0  # steps decoded beside other replies (no drafting then)
        self.state: str | None = None  # set when drafting cannot run at all (off, unavailable)
        self.reason: str | None = None
        self._prior = prior
        self._counts: dict[int, list[float]] = {}  # match length (0: a draft model) -> [kept, missed]
        self.history: list[int] = []  # prompt and reply so far (the draft model's input)
        self.ngrams: Ngrams | None = None
        self._watch: tuple[int, int, int] | None = None  # a paused step's (match, where, first token)
        self._step: list[int] | None = None  # a draft being checked: [drafted, kept so far, match]

    def _start(self, match: int) -> list[float]:
        """The prior as counts: the engine's for a draft model, and for an n-gram match one that
        trusts a longer match more (0.5 for 2 tokens, 0.8 for 8)."""
        prior = self._prior if not match else 0.8 if match == LOOP else min(0.9, 0.4 + 0.05 * match)
        return [2 * prior, 2 * (1 - prior)]

    def acceptance(self, match: int = 0) -> float:
        kept, missed = self._counts.get(match) or self._start(match)
        return kept / (kept + missed)

    @property
    def overall(self) -> float:
        kept = sum(k for k, _ in self._counts.values())
        missed = sum(m for _, m in self._counts.values())
        return kept / (kept + missed) if kept + missed else self._prior

    def length(self, costs: Costs, found: int, match: int, adaptive: bool = True, first: int | None = None,
               most: int | None = None, loop: int = 0) -> int:
        """How many of the ``found`` tokens prompt lookup proposed (a match of ``match`` tokens,
        beginning with ``first``) to draft this step: as far as the measured costs and acceptance
        say it pays (all of them when not ``adaptive``); 0: it does not pay. A copy drafts at most
        ``DRAFT_MOST``; a proposal going round a loop the text has followed for ``loop`` tokens
        (``Ngrams.loop``) up to ``most``, the most the step allows, and whole once to measure
        that size (``Costs.best``).

        A step that does not pay still learns: the proposal's first token is compared with the
        token the step draws (the next time this is called) and counted in the match length's
        acceptance as a one-token draft would be. Without that, a match length whose prior
        acceptance does not pay would never be drafted, and a reply going round a loop would
        wait for the next probe to find out."""
        watched, self._watch = self._watch, None
        if watched is not None and len(self.history) > watched[1]:
            self._count(watched[0], 1, int(self.history[watched[1]] == watched[2]))
        if not adaptive:
            return found
        if not loop:
            found = min(found, DRAFT_MOST)
        explore = bool(loop) and most is not None and found >= most
        length = costs.best(self.acceptance(match), found, explore=explore, run=loop)[0]
        if not length and first is not None:
            self._watch = (match, len(self.history), first)
        return length

    def paused(self) -> bool:
        """A step where drafting does not pay: counted, and whether to try a short draft anyway."""
        self.paused_steps += 1
        self.held += 1
        return self.probe()

    def probe(self) -> bool:
        """After a paused step: whether to try a short draft now."""
        if self.held < self.probe_every or self.probes_left == 0:
            return False
        if self.probes_left is not None:
            self.probes_left -= 1
        return True

    def probed(self, kept: int) -> None:
        if not kept:
            self.probe_every = min(PROBE_MOST, 2 * self.probe_every)

    def checking(self, drafted: int, match: int = 0) -> None:
        """A draft of ``drafted`` tokens is being checked: its rows are drawn one by one (``keep``
        for each drafted token drawn), and the reply may end on any of them (``settle``)."""
        self._step = [drafted, 0, match]

    def keep(self) -> None:
        if self._step is not None:
            self._step[1] += 1

    def settle(self) -> None:
        """The draft being checked is done: counted (also when the reply ended on one of its rows,
        before its report is made)."""
        if self._step is not None:
            drafted, kept, match = self._step
            self.checked(drafted, kept, match)

    def checked(self, drafted: int, kept: int, match: int = 0) -> None:
        self._step = None
        self.drafted += drafted
        self.accepted += kept
        self.verified += 1
        self.held = 0
        self._watch = None  # this step's draft was checked: nothing to compare
        self._count(match, drafted, kept)

    def _count(self, match: int, drafted: int, kept: int) -> None:
        # a draft of k tokens, kept up to the first miss: kept successes and one failure
        counts = self._counts.setdefault(match, self._start(match))
        counts[0] = 0.9 * counts[0] + kept
        counts[1] = 0.9 * counts[1] + (1 if kept < drafted else 0)

    def report(self, cannot_pay: bool) -> dict[str, Any]:
        self.settle()
        state, reason = self.state, self.reason
        if state is None:
            if self.drafted:
                state = "paused" if self.paused_steps >= self.verified else "on"
            elif cannot_pay:
                state, reason = "unavailable", f"{self.source}-cannot-pay"
            else:
                state = "idle"
                if self.paused_steps:
                    reason = "not-paying"
                elif self.shared:
                    reason = "shared-batch"
        return {"source": self.source, "state": state, "drafted": self.drafted, "accepted": self.accepted,
                "paused_steps": self.paused_steps, "reason": reason}


class DraftModel:
    """A draft GGUF in a context of its own (one sequence), for the engine's target model.
    ``refused`` is the spec's reason when it cannot serve (draft-model-missing,
    draft-unsupported-role, draft-load-failed, draft-vocab-mismatch, draft-context-refused);
    ``on_cpu`` whether it runs on the CPU."""

    def __init__(self, path: str, target: Any, *, n_ctx: int, n_batch: int, threads: int, gpu: bool) -> None:
        self.llm: Any = None
        self.batch: Any = None
        self.refused: str | None = None
        self.tokens: list[int] = []  # what its cache holds
        self._views: dict[int, Any] = {}  # logits views by address (see _logits)
        self.on_cpu = not gpu
        self.path = path
        if not path:
            self.refused = "draft-model-missing: no spec_draft_model is set"
            return
        if not os.path.isfile(path):
            self.refused = f"draft-model-missing: {path} is not a file"
            return
        try:
            from llama_cpp import Llama
            import llama_cpp
        except ImportError as exc:  # noqa: F841 - the engine itself imported it
            self.refused = f"draft-load-failed: {exc}"
            return
        try:
            from localm.sdk.gguf import metadata
            meta = metadata(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is refused the same way
            self.refused = f"draft-load-failed: {os.path.basename(path)} is not a GGUF file ({exc})"
            return
        kind = meta.get("general.type") or "model"
        arch = meta.get("general.architecture", "")
        if kind != "model" or arch in ("clip", "bert", "nomic-bert", "jina-bert-v2", "t5encoder"):
            self.refused = f"draft-unsupported-role: {os.path.basename(path)} is not a causal language model " \
                           f"({kind}, {arch or 'no architecture'})"
            return
        try:
            self.llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                             n_threads_batch=threads, n_gpu_layers=-1 if gpu else 0, verbose=False)
        except Exception as exc:  # noqa: BLE001 - llama.cpp's errors are ValueError or RuntimeError
            self.refused = f"draft-load-failed: {exc}"
            return
        if llama_cpp.llama_model_has_encoder(self.llm._model.model):
            self.refused = "draft-unsupported-role: the draft model has an encoder"
            self.close()
            return
        mismatch = vocabulary_mismatch(target, self.llm)
        if mismatch:
            self.refused = f"draft-vocab-mismatch: {mismatch}"
            self.close()
            return
        self.n_ctx = self.llm.n_ctx()
        self.n_batch = n_batch
        self.n_vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def draft(self, history: Sequence[int], most: int, costs: Costs) -> list[int]:
        """Up to ``most`` greedy tokens after ``history``, stopping at the first whose
        probability is under DRAFT_P_MIN; an empty list when the window cannot hold them."""
        import llama_cpp
        import numpy as np
        if self.llm is None or len(history) + most >= self.n_ctx:
            return []
        ctx = self.llm._ctx.ctx
        mine = self.tokens
        keep = 0
        limit = min(len(mine), len(history) - 1)  # the last token is decoded again for its logits
        while keep < limit and mine[keep] == history[keep]:
            keep += 1
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, keep, -1)
        del mine[keep:]
        started = time.perf_counter()
        pending = list(history[keep:])
        while pending:
            chunk, pending = pending[:self.n_batch], pending[self.n_batch:]
            if not self._decode(chunk, last_logits=not pending):
                return []
        out: list[int] = []
        steps = 0
        while True:
            logits = self._logits()
            token = int(logits.argmax())
            top = float(1.0 / np.exp(logits - logits[token]).sum())
            if top < DRAFT_P_MIN and out:
                break
            out.append(token)
            if len(out) >= most or top < DRAFT_P_MIN or llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, token):
                break  # (nothing after an end of generation is kept)
            step = time.perf_counter()
            if not self._decode([token], last_logits=True):
                break
            costs.add_draft(time.perf_counter() - step)
            steps += 1
        if not steps:  # catching up is part of what drafting costs; counted as one token's
            costs.add_draft(time.perf_counter() - started)
        return out

    def _logits(self) -> Any:
        """A view of the logits of the last decode's last row: made once per address (numpy's
        ``as_array`` costs about 50 µs a call, as the engine's ``_logits_row`` notes)."""
        import ctypes
        import llama_cpp
        import numpy as np
        pointer = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        if not pointer:
            raise RuntimeError("llama.cpp holds no logits for the draft model's last token")
        address = ctypes.cast(pointer, ctypes.c_void_p).value
        view = self._views.get(address)
        if view is None:
            if len(self._views) >= 64:
                self._views.clear()
            view = self._views[address] = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
        return view

    def _decode(self, tokens: list[int], *, last_logits: bool) -> bool:
        import llama_cpp
        batch, at = self.batch, len(self.tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = at + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = last_logits and i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(self.llm._ctx.ctx, batch) != 0:
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.llm._ctx.ctx), 0, -1, -1)
            self.tokens.clear()
            return False
        self.tokens.extend(tokens)
        return True

    def close(self) -> None:
        import llama_cpp
        if self.batch is not None:
            llama_cpp.llama_batch_free(self.batch)
            self.batch = None
        if self.llm is not None:
            self.llm.close()
            self.llm = None


def vocabulary_mismatch(target: Any, draft: Any) -> str | None:
    """Why two llama-cpp-python models do not share a vocabulary (None: they do): every token's
    text must be the same, as must the special tokens the templates use."""
    if target.n_vocab() != draft.n_vocab():
        return f"the draft model has {draft.n_vocab()} tokens, the model {target.n_vocab()}"
    a, b = target._model, draft._model
    for token in range(target.n_vocab()):
        if a.token_get_text(token) != b.token_get_text(token):
            return f"token {token} is {b.token_get_text(token)!r} in the draft model, {a.token_get_text(token)!r} " \
                   "in the model"
    if (target.token_bos(), target.token_eos()) != (draft.token_bos(), draft.token_eos()):
        return "the draft model's begin and end tokens differ"
    return None
