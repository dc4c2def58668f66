"""The rag plugin's extraction (every kind, refusals, encodings, defang) and chunking, on real files.

The two modules are imported by the plugin's package name (the package imports chromadb only
when a store opens), so these tests need no vector store; no model runs.
"""

from __future__ import annotations

import io
import random
import re
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import rag_files
from localm.sdk import defang
from localm.sdk.testing import plugin_module



def _load(name: str) -> ModuleType:
    return plugin_module("rag", f"rag.{name}")


from localm.sdk import extract  # noqa: E402 - the readers rag indexes with
chunking = _load("chunking")

KINDS = {"notes.txt": "text", "guide.md": "markdown", "page.html": "html", "report.pdf": "pdf",
         "memo.docx": "docx", "tool.py": "code"}


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return rag_files.write_samples(tmp_path_factory.mktemp("samples"))


def flat(text: str) -> str:
    return " ".join(text.split())


def refusal(filename: str, data: bytes, **kw: Any) -> Any:
    with pytest.raises(Exception) as caught:
        extract.extract(filename, data, **kw)
    assert type(caught.value).__name__ == "LocalmError"
    return caught.value


# --- extraction ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_extracts_its_facts(samples: dict[str, Path], name: str) -> None:
    out = extract.extract(name, samples[name].read_bytes())
    assert out.kind == KINDS[name]
    assert len(out.text) >= 800
    for fact in rag_files.FACTS[name]:
        assert fact in flat(out.text), fact


def test_html_drops_script_style_and_keeps_structure(samples: dict[str, Path]) -> None:
    text = extract.extract("page.html", samples["page.html"].read_bytes()).text
    for hidden in ("SCRIPT-SHOULD-NOT-APPEAR", "console.log", "hidden-style-marker", "NOSCRIPT-SHOULD-NOT-APPEAR"):
        assert hidden not in text
    lines = text.split("\n")
    assert "# A short history of the bicycle" in lines
    assert "## The safety bicycle" in lines
    assert "### Milestones" in lines
    assert "\n\n- 1885: the Rover safety bicycle with chain drive\n\n" in text
    # whitespace collapsed inside a paragraph, inline tags joined
    assert "running machine built by Karl Drais in Mannheim in 1817." in text


def test_html_tables_pre_and_sniffing() -> None:
    page = (b"<!DOCTYPE html><html><body><p>Intro <i>text</i></p><table><tr><th>Name</th><td>Value</td></tr>"
            b"<tr><td>alpha</td><td>1</td></tr></table><pre>  x = 1\n  y = 2</pre></body></html>")
    out = extract.extract("page-without-extension", page)
    assert out.kind == "html"
    assert out.text == "Intro text\n\nName | Value\n\nalpha | 1\n\n  x = 1\n  y = 2"


def test_docx_headings_become_markdown(samples: dict[str, Path]) -> None:
    out = extract.extract("memo.docx", samples["memo.docx"].read_bytes())
    lines = out.text.split("\n")
    assert lines[0] == "# Honeybee Colony Memo"  # the Title style
    assert "# Colony structure" in lines and "# Winter survival" in lines
    assert "## Hive inspection results" in lines
    assert "Hive | Frames of brood | Queen seen\nHIVE-A3 | 8 | yes\nHIVE-B7 | 0 | no" in out.text
    assert out.sections == 4


def test_pdf_pages_in_order(samples: dict[str, Path]) -> None:
    out = extract.extract("report.pdf", samples["report.pdf"].read_bytes())
    assert out.sections == 2
    one, two = out.text.split("\n\n")
    assert "page one: the starter" in one and "Levain Number 9" in flat(one)
    assert "page two: shaping and baking" in two and "Dutch oven" in flat(two)


def test_markdown_and_code_kept_verbatim(samples: dict[str, Path]) -> None:
    assert extract.extract("guide.md", samples["guide.md"].read_bytes()).text == rag_files.GUIDE_MD.strip()
    code = extract.extract("tool.py", samples["tool.py"].read_bytes())
    assert code.text == rag_files.TOOL_PY.rstrip() and code.sections == 0


def test_files_without_extension_are_sniffed(samples: dict[str, Path]) -> None:
    assert extract.extract("report", samples["report.pdf"].read_bytes()).kind == "pdf"
    assert extract.extract("memo", samples["memo.docx"].read_bytes()).kind == "docx"
    assert extract.extract("page", samples["page.html"].read_bytes()).kind == "html"
    assert extract.extract("notes", samples["notes.txt"].read_bytes()).kind == "text"


def test_kind_of_and_supported() -> None:
    assert extract.kind_of("Notes.TXT") == "text"
    assert extract.kind_of("/some/dir/guide.md") == "markdown"
    assert extract.kind_of("lib.RS") == "code"
    assert extract.kind_of("archive.tar.gz") is None and extract.kind_of("Makefile") is None
    assert set(extract.SUPPORTED.values()) == set(KINDS.values())


def _png() -> bytes:
    return b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + random.Random(1).randbytes(600)


def _zip() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("data.bin", random.Random(2).randbytes(300))
    return out.getvalue()


@pytest.mark.parametrize(("name", "data"), [
    ("blob.bin", random.Random(0).randbytes(3000)),
    ("photo.png", _png()),
    ("photo", _png()),
    ("notes.txt", b"looks like text\x00\x01\x02 but is not"),
    ("bundle.zip", _zip()),
    ("broken.pdf", b"%PDF-1.4\nthis is not a real pdf"),
    ("broken.docx", b"PK\x03\x04 not a real docx"),
    ("empty.txt", b""),
    ("blank.md", b" \n\n \t\n"),
])
def test_unreadable_files_are_refused_with_the_name_only(tmp_path: Path, name: str, data: bytes) -> None:
    error = refusal(str(tmp_path / name), data)
    assert (error.status, error.code) == (422, "extract_failed")
    assert error.detail.startswith(f"{name}: ")
    assert str(tmp_path) not in error.detail


def test_pdf_without_text_is_refused() -> None:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    error = refusal("scan.pdf", bytes(pdf.output()))
    assert error.status == 422 and "no extractable text" in error.detail


def test_encrypted_pdf(samples: dict[str, Path]) -> None:
    from pypdf import PdfReader, PdfWriter

    def encrypted(user_password: str) -> bytes:
        writer = PdfWriter(clone_from=PdfReader(samples["report.pdf"]))
        writer.encrypt(user_password=user_password, owner_password="owner", algorithm="RC4-128")
        out = io.BytesIO()
        writer.write(out)
        return out.getvalue()

    error = refusal("locked.pdf", encrypted("s3cret"))
    assert error.status == 422 and "encrypted" in error.detail
    # only an owner password (permissions): opens with the empty user password
    assert "Levain Number 9" in flat(extract.extract("open.pdf", encrypted("")).text)


def test_max_bytes() -> None:
    data = b"x" * 100
    error = refusal("big.txt", data, max_bytes=99)
    assert error.status == 413 and error.detail.startswith("big.txt: ")
    assert extract.extract("big.txt", data, max_bytes=100).text == "x" * 100


@pytest.mark.parametrize(("text", "encoding"), [
    ("Le café crème et la tarte brûlée, à Noël, déjà vus par un élève naïf.\n", "latin-1"),
    ("Die Straße in München ist schön und grün. Über alles.\n", "latin-1"),
    ("Grüße aus Köln — und 東京 — in UTF-16.\n", "utf-16"),  # Python writes the BOM
    ("Ünïcödé with a UTF-8 BOM\n", "utf-8-sig"),
    ("Привет, это текст в кодировке Windows-1251, и его надо прочитать правильно.\n", "cp1251"),
])
def test_text_encodings(text: str, encoding: str) -> None:
    assert extract.extract("letter.txt", text.encode(encoding)).text == text.strip()


# --- defang --------------------------------------------------------------------------------------

TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
          "<|system|>", "<|channel|>", "<｜Assistant｜>", "<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>",
          "<start_of_turn>", "<end_of_turn>", "<think>", "</think>", "<tool_call>", "</tool_call>",
          "<tool_response>", "[SYSTEM_PROMPT]"]


@pytest.mark.parametrize("token", TOKENS)
def test_defang_respells_chat_tokens(token: str) -> None:
    out = defang(f"before {token}after")
    assert token not in out
    assert not re.search(r"[<>\[\]|｜]", out)
    name = token.strip("<>[]/|｜")
    assert out.startswith("before ‹") and name in out


def test_defang_removes_invisible_characters() -> None:
    text = "a\x00b\x07c\x1bd\x7fe\u200bf\u200dg\u202eh\u2066i\ufeffj\U000e0041k\ue000l\r\nm\rn\to\x0cp"
    assert defang(text) == "abcdefghijkl\nm\nn\to\np"
    # a token hidden by zero-width characters is still caught
    assert defang("<|im_\u200bstart|>") == "‹im_start›"


def test_defang_role_lines() -> None:
    out = defang("System:\n### Assistant:\n  user :\n### Instruction:\nResponse:\nThe system: is fine.")
    assert out == "‹System›:\n### ‹Assistant›:\n  ‹user› :\n### ‹Instruction›:\nResponse:\nThe system: is fine."


def test_defang_leaves_ordinary_text_alone(samples: dict[str, Path]) -> None:
    prose = ("Install\n\n## Linux\n\nRun `a < b && c | d > e`, see List<String> and [1] or [link](x).\n"
             "User: click OK. The assistant said: fine.\n\tIndented, with “quotes” — and émojis 👩‍💻.\n")
    assert defang(prose) == prose.replace("\u200d", "")  # the ZWJ is format, removed
    for name in ("notes.txt", "guide.md", "tool.py"):
        text = extract.extract(name, samples[name].read_bytes()).text
        assert defang(text) == text


def test_defang_is_idempotent() -> None:
    nasty = "<|<|im_start|>|> [[INST]] <<<SYS>>> <</s>s> \u202e<|x\u200b|>\nsystem:\n" + "".join(TOKENS)
    once = defang(nasty)
    assert defang(once) == once
    assert "<|" not in once and "[INST]" not in once


# --- chunking ------------------------------------------------------------------------------------

def spans(source: str, chunks: list[Any]) -> list[tuple[int, int]]:
    """Each chunk's (text start, end) in the source, checking that its text is a slice of the source
    whose own part begins at ``start``."""
    out = []
    for i, c in enumerate(chunks):
        assert c.index == i and c.text.strip() and c.text == c.text.rstrip()
        lo = source.find(c.text, max(0, c.start - len(c.text)))
        assert 0 <= lo <= c.start < lo + len(c.text)
        out.append((lo, lo + len(c.text)))
    return out


SECTION_WORDS = ("tide", "bread", "orbit", "cedar")


def long_markdown() -> str:
    """Two top-level sections with subsections, each many sentences of its own vocabulary."""
    rng = random.Random(7)
    parts = []
    for top in ("Alpha", "Beta"):
        parts.append(f"# {top}\n")
        for sub in ("Install", "Usage"):
            parts.append(f"## {sub}\n")
            for _ in range(4):
                word = f"{top.lower()}{sub.lower()}"
                sentences = [f"The {word} {rng.choice(SECTION_WORDS)} number {rng.randint(1, 999)} is noted here."
                             for _ in range(rng.randint(2, 6))]
                parts.append(" ".join(sentences) + "\n")
    return "\n".join(parts)


def test_chunks_follow_headings() -> None:
    source = long_markdown()
    chunks = chunking.chunk(source, "markdown", size=300, overlap=60)
    spans(source, chunks)
    paths = {c.heading for c in chunks}
    assert paths == {"Alpha > Install", "Alpha > Usage", "Beta > Install", "Beta > Usage"}
    for c in chunks:
        assert "#" not in c.text  # heading lines are never chunk text
        top, sub = c.heading.split(" > ")
        words = set(re.findall(r"\b(?:alpha|beta)(?:install|usage)\b", c.text))
        assert words == {f"{top.lower()}{sub.lower()}"}  # never two sections in one chunk


def test_heading_paths_of_the_sample_guide(samples: dict[str, Path]) -> None:
    source = extract.extract("guide.md", samples["guide.md"].read_bytes()).text
    chunks = chunking.chunk(source, "markdown")
    assert [c.heading for c in chunks] == [
        "Orion-7 Deployment Runbook", "Orion-7 Deployment Runbook > Prerequisites",
        "Orion-7 Deployment Runbook > Rollout > Canary stage", "Orion-7 Deployment Runbook > Rollout > Fleet stage",
        "Orion-7 Deployment Runbook > Troubleshooting > ERR-4471: certificate pinning mismatch",
        "Orion-7 Deployment Runbook > Troubleshooting > ERR-5102: quorum lost"]
    assert "orionctl pins refresh" in chunks[4].text


def test_setext_headings_fences_and_preamble() -> None:
    text = "Preface line.\n\nInstall\n=======\n\nGet it.\n\nLinux\n-----\n\nUse apt.\n"
    assert [(c.heading, c.text) for c in chunking.chunk(text, "text")] == [
        (None, "Preface line."), ("Install", "Get it."), ("Install > Linux", "Use apt.")]
    fenced = "# Build\n\n```sh\n# not a heading\nmake\n```\n"
    assert [(c.heading, c.text) for c in chunking.chunk(fenced, "markdown")] == [
        ("Build", "```sh\n# not a heading\nmake\n```")]
    # setext underlines only count in text and markdown
    assert [c.heading for c in chunking.chunk("Install\n=======\n\nGet it.", "pdf")] == [None]


def test_sizes_and_overlap() -> None:
    """Bound: a chunk's own text is at most ``size``, its whole text at most ``size + overlap``."""
    source = long_markdown()
    size, overlap = 300, 60
    chunks = chunking.chunk(source, "markdown", size=size, overlap=overlap)
    bounds = spans(source, chunks)
    assert len(chunks) > 8
    overlapped = 0
    for (lo, end), c, previous in zip(bounds, chunks, [None, *chunks]):
        assert end - c.start <= size and len(c.text) <= size + overlap
        if previous is None or previous.heading != c.heading:
            assert lo == c.start  # a section's first chunk has no overlap
            continue
        assert previous.start <= lo < c.start  # the overlap comes from the previous chunk
        assert lo == previous.start or source[lo - 1].isspace()  # whole words
        assert previous.text.endswith(source[lo:c.start].rstrip())
        overlapped += 1
    assert overlapped >= 4


def test_long_paragraph_splits_at_sentences() -> None:
    sentences = [f"Sentence number {i} talks about honeybees and their {i * 7} foragers." for i in range(30)]
    source = " ".join(sentences)
    chunks = chunking.chunk(source, "text", size=250, overlap=80)
    for (lo, end), c in zip(spans(source, chunks), chunks):
        own = source[c.start:end]
        assert own.startswith("Sentence number ") and own.endswith("foragers.")
        assert source[lo:].startswith("Sentence number ")  # overlap of whole sentences here
    assert "".join(source[c.start:e] + " " for c, (_, e) in zip(chunks, spans(source, chunks))).strip() == source


def test_words_and_hard_cuts() -> None:
    words = " ".join(f"word{i}" for i in range(400))  # no sentence end
    chunks = chunking.chunk(words, "text", size=200, overlap=30)
    for (_, end), c in zip(spans(words, chunks), chunks):
        own = words[c.start:end]
        assert end - c.start <= 200 and own.startswith("word") and (end == len(words) or words[end] == " ")
    blob = "x" * 2500
    assert [len(c.text) for c in chunking.chunk(blob, "text", size=1000, overlap=0)] == [1000, 1000, 500]


CODE = '''\
import os
import sys


def first(a):
    """One."""
    return a + 1


def second(b):
    return b * 2


@decorated
def third(c):
    if c:
        return c
    else:
        return -c


class Big:
    """A class too long for one chunk."""

    def method_one(self):
        return "one one one one one one one one one one one one one one one one one one one"

    def method_two(self):
        return "two two two two two two two two two two two two two two two two two two two"

    def method_three(self):
        return "three three three three three three three three three three three three three"


if __name__ == "__main__":
    main()
'''


def test_code_splits_at_definitions() -> None:
    chunks = chunking.chunk(CODE, "code", size=180, overlap=50)
    for c in chunks:
        assert CODE[c.start:c.start + len(c.text)] == c.text  # no overlap for code
        assert len(c.text) <= 180
        assert c.start == 0 or CODE[c.start - 1] == "\n"  # whole lines, indentation kept
        if not c.text[0].isspace():
            assert c.start == 0 or CODE[c.start - 2:c.start] == "\n\n"  # top level: after a blank line
    # small blocks pack together; @decorated stays with its def; a long class is cut between its
    # methods and the continuation keeps the class as its heading; no definition, no heading
    assert [c.heading for c in chunks] == ["def first(a):", "def third(c):", "class Big:", "class Big:",
                                           "class Big:", None]
    assert chunks[0].text.endswith("def second(b):\n    return b * 2")
    assert chunks[1].text.startswith("@decorated\ndef third(c):") and chunks[1].text.endswith("return -c")
    assert chunks[3].text.startswith("    def method_two(self):")
    assert [c.heading for c in chunking.chunk(CODE, "code", size=2000)] == ["def first(a):"]
    assert [c.heading for c in chunking.chunk("import os\nimport sys\n", "code")] == ["import os"]


def test_code_heading_is_cut() -> None:
    line = "def " + "x" * 200 + "():\n    pass\n"
    (only,) = chunking.chunk(line, "code")
    assert only.heading == line[:80]


@pytest.mark.parametrize("name", list(KINDS))
def test_chunking_the_samples(samples: dict[str, Path], name: str) -> None:
    out = extract.extract(name, samples[name].read_bytes())
    chunks = chunking.chunk(out.text, out.kind, size=300, overlap=60)
    spans(out.text, chunks)
    assert chunks and all(len(c.text) <= 360 for c in chunks)
    assert chunking.chunk(out.text, out.kind, size=300, overlap=60) == chunks  # deterministic
    searchable = flat(" ".join(f"{c.heading} {c.text}" for c in chunks))
    assert all(fact in searchable for fact in rag_files.FACTS[name] if fact != "Honeybee Colony Memo")


def test_chunk_arguments() -> None:
    assert chunking.chunk("", "text") == [] and chunking.chunk("\n\n  \n", "markdown") == []
    assert chunking.chunk("# Only a heading", "markdown") == []
    for bad in ({"size": 0}, {"size": 100, "overlap": 100}, {"overlap": -1}):
        with pytest.raises(ValueError):
            chunking.chunk("text", "text", **bad)
    with pytest.raises(ValueError):
        chunking.chunk("text", "spreadsheet")
