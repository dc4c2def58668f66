"""Text out of an uploaded file (what the rag plugin indexes, and what ``POST /api/rag/extract``
and ``POST /api/chat/extract`` answer): ``extract(filename, data)``, and ``upload(body)`` for a
route that takes ``{"filename", "content_b64", "max_chars"}``.

- HTML, PDF and DOCX are read with beautifulsoup4, pypdf and python-docx (the rag extra:
  ``pip install 'localm[rag]'``); without them such a file is a 422 naming what to install.

- The kind comes from the extension; a file without a known one is sniffed (PDF magic, a
  zip holding ``word/document.xml``, a leading doctype or ``<html>``, else text if it is not
  binary).
- Structure survives as markdown: HTML and DOCX headings become ``#`` lines and blocks are
  separated by a blank line, so the chunker sees sections and paragraphs for every kind.
- Every refusal is a ``LocalmError`` naming only the file's base name, never a path.
  (A document's text is put in front of a model only through ``sdk.defang``.)
- What a file may unpack to is bounded before it is unpacked (413 ``document_too_large``,
  naming the limit): a DOCX's zip directory is checked (parts, sizes, packing ratio) and every
  part inflated once in bounded steps, so a directory that lies is caught before python-docx
  reads it; an HTML file's size before it is parsed; a PDF's page count, with pypdf's own
  stream limits; and the text any file gives. docs/rag.md lists the numbers.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import contextlib
import io
import re
import struct
import zipfile
import zlib
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
MB = 1024 * 1024
#: The longest text one file may give, in characters: as much as the largest text file indexed
#: (30 MB) can hold, so only a format that unpacks (DOCX, PDF) can reach it.
MAX_TEXT_CHARS = 32 * MB
#: A DOCX (a zip): at most this many parts, unpacking to at most this much in all; one XML part
#: at most MAX_XML_BYTES; a part over RATIO_FROM bytes may unpack to at most MAX_RATIO times its
#: packed size (real XML packs 5 to 20 times; a zip bomb a thousand).
MAX_ZIP_MEMBERS = 1000
MAX_ZIP_TOTAL = 256 * MB
MAX_XML_BYTES = 32 * MB
MAX_RATIO = 100
RATIO_FROM = 1 * MB
#: An HTML file is parsed (a tree in memory, several times its size) only up to this size.
MAX_HTML_BYTES = 16 * MB
#: A PDF's pages.
MAX_PDF_PAGES = 10_000
#: pypdf's own ceilings on what one stream may decompress to (its defaults are 75 MB and more).
PDF_STREAM_BYTES = 64 * MB
_INFLATE_STEP = 1 * MB
#: The most one zip directory entry may take (its fixed 46 bytes, a name, extra fields, a comment).
_MAX_ENTRY_BYTES = 1024

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


def extract(filename: str, data: bytes, *, max_bytes: int | None = None,
            max_chars: int = MAX_TEXT_CHARS) -> Extracted:
    """The text of ``data`` (the file called ``filename``); refuses with 413 over ``max_bytes``
    (``file_too_large``) or over a limit on what it unpacks to (``document_too_large``: the
    module's MAX_* limits, and ``max_chars`` of text), and 422 for a file that is binary,
    corrupt, encrypted or holds no text."""
    name = _base(filename)
    if max_bytes is not None and len(data) > max_bytes:
        raise sdk.LocalmError(413, f"{name}: {len(data)} bytes is over the limit of {max_bytes}",
                              code="file_too_large")
    kind = kind_of(name) or _sniff(name, data)
    try:
        text, sections = _READERS[kind](name, data, max_chars)
    except ImportError as exc:
        raise sdk.LocalmError(422, f"{name}: reading a {kind.upper()} file needs {exc.name or 'a package'}, "
                                   "which is not installed (pip install 'localm[rag]')",
                              code="extractor_missing") from None
    if len(text) > max_chars:
        raise too_large(name, f"its text is {len(text):,} characters", max_chars, "characters of text",
                        "text_chars")
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


def too_large(name: str, what: str, limit: int, unit: str, key: str) -> sdk.LocalmError:
    """The 413 for a document over one of the limits: ``what`` it is, and the limit by name."""
    return sdk.LocalmError(413, f"{name}: {what}, over the limit of {limit:,} {unit}", code="document_too_large",
                           limit=key, maximum=limit)


def _sniff(name: str, data: bytes) -> str:
    """The kind of a file whose extension says nothing, from its first bytes."""
    if data.startswith(b"%PDF-"):
        return "pdf"
    if data.startswith(b"PK\x03\x04"):
        _directory_guard(name, data)
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


def _read_text(name: str, data: bytes, max_chars: int) -> tuple[str, int]:
    return _decode(name, data), 0


_DROP = frozenset({"script", "style", "noscript", "template", "head", "title", "svg", "iframe", "object"})
_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_BLOCKS = frozenset({"p", "div", "li", "ul", "ol", "dl", "dt", "dd", "blockquote", "section", "article",
                     "aside", "header", "footer", "nav", "main", "figure", "figcaption", "caption", "table",
                     "thead", "tbody", "tfoot", "form", "fieldset", "address", "hr", "details", "summary",
                     "body", "html"})


def _read_html(name: str, data: bytes, max_chars: int) -> tuple[str, int]:
    """HTML as markdown-ish paragraphs; walked with a stack, so deep nesting cannot overflow.
    Parsed only up to MAX_HTML_BYTES (the tree takes several times the file's size)."""
    from bs4 import BeautifulSoup, NavigableString, Tag
    from bs4.element import PageElement, PreformattedString

    if len(data) > MAX_HTML_BYTES:
        raise too_large(name, f"an HTML file of {len(data):,} bytes", MAX_HTML_BYTES, "bytes for HTML",
                        "html_bytes")
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


def _read_pdf(name: str, data: bytes, max_chars: int) -> tuple[str, int]:
    """Each page's text, pages apart by a blank line; an encrypted PDF must open with no password.
    At most MAX_PDF_PAGES pages and ``max_chars`` of text, every stream under PDF_STREAM_BYTES."""
    try:
        with _pdf_limits():
            pages = _pdf_pages(name, data, max_chars)
    except sdk.LocalmError:
        raise
    except _pdf_limit_errors() as exc:
        raise too_large(name, f"a PDF stream unpacks past the limit ({exc})", PDF_STREAM_BYTES,
                        "bytes for one PDF stream", "pdf_stream_bytes") from None
    except Exception:
        raise _refuse(name, "not a readable PDF file") from None
    pages = [page for page in pages if page]
    if not pages:
        raise _refuse(name, "the PDF has no extractable text (a scanned PDF needs OCR first)")
    return "\n\n".join(pages), len(pages)


def _pdf_pages(name: str, data: bytes, max_chars: int) -> list[str]:
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted:
        try:
            opened = reader.decrypt("")
        except DependencyError:
            raise _refuse(name, "the PDF is AES-encrypted; reading it needs the cryptography package") from None
        if not opened:
            raise _refuse(name, "the PDF is encrypted with a password")
    count = len(reader.pages)
    if count > MAX_PDF_PAGES:
        raise too_large(name, f"a PDF of {count:,} pages", MAX_PDF_PAGES, "pages", "pdf_pages")
    pages: list[str] = []
    chars = 0
    for page in reader.pages:
        pages.append((page.extract_text() or "").strip())
        chars += len(pages[-1]) + 2
        if chars > max_chars:
            raise too_large(name, f"its text is over {max_chars:,} characters", max_chars, "characters of text",
                            "text_chars")
    return pages


_HEADING_STYLE = re.compile(r"heading ([1-9])", re.IGNORECASE)


def _read_docx(name: str, data: bytes, max_chars: int) -> tuple[str, int]:
    """Paragraphs and tables in body order; Title and Heading N styles become ``#`` headings.
    The zip is checked first (:func:`_check_zip`), so python-docx never unpacks a bomb."""
    import docx
    from docx.table import Table

    _check_zip(name, data)
    try:
        document = docx.Document(io.BytesIO(data))
        style_name = _docx_styles(document)
        blocks: list[str] = []
        chars = 0
        for item in document.iter_inner_content():
            if isinstance(item, Table):
                rows = [_docx_row(row) for row in item.rows]
                if rows := [row for row in rows if row.strip(" |")]:
                    blocks.append("\n".join(rows))
                    chars += len(blocks[-1]) + 2
            else:
                line = " ".join(item.text.split())
                if not line:
                    continue
                style = style_name(item)
                level = 1 if style == "Title" else int(m.group(1)) if (m := _HEADING_STYLE.fullmatch(style)) else 0
                blocks.append("#" * min(level, 6) + " " + line if level else line)
                chars += len(blocks[-1]) + 2
            if chars > max_chars:
                raise too_large(name, f"its text is over {max_chars:,} characters", max_chars,
                                "characters of text", "text_chars")
    except sdk.LocalmError:
        raise
    except Exception:
        raise _refuse(name, "not a readable DOCX file") from None
    return "\n\n".join(blocks), 0


_LOCAL_HEADER = struct.Struct("<4s5H3L2H")


_END = struct.Struct("<4s4H2LH")
_END64_LOCATOR = struct.Struct("<4sLQL")
_END64 = struct.Struct("<4sQ2H2L4Q")


def _directory_guard(name: str, data: bytes) -> None:
    """Refuse a zip whose directory alone is too large to read (more parts than MAX_ZIP_MEMBERS,
    or more bytes than so many entries take), from its end record, before zipfile reads it."""
    tail_start = max(0, len(data) - (_END.size + 0xFFFF))
    at = data.rfind(b"PK\x05\x06", tail_start)
    if at < 0 or at + _END.size > len(data):
        raise _refuse(name, "not a readable file (a damaged zip)")
    _, _, _, _, count, size, _, _ = _END.unpack_from(data, at)
    if (count == 0xFFFF or size == 0xFFFFFFFF) and at >= _END64_LOCATOR.size:
        sig, _, offset, _ = _END64_LOCATOR.unpack_from(data, at - _END64_LOCATOR.size)
        if sig == b"PK\x06\x07" and offset + _END64.size <= len(data):
            sig, *fields = _END64.unpack_from(data, offset)
            if sig == b"PK\x06\x06":
                count, size = fields[6], fields[7]
    if count > MAX_ZIP_MEMBERS or size > MAX_ZIP_MEMBERS * _MAX_ENTRY_BYTES:
        raise too_large(name, f"a zip of {count:,} parts in a directory of {size:,} bytes", MAX_ZIP_MEMBERS,
                        "parts", "zip_members")


def _check_zip(name: str, data: bytes) -> None:
    """Refuse a zip that would unpack to too much, from its directory first (how many parts,
    how large each and all of them say they are, how tightly each is packed), then by inflating
    every part once, in bounded steps, to make sure it is what the directory says (size and
    CRC): a part that unpacks past its declared size is refused as soon as it does. What
    python-docx then reads is bounded by the same directory (zipfile never reads past it)."""
    _directory_guard(name, data)
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except Exception:
        raise _refuse(name, "not a readable DOCX file (a damaged zip)") from None
    if len(infos) > MAX_ZIP_MEMBERS:
        raise too_large(name, f"a zip of {len(infos):,} parts", MAX_ZIP_MEMBERS, "parts", "zip_members")
    total = 0
    for info in infos:
        size = info.file_size
        if info.filename.lower().endswith((".xml", ".rels")) and size > MAX_XML_BYTES:
            raise too_large(name, f"{info.filename} unpacks to {size:,} bytes", MAX_XML_BYTES,
                            "bytes for one XML part", "xml_part_bytes")
        if size > RATIO_FROM and size > MAX_RATIO * max(1, info.compress_size):
            raise too_large(name, f"{info.filename} unpacks {size // max(1, info.compress_size):,} times its "
                                  f"packed size", MAX_RATIO, "times (the packing ratio of a part)", "zip_ratio")
        total += size
        if total > MAX_ZIP_TOTAL:
            raise too_large(name, f"its parts unpack to more than {MAX_ZIP_TOTAL:,} bytes", MAX_ZIP_TOTAL,
                            "bytes unpacked", "zip_unpacked_bytes")
    for info in infos:
        _inflate_bounded(name, data, info)


def _inflate_bounded(name: str, data: bytes, info: zipfile.ZipInfo) -> None:
    """Inflate one part of the zip in ``data`` to nowhere, never past the size its directory
    entry declares: 413 if it would go past, 422 if it does not match the entry."""
    if info.flag_bits & 0x1:
        raise _refuse(name, "the DOCX is encrypted")
    start = info.header_offset
    try:
        sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack_from(data, start)
    except struct.error:
        raise _refuse(name, "not a readable DOCX file (a damaged zip)") from None
    if sig != b"PK\x03\x04":
        raise _refuse(name, "not a readable DOCX file (a damaged zip)")
    begin = start + _LOCAL_HEADER.size + name_len + extra_len
    raw = memoryview(data)[begin:begin + info.compress_size]
    declared = info.file_size
    if info.compress_type == zipfile.ZIP_STORED:
        produced, crc = len(raw), zlib.crc32(raw)
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        produced, crc, pos = 0, 0, 0
        while not inflater.eof:
            if inflater.unconsumed_tail:
                piece: bytes | memoryview = inflater.unconsumed_tail
            else:
                piece = raw[pos:pos + _INFLATE_STEP]
                pos += len(piece)
            try:
                out = inflater.decompress(piece, _INFLATE_STEP)
            except zlib.error:
                raise _refuse(name, f"{info.filename} is damaged") from None
            if not out and not piece:
                break
            produced += len(out)
            if produced > declared:
                raise too_large(name, f"{info.filename} unpacks to more than the {declared:,} bytes its zip "
                                      "directory declares", declared, "bytes declared for it", "zip_declared_size")
            crc = zlib.crc32(out, crc)
    else:
        raise _refuse(name, f"{info.filename} is packed with a method a DOCX does not use")
    if produced != declared or crc != info.CRC:
        raise _refuse(name, f"{info.filename} does not match its zip directory entry (size or checksum)")


def _docx_styles(document: Any) -> Callable[[Any], str]:
    """A paragraph's style name, from a table of the document's paragraph styles read once
    (python-docx's ``paragraph.style`` searches every style for each paragraph: most of the
    time a large document took)."""
    from docx.enum.style import WD_STYLE_TYPE

    names: dict[str, str] = {}
    for style in document.styles:
        if style.type == WD_STYLE_TYPE.PARAGRAPH and style.style_id:
            names[style.style_id] = style.name or ""
    default = document.styles.default(WD_STYLE_TYPE.PARAGRAPH)
    fallback = (default.name or "") if default is not None else ""

    def name_of(paragraph: Any) -> str:
        style_id = paragraph._p.style
        return names.get(style_id, fallback) if style_id else fallback
    return name_of


def _docx_row(row: Any) -> str:
    """A table row as ``cell | cell``; a merged cell is listed once."""
    cells: list[str] = []
    seen: set[int] = set()
    for cell in row.cells:
        if id(cell._tc) not in seen:
            seen.add(id(cell._tc))
            cells.append(" ".join(cell.text.split()))
    return " | ".join(cells)


def _pdf_limits() -> Any:
    """A context in which pypdf decompresses no stream past PDF_STREAM_BYTES: pypdf 7's
    Configuration, applied to this context only; an older pypdf's module-wide ceilings,
    lowered (never raised)."""
    import dataclasses

    import pypdf

    apply = getattr(pypdf, "apply_configuration", None)
    if apply is not None:
        current = pypdf.get_configuration()
        fields = ("maximum_declared_stream_length", "array_based_stream_maximum_output_length",
                  "jbig2_maximum_output_length", "lzw_maximum_output_length", "run_length_maximum_output_length",
                  "zlib_maximum_output_length", "brotli_maximum_output_length", "image_maximum_buffer_size",
                  "stream_decoding_work_maximum_length")
        known = {f.name for f in dataclasses.fields(current)}
        return apply(**{f: min(getattr(current, f), PDF_STREAM_BYTES) for f in fields if f in known})
    from pypdf import filters

    for key in ("ZLIB_MAX_OUTPUT_LENGTH", "LZW_MAX_OUTPUT_LENGTH", "RUN_LENGTH_MAX_OUTPUT_LENGTH",
                "MAX_ARRAY_BASED_STREAM_OUTPUT_LENGTH", "MAX_DECLARED_STREAM_LENGTH", "JBIG2_MAX_OUTPUT_LENGTH"):
        value = getattr(filters, key, None)
        if isinstance(value, int) and value > PDF_STREAM_BYTES:
            setattr(filters, key, PDF_STREAM_BYTES)
    return contextlib.nullcontext()


def _pdf_limit_errors() -> tuple[type[BaseException], ...]:
    try:
        from pypdf.errors import LimitReachedError
    except ImportError:
        return ()
    return (LimitReachedError,)


_READERS: dict[str, Callable[[str, bytes, int], tuple[str, int]]] = {
    "text": _read_text, "markdown": _read_text, "code": _read_text,
    "html": _read_html, "pdf": _read_pdf, "docx": _read_docx,
}


#: The largest file an upload may hold, decoded.
MAX_UPLOAD_BYTES = 30 * MB
MAX_FILENAME_CHARS = 255


def decode(item: Any, where: str = "") -> tuple[str, bytes]:
    """One uploaded file, ``{"filename", "content_b64"}``: its base name and bytes (400
    ``invalid_parameter`` for a missing or bad field, 400 ``invalid_base64``, 413
    ``file_too_large`` over 30 MB, told from the base64's length before it is decoded).
    ``where`` names the item in a refusal (``files[2]``)."""
    at = f"{where}." if where else ""
    if not isinstance(item, dict) or not isinstance(item.get("filename"), str) or not item["filename"].strip() \
            or not isinstance(item.get("content_b64"), str):
        raise sdk.LocalmError(400, f"{where or 'The body'} must be {{\"filename\": str, \"content_b64\": str}}",
                              code="invalid_parameter")
    name = item["filename"].replace("\\", "/").rsplit("/", 1)[-1].strip()
    if not name or len(name) > MAX_FILENAME_CHARS or any(ord(c) < 32 or c == "\x7f" for c in name):
        raise sdk.LocalmError(400, f"{at}filename must be a file name of 1 to {MAX_FILENAME_CHARS} printable "
                                   "characters", code="invalid_parameter")
    encoded = item["content_b64"]
    if len(encoded) * 3 // 4 > MAX_UPLOAD_BYTES + 2:
        raise sdk.LocalmError(413, f"{name} is over 30 MB", code="file_too_large")
    try:
        data = base64.b64decode("".join(encoded.split()), validate=True)
    except (binascii.Error, ValueError):
        raise sdk.LocalmError(400, f"{name}: content_b64 is not valid base64", code="invalid_base64") from None
    if len(data) > MAX_UPLOAD_BYTES:
        raise sdk.LocalmError(413, f"{name} is over 30 MB", code="file_too_large")
    return name, data


def upload(body: Any) -> dict[str, Any]:
    """``{"filename", "content_b64", "max_chars"}`` → ``{"filename", "text", "chars",
    "truncated"}``: the file decoded (see ``decode``), its text (see ``extract``), cut to
    ``max_chars`` (clamped to 500..200,000; left out: the whole text). Blocking: call it in a
    worker thread."""
    limit = body.get("max_chars") if isinstance(body, dict) else None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise sdk.LocalmError(400, "max_chars must be an integer", code="invalid_parameter")
    name, data = decode(body)
    text = extract(name, data, max_bytes=MAX_UPLOAD_BYTES).text
    truncated = False
    if limit is not None:
        limit = max(500, min(200_000, limit))
        truncated = len(text) > limit
        text = text[:limit]
    return {"filename": name, "text": text, "chars": len(text), "truncated": truncated}
