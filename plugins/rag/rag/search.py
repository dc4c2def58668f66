"""Hybrid retrieval: vector and BM25 candidates fused by reciprocal rank, a relevance floor
for ``relevant_only``, and the follow-up question test that decides when the previous
message is searched too.

Why both: embeddings find a paraphrase ("how do I fix the deploy timeout?") but miss exact
strings (``ERR-4471``, a part number, a function name); BM25 finds those and misses
paraphrases. Reciprocal rank fusion (score = Σ 1/(60 + rank)) needs no calibration between
the two scales, so a chunk found by both rises to the top.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
from localm.sdk import defang

RRF_K = 60
#: Chat-like questions with nothing to do with any document: how close they come to a
#: collection's chunks is how close an unrelated question comes, which sets its floor.
PROBES = (
    "What is the weather like today?", "Tell me a joke.", "Who won the football match last night?",
    "What is the capital of Mongolia?", "How are you doing?", "Can you recommend a good movie?",
    "What time is it in Tokyo?", "Translate good morning into Spanish.", "Write a short poem about love.",
    "What is two plus two?", "Who painted the Mona Lisa?", "How tall is Mount Everest?",
    "What should I cook for dinner tonight?", "Summarize the plot of Romeo and Juliet.",
    "What's your favourite colour?", "How do I say thank you in Japanese?", "Is it going to rain tomorrow?",
    "Who is the president of France?", "What is the meaning of life?", "Recommend a song for a road trip.",
    "How many legs does a spider have?", "What year did the Second World War end?",
    "Give me a fun fact about cats.", "What is the speed of light?",
)
FLOOR_MIN, FLOOR_MAX, FLOOR_MARGIN = 0.15, 0.6, 0.05
STOPWORDS = frozenset("""a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just me more most my myself no
nor not now of off on once only or other our ours ourselves out over own same she should so some such than that
the their theirs them themselves then there these they this those through to too under until up very was we were
what when where which while who whom why will with would you your yours yourself yourselves tell me please give
show explain describe know get got let lets let's say said does did done make made use used using""".split())
#: Words a question uses when it builds on the one before ("what about its cost?").
FOLLOW_UP = frozenset("""it its it's they them their theirs this that these those he him his she her hers one
ones same there then above earlier previous former latter else more also too again""".split())
_WORD = re.compile(r"\w+(?:[-_.:/]\w+)*", re.UNICODE)
_TOKEN = re.compile(r"\w+", re.UNICODE)


def terms(text: str) -> list[str]:
    """The content words of ``text`` (stopwords out), as written, without repeats."""
    seen: set[str] = set()
    out = []
    for m in _WORD.finditer(text):
        word = m.group(0).strip("._-:/")
        key = word.lower()
        if not word or key in STOPWORDS or key in seen or (len(key) == 1 and not key.isdigit()):
            continue
        seen.add(key)
        out.append(word)
    return out


def identifier(word: str) -> bool:
    """A word that names one thing exactly: it has a digit or an underscore, a capital after
    its first letter, or it is an acronym."""
    return (any(c.isdigit() for c in word) or "_" in word or any(c.isupper() for c in word[1:])
            or (len(word) >= 2 and word.isupper()))


def match_expression(words: list[str]) -> str:
    """An FTS5 query matching any of ``words`` (a compound word as a phrase of its parts)."""
    parts = []
    for word in words:
        tokens = _TOKEN.findall(word)
        if tokens:
            parts.append('"' + " ".join(t.replace('"', "") for t in tokens) + '"')
    return " OR ".join(parts)


def _spaced(text: str) -> str:
    """``text``'s word tokens, lower-cased, between single spaces (a phrase is then a substring)."""
    return " " + " ".join(_TOKEN.findall(text.lower())) + " "


def lexically_relevant(query_words: list[str], text: str) -> bool:
    """The chunk holds one of the query's identifiers, or most of its content words."""
    if not query_words:
        return False
    tokens = _spaced(text)

    def has(word: str) -> bool:
        return _spaced(word) in tokens

    if any(identifier(w) and has(w) for w in query_words):
        return True
    plain = [w for w in query_words if not identifier(w)]
    return len(plain) >= 2 and sum(has(w) for w in plain) / len(plain) >= 0.6


def follows_up(query: str) -> bool:
    """Whether a question leans on the one before it (a pronoun, "what about", or only a word or two)."""
    words = [w.lower() for w in _TOKEN.findall(query)]
    if not words:
        return False
    if any(w in FOLLOW_UP for w in words):
        return True
    if re.match(r"\s*(and|but|so|what about|how about|why not|and then)\b", query, re.IGNORECASE):
        return True
    return len(terms(query)) <= 1


def floor_of(similarities: list[float]) -> float:
    """A collection's relevance floor from the probes' best similarities: above what three
    in four off-topic questions reach, clamped to a sane band."""
    if not similarities:
        return FLOOR_MIN
    ordered = sorted(similarities)
    upper = ordered[min(len(ordered) - 1, (3 * len(ordered)) // 4)]
    return round(min(FLOOR_MAX, max(FLOOR_MIN, upper + FLOOR_MARGIN)), 4)


@attrs.define
class Candidate:
    id: str
    vector: float | None = None  # cosine similarity
    vector_rank: int | None = None
    lexical: float | None = None  # BM25 (higher is better)
    lexical_rank: int | None = None
    score: float = 0.0
    rerank: float | None = None


def fuse(vector: list[tuple[str, float]], lexical: list[tuple[str, float]]) -> list[Candidate]:
    """Reciprocal rank fusion of two best-first lists; best first."""
    found: dict[str, Candidate] = {}
    for rank, (cid, sim) in enumerate(vector, 1):
        c = found.setdefault(cid, Candidate(cid))
        c.vector, c.vector_rank = sim, rank
        c.score += 1.0 / (RRF_K + rank)
    for rank, (cid, bm25) in enumerate(lexical, 1):
        c = found.setdefault(cid, Candidate(cid))
        c.lexical, c.lexical_rank = bm25, rank
        c.score += 1.0 / (RRF_K + rank)
    return sorted(found.values(), key=lambda c: (-c.score, c.id))


def holds(word: str, text: str) -> bool:
    """Whether ``text`` holds ``word`` as whole tokens (``BX-0503`` in "record BX-0503 lists")."""
    return _spaced(word) in _spaced(text)


def exact_first(candidates: list[Candidate], texts: dict[str, str], words: list[str]) -> list[Candidate]:
    """Candidates holding one of the query's identifiers (a code, a part number) count as
    ranked first by a third list: an exact ``ERR-4471`` then outranks a chunk that only
    embeds close to it, instead of tying with it in the fusion."""
    idents = [w for w in words if identifier(w)]
    if not idents:
        return candidates
    for c in candidates:
        if c.id in texts and any(holds(w, texts[c.id]) for w in idents):
            c.score += 1.0 / (RRF_K + 1)
    return sorted(candidates, key=lambda c: (-c.score, c.id))


def hit(candidate: Candidate, row: Any, doc: dict[str, Any] | None, text: str, collection: str) -> dict[str, Any]:
    """A search hit as the query route and the chat sources show it."""
    return {"id": row.id, "collection": collection, "path": row.path,
            "filename": doc["filename"] if doc else row.path.rsplit("/", 1)[-1],
            "format": doc["format"] if doc else None, "chunk": row.seq,
            "heading": defang(row.heading) if row.heading else row.heading, "text": text,
            "score": round(candidate.score, 6),
            "vector_score": None if candidate.vector is None else round(candidate.vector, 6),
            "lexical_score": None if candidate.lexical is None else round(candidate.lexical, 6),
            "rerank_score": None if candidate.rerank is None else round(candidate.rerank, 6)}
