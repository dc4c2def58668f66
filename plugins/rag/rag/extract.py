"""Text out of an uploaded file, and that text made safe to quote in a prompt.

- The kind comes from the extension; a file without a known one is sniffed (PDF magic, a
  zip holding ``word/document.xml``, a leading doctype or ``<html>``, else text if it is not
  binary).
- Structure survives as markdown: HTML and DOCX headings become ``#`` lines and blocks are
  separated by a blank line, so the chunker sees sections and paragraphs for every kind.
- Every refusal is a ``LocalmError`` naming only the file's base name, never a path.
  (A document's text is put in front of a model only through ``sdk.defang``.)
"""

from __future__ import annotations

import codecs
import io
import re
import zipfile
from typing import Any, Callable

import attrs

from localm import sdk

_CODE = (".py .js .ts .tsx .jsx .java .c .h .cpp .hpp .cc .go .rs .rb .php .cs .swift .kt .scala .sh "
         ".bash .sql .r .lua .pl .m .yaml .yml .toml .json .ini .cfg .css .scss")

#: Extension (lower case, with the dot) → kind.
SUPPORTED: dict[str, str] = {
    ".txt": "text", ".text": "text", ".log": "text", ".csv": "text", ".tsv": "text", ".rst": "text",
    ".md": "markdown", ".markdown": "markdown", ".mdx": "markdown",
    ".html": "html", ".htm": "html", ".xhtml": "html",
    ".pdf": "pdf",
    ".docx": "docx",
    **{ext: "code" for ext in _CODE.split()},
}

#: Share of control characters above which decoded "text" is taken for binary.
_CONTROL_LIMIT = 0.01
_CONTROLS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")
#: The non-ASCII characters of Western European text in Windows-1252; at most _WESTERN_SHARE of its letters.
_WESTERN = frozenset("ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÐÑÒÓÔÕÖØÙÚÛÜÝÞßàáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿŒœŠšŽžŸ"
                     "\xa0¡¿«»“”‘’„‚–—…•·€£¥¢©®°±§¶ªº½¼¾")
_WESTERN_SHARE = 0.3
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_LETTER = re.compile(r"[^\W\d_]")
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_HTML_START = re.compile(rb"\s*(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html)[\s>]", re.IGNORECASE | re.DOTALL)
_HEADING_LINE = re.compile(r"^#{1,6}[ \t]+\S", re.MULTILINE)


@attrs.frozen
class Extracted:
    """A file's text; ``sections`` is its page count for a PDF, else its markdown headings (0 for code)."""

    text: str
    kind: str
    sections: int


def kind_of(filename: str) -> str | None:
    """The kind an extension promises, or None when the extension is unknown or missing."""
    name = _base(filename)
    dot = name.rfind(".")
    return SUPPORTED.get(name[dot:].lower()) if dot > 0 else None


def extract(filename: str, data: bytes, *, max_bytes: int | None = None) -> Extracted:
    """The text of ``data`` (the file called ``filename``); refuses with 413 over ``max_bytes``
    and 422 for a file that is binary, corrupt, encrypted or holds no text."""
    name = _base(filename)
    if max_bytes is not None and len(data) > max_bytes:
        raise sdk.LocalmError(413, f"{name}: {len(data)} bytes is over the limit of {max_bytes}",
                              code="file_too_large")
    kind = kind_of(name) or _sniff(name, data)
    text, sections = _READERS[kind](name, data)
    text = _tidy(text, keep_indent=kind == "code")
    if not text.strip():
        raise _refuse(name, "no text found in the file")
    if kind != "pdf":
        sections = len(_HEADING_LINE.findall(text)) if kind != "code" else 0
    return Extracted(text=text, kind=kind, sections=sections)


def _base(filename: str) -> str:
    """The last component of a name, so no folder of the caller's ever reaches a message."""
    return filename.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _refuse(name: str, why: str) -> sdk.LocalmError:
    return sdk.LocalmError(422, f"{name}: {why}", code="extract_failed")


def _sniff(name: str, data: bytes) -> str:
    """The kind of a file whose extension says nothing, from its first bytes."""
    if data.startswith(b"%PDF-"):
        return "pdf"
    if data.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                if "word/document.xml" in archive.namelist():
                    return "docx"
        except (zipfile.BadZipFile, OSError):
            pass
        raise _refuse(name, "unsupported file type (a zip archive)")
    if _HTML_START.match(data[:1024].removeprefix(codecs.BOM_UTF8)):
        return "html"
    return "text"  # the text reader refuses binary


def _decode(name: str, data: bytes) -> str:
    """Bytes as text: a BOM decides, then UTF-8, then Western European Windows-1252, then
    charset-normalizer's best guess; binary is refused."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            try:
                return _not_binary(name, data.decode(codec))
            except UnicodeDecodeError:
                raise _refuse(name, f"not valid {codec.split('-sig')[0].upper()} text") from None
    if b"\x00" in data:
        raise _refuse(name, "unsupported binary file")
    try:
        return _not_binary(name, data.decode("utf-8"))
    except UnicodeDecodeError:
        pass
    if (western := _as_western(data)) is not None:
        return _not_binary(name, western)
    import charset_normalizer

    matches = charset_normalizer.from_bytes(data)
    if (best := matches.best()) is None:
        raise _refuse(name, "unsupported binary file")
    # as clean a reading in a Windows code page beats a Mac or DOS one: those are rare in files today
    windows = [m for m in matches if m.encoding.startswith("cp125") and m.chaos <= best.chaos]
    return _not_binary(name, str(windows[0] if windows else best))


def _as_western(data: bytes) -> str | None:
    """The bytes as Windows-1252 (a superset of Latin-1's letters) when that reads as Western
    European text: few accented letters among ASCII ones and no stray symbols. charset-normalizer
    alone often takes short French or German text for a Central European code page."""
    try:
        text = data.decode("cp1252")
    except UnicodeDecodeError:
        return None
    foreign = _NON_ASCII.findall(text)
    if set(foreign) <= _WESTERN and len(foreign) <= _WESTERN_SHARE * len(_LETTER.findall(text)):
        return text
    return None


def _not_binary(name: str, text: str) -> str:
    if "\x00" in text or len(_CONTROLS.findall(text)) > _CONTROL_LIMIT * len(text):
        raise _refuse(name, "unsupported binary file")
    return text


def _tidy(text: str, *, keep_indent: bool) -> str:
    """Unix line ends, no NUL, no surrounding blank space (leading indentation kept for code)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    return text.strip("\n").rstrip() if keep_indent else text.strip()


def _read_text(name: str, data: bytes) -> tuple[str, int]:
    return _decode(name, data), 0


_DROP = frozenset({"script", "style", "noscript", "template", "head", "title", "svg", "iframe", "object"})
_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_BLOCKS = frozenset({"p", "div", "li", "ul", "ol", "dl", "dt", "dd", "blockquote", "section", "article",
                     "aside", "header", "footer", "nav", "main", "figure", "figcaption", "caption", "table",
                     "thead", "tbody", "tfoot", "form", "fieldset", "address", "hr", "details", "summary",
                     "body", "html"})


def _read_html(name: str, data: bytes) -> tuple[str, int]:
    """HTML as markdown-ish paragraphs; walked with a stack, so deep nesting cannot overflow."""
    from bs4 import BeautifulSoup, NavigableString, Tag
    from bs4.element import PageElement, PreformattedString

    if data.find(b"\x00") >= 0 and not data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise _refuse(name, "unsupported binary file")
    soup = BeautifulSoup(data, "html.parser")
    blocks: list[str] = []
    words: list[str] = []
    prefix = ""

    def flush() -> None:
        nonlocal prefix
        if line := " ".join("".join(words).split()):
            blocks.append(prefix + line)
            prefix = ""
        words.clear()

    stack: list[tuple[PageElement, bool]] = [(soup, False)]
    while stack:
        node, leaving = stack.pop()
        if leaving:
            flush()
            prefix = ""
        elif isinstance(node, NavigableString):
            if not isinstance(node, PreformattedString):  # comments, doctype, CDATA
                words.append(str(node))
        elif isinstance(node, Tag) and node.name not in _DROP:
            if node.name == "br":
                words.append("\n")
            elif node.name in _HEADINGS:
                flush()
                title = " ".join(node.get_text(" ").split())
                if title:
                    blocks.append("#" * _HEADINGS[node.name] + " " + title)
            elif node.name == "pre":
                flush()
                if code := node.get_text().strip("\n").rstrip():
                    blocks.append(code)
            elif node.name == "tr":
                flush()
                cells = [" ".join(c.get_text(" ").split()) for c in node.find_all(["td", "th"], recursive=False)]
                if any(cells):
                    blocks.append(" | ".join(cells))
            else:
                if node.name in _BLOCKS:
                    flush()
                    if node.name == "li":
                        prefix = "- "
                    stack.append((node, True))
                stack.extend((child, False) for child in reversed(node.contents))
    flush()
    return "\n\n".join(blocks), 0


def _read_pdf(name: str, data: bytes) -> tuple[str, int]:
    """Each page's text, pages apart by a blank line; an encrypted PDF must open with no password."""
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")
            except DependencyError:
                raise _refuse(name, "the PDF is AES-encrypted; reading it needs the cryptography package") from None
            if not opened:
                raise _refuse(name, "the PDF is encrypted with a password")
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
    except sdk.LocalmError:
        raise
    except Exception:
        raise _refuse(name, "not a readable PDF file") from None
    pages = [page for page in pages if page]
    if not pages:
        raise _refuse(name, "the PDF has no extractable text (a scanned PDF needs OCR first)")
    return "\n\n".join(pages), len(pages)


_HEADING_STYLE = re.compile(r"heading ([1-9])", re.IGNORECASE)


def _read_docx(name: str, data: bytes) -> tuple[str, int]:
    """Paragraphs and tables in body order; Title and Heading N styles become ``#`` headings."""
    import docx
    from docx.table import Table

    try:
        document = docx.Document(io.BytesIO(data))
        blocks: list[str] = []
        for item in document.iter_inner_content():
            if isinstance(item, Table):
                rows = [_docx_row(row) for row in item.rows]
                if rows := [row for row in rows if row.strip(" |")]:
                    blocks.append("\n".join(rows))
                continue
            line = " ".join(item.text.split())
            if not line:
                continue
            style = item.style.name if item.style is not None else ""
            level = 1 if style == "Title" else int(m.group(1)) if (m := _HEADING_STYLE.fullmatch(style)) else 0
            blocks.append("#" * min(level, 6) + " " + line if level else line)
    except Exception:
        raise _refuse(name, "not a readable DOCX file") from None
    return "\n\n".join(blocks), 0


def _docx_row(row: Any) -> str:
    """A table row as ``cell | cell``; a merged cell is listed once."""
    cells: list[str] = []
    seen: set[int] = set()
    for cell in row.cells:
        if id(cell._tc) not in seen:
            seen.add(id(cell._tc))
            cells.append(" ".join(cell.text.split()))
    return " | ".join(cells)


_READERS: dict[str, Callable[[str, bytes], tuple[str, int]]] = {
    "text": _read_text, "markdown": _read_text, "code": _read_text,
    "html": _read_html, "pdf": _read_pdf, "docx": _read_docx,
}
