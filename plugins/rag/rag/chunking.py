"""Extracted text cut into chunks for embedding and retrieval.

- Prose (every kind but code): markdown headings (``#`` lines; setext underlines in text and
  markdown) cut the text into sections, and no chunk crosses a heading. Within a section whole
  paragraphs are packed up to ``size`` characters; a longer paragraph is cut at sentence ends,
  then line breaks, then spaces, and a word longer than ``size`` is cut hard.
- A chunk after the first of its section repeats the end of the one before, about ``overlap``
  characters of whole sentences (or whole words when the sentences do not fit), so a fact that
  straddles a cut is still whole in one chunk.
- Code: blocks start after a blank line at a column-0 line (a top-level definition, decorator
  or comment); small blocks are packed up to ``size``, a longer one is cut at blank lines, then
  lines, into chunks of its own. Code chunks do not overlap; the heading is the chunk's first
  column-0 definition line (an import only when nothing else is defined), or the definition of
  the block it continues.
- A chunk's text is a slice of the source: ``text[start:]`` begins with the chunk's own text,
  and the overlap is the slice just before ``start``. Heading lines are not part of any chunk;
  ``heading`` carries the section's path. ``len(own text) <= size`` and
  ``len(chunk.text) <= size + overlap``.
- Pure and deterministic: the same text always gives the same chunks.
"""

from __future__ import annotations

import re

import attrs

KINDS = frozenset({"text", "markdown", "html", "pdf", "docx", "code"})

# Each separator's group 1 is the gap between two pieces.
_PARAGRAPH = re.compile(r"(\n[ \t]*\n\s*)")
_SENTENCE = re.compile(r"(?:[.!?…]+[\"'”’)\]]*(?=\s)|[。！？]+)(\s*)")
_LINE = re.compile(r"(\n\s*)")
_SPACE = re.compile(r"(\s+)")
_PROSE_SPLITS = (_SENTENCE, _LINE, _SPACE)
_CODE_SPLITS = (_PARAGRAPH, _LINE)

_ATX = re.compile(r"[ ]{0,3}(#{1,6})[ \t]+(\S.*)")
_SETEXT = re.compile(r"[ ]{0,3}(=+|-+)[ \t]*")
_FENCE = re.compile(r"[ ]{0,3}(```|~~~)")
_SETEXT_MAX = 120

_DEFINITION = re.compile(
    r"(?:(?:export|pub(?:\([^)]*\))?|public|private|protected|internal|static|abstract|final|async|default"
    r"|extern|inline|unsafe|override|open|sealed|data|virtual|local)\s+)*"
    r"(?:def|class|function|func|fn|impl|struct|enum|trait|interface|type|const|let|var|module|namespace"
    r"|package|import|from|object|mod|union|typedef|sub|proc|record|macro_rules!|#define|create)\b"
    r"|[A-Za-z_][\w<>,:*&\[\] ]*[\s*&]+[A-Za-z_][\w:]*\s*\(",  # C-like: "static int main(void)"
    re.IGNORECASE)
_IMPORT = re.compile(r"(?:import|from|package|use|#include)\b")
_CODE_START = re.compile(r"[^\s})\]]")
_CODE_CONTINUES = re.compile(r"(?:else|elif|elsif|except|finally|catch|end|fi|done|esac)\b")
_HEADING_MAX = 80
#: How much of a line the definition pattern reads (it backtracks on long lines).
_DEFINITION_SCAN = 200


@attrs.frozen
class Chunk:
    """One piece of a document: its text, the heading path of its section ("Install > Linux",
    or the first definition for code; None before any heading), its position among the
    document's chunks, and the offset of its own text (after any overlap) in the source."""

    text: str
    heading: str | None
    index: int
    start: int


Span = tuple[int, int]


class TooManyChunks(ValueError):
    """The text cuts into more chunks than the caller allows (``limit``)."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"{count} chunks is over the limit of {limit}")
        self.count = count
        self.limit = limit


def chunk(text: str, kind: str, *, size: int = 1000, overlap: int = 150,
          max_chunks: int | None = None) -> list[Chunk]:
    """``text`` (of the given extract kind) as chunks of at most ``size`` characters of their own;
    :class:`TooManyChunks` when there would be more than ``max_chunks`` (checked before any
    chunk's text is copied out)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    if size < 1 or not 0 <= overlap < size:
        raise ValueError("size must be positive and overlap in [0, size)")
    pieces = _code_pieces(text, size) if kind == "code" else _prose_pieces(text, kind, size, overlap)
    if max_chunks is not None and len(pieces) > max_chunks:
        raise TooManyChunks(len(pieces), max_chunks)
    return [Chunk(text=text[lo:hi], heading=heading, index=i, start=start)
            for i, (heading, lo, start, hi) in enumerate(pieces)]


# --- prose ---------------------------------------------------------------------------------------

def _prose_pieces(text: str, kind: str, size: int, overlap: int) -> list[tuple[str | None, int, int, int]]:
    """(heading, overlap start, own start, end) of each chunk."""
    out: list[tuple[str | None, int, int, int]] = []
    for heading, lo, hi in _sections(text, setext=kind in ("text", "markdown")):
        atoms = [atom for paragraph in _spans(text, lo, hi, _PARAGRAPH)
                 for atom in _split(text, paragraph, _PROSE_SPLITS, size)]
        previous: Span | None = None
        for start, end in _pack(atoms, size):
            begin = _overlap_start(text, previous, start, overlap) if previous else start
            out.append((heading, begin, start, end))
            previous = (start, end)
    return out


def _sections(text: str, *, setext: bool) -> list[tuple[str | None, int, int]]:
    """(heading path, body start, body end) of the text before the first heading and of each heading."""
    lines = _lines(text)
    out: list[tuple[str | None, int, int]] = []
    path: list[tuple[int, str]] = []
    body_start, fenced, i = 0, False, 0
    while i < len(lines):
        lo, hi = lines[i]
        line = text[lo:hi]
        if _FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else _heading(text, lines, i, setext)
        if heading is None:
            i += 1
            continue
        level, title, taken = heading
        out.append((" > ".join(t for _, t in path) or None, body_start, lo))
        while path and path[-1][0] >= level:
            path.pop()
        path.append((level, title))
        i += taken
        body_start = lines[i - 1][1]
    out.append((" > ".join(t for _, t in path) or None, body_start, len(text)))
    return out


def _heading(text: str, lines: list[Span], i: int, setext: bool) -> tuple[int, str, int] | None:
    """(level, title, lines taken) when line i starts a heading."""
    line = text[lines[i][0]:lines[i][1]]
    if m := _ATX.fullmatch(line.rstrip()):
        title = re.sub(r"[ \t]+#+$", "", m.group(2))  # an optional closing run of #
        return len(m.group(1)), " ".join(title.split()), 1
    if not setext or i + 1 >= len(lines) or not line.strip() or len(line.strip()) > _SETEXT_MAX:
        return None
    underline = _SETEXT.fullmatch(text[lines[i + 1][0]:lines[i + 1][1]].rstrip())
    after_blank = i == 0 or not text[lines[i - 1][0]:lines[i - 1][1]].strip()
    if underline and len(underline.group(1)) >= 3 and after_blank:
        return (1 if underline.group(1)[0] == "=" else 2), " ".join(line.split()), 2
    return None


def _overlap_start(text: str, previous: Span, start: int, overlap: int) -> int:
    """Where this chunk's overlap begins: the earliest sentence start in the previous chunk within
    ``overlap`` characters of ``start``, or the earliest word start when sentences give less than half."""
    lo = max(previous[0], start - overlap)
    if lo >= previous[1]:
        return start
    begin = _first_boundary(text, previous, lo, _SENTENCE)
    if begin is None or start - begin < overlap // 2:
        begin = _first_boundary(text, previous, lo, _SPACE)
    return start if begin is None else begin


def _first_boundary(text: str, previous: Span, lo: int, separator: re.Pattern[str]) -> int | None:
    """The earliest start of a sentence (or word) of the previous chunk at or after ``lo``."""
    if previous[0] >= lo:
        return previous[0]
    for m in separator.finditer(text, previous[0], previous[1]):
        if lo <= m.end() < previous[1]:
            return m.end()
    return None


# --- code ----------------------------------------------------------------------------------------

def _code_pieces(text: str, size: int) -> list[tuple[str | None, int, int, int]]:
    """(heading, start, start, end) of each code chunk: small blocks packed together; a block over
    ``size`` is cut at blank lines, then lines, into chunks of its own."""
    groups: list[list[tuple[Span, str | None]]] = []
    whole = False  # whether the last group holds whole blocks, so the next small block may join it
    for heading, block in _code_blocks(text):
        pieces = [_with_indent(text, piece, size) for piece in _split(text, block, _CODE_SPLITS, size)]
        if len(pieces) == 1 and whole:
            groups[-1].append((pieces[0], heading))
        else:
            groups.append([(piece, heading) for piece in pieces])
        whole = len(pieces) == 1
    out: list[tuple[str | None, int, int, int]] = []
    for group in groups:
        enclosing = {lo: heading for (lo, _), heading in group}
        out.extend((_first_definition(text, start, end) or enclosing[start], start, start, end)
                   for start, end in _pack([span for span, _ in group], size))
    return out


def _code_blocks(text: str) -> list[tuple[str | None, Span]]:
    """(first definition, span) of each top-level block: a block starts at a column-0 line after a blank line."""
    lines = _lines(text)
    starts = [lo for i, (lo, hi) in enumerate(lines)
              if i == 0 or (not text[lines[i - 1][0]:lines[i - 1][1]].strip()
                            and _CODE_START.match(text, lo) and not _CODE_CONTINUES.match(text, lo))]
    bounds = [*starts, len(text)]
    blocks: list[tuple[str | None, Span]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        for span in _spans(text, lo, hi, None):
            blocks.append((_first_definition(text, *span), span))
    return blocks


def _with_indent(text: str, span: Span, size: int) -> Span:
    """A piece that starts a line moved back over the line's indentation, when it still fits."""
    line_start = text.rfind("\n", 0, span[0]) + 1
    if text[line_start:span[0]].strip(" \t") or span[1] - line_start > size:
        return span
    return line_start, span[1]


def _first_definition(text: str, lo: int, hi: int) -> str | None:
    """The first column-0 definition line in text[lo:hi], cut to 80 characters; an import line
    only when nothing else is defined there."""
    found = None
    for a, b in _lines(text, lo, hi):
        if (a == 0 or text[a - 1] == "\n") and _DEFINITION.match(text, a, min(b, a + _DEFINITION_SCAN)):
            line = text[a:b].rstrip()[:_HEADING_MAX]
            if not _IMPORT.match(line):
                return line
            found = found or line
    return found


# --- shared --------------------------------------------------------------------------------------

def _lines(text: str, lo: int = 0, hi: int | None = None) -> list[Span]:
    """Spans of the lines of text[lo:hi], without their newlines."""
    hi = len(text) if hi is None else hi
    out = []
    while lo < hi:
        end = text.find("\n", lo, hi)
        end = hi if end < 0 else end
        out.append((lo, end))
        lo = end + 1
    return out


def _spans(text: str, lo: int, hi: int, separator: re.Pattern[str] | None) -> list[Span]:
    """The pieces of text[lo:hi] between the separator's gaps, trimmed of whitespace; empty ones dropped."""
    out: list[Span] = []
    bounds = [(m.start(1), m.end(1)) for m in separator.finditer(text, lo, hi)] if separator else []
    for a, b in zip([lo, *(end for _, end in bounds)], [*(begin for begin, _ in bounds), hi]):
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if a < b:
            out.append((a, b))
    return out


def _split(text: str, span: Span, separators: tuple[re.Pattern[str], ...], size: int) -> list[Span]:
    """A span as pieces of at most ``size``: cut at the first separator, pieces still too long at the
    next, and hard at the end."""
    lo, hi = span
    if hi - lo <= size:
        return [span]
    if not separators:
        return [piece for a in range(lo, hi, size) for piece in _spans(text, a, min(a + size, hi), None)]
    return [piece for part in _spans(text, lo, hi, separators[0])
            for piece in _split(text, part, separators[1:], size)]


def _pack(atoms: list[Span], size: int) -> list[Span]:
    """Consecutive atoms joined greedily while the joined span stays within ``size``."""
    out: list[Span] = []
    for lo, hi in atoms:
        if out and hi - out[-1][0] <= size:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out
