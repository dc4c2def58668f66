"""POST /api/chat/extract: a chat attachment's text, served by the chat plugin (scope chat),
the same request and answer as the rag plugin's /api/rag/extract, on a real server without
the rag plugin."""

from __future__ import annotations

import base64
import io
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import offline_cli


@pytest.fixture(scope="module")
def served(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    data_dir = tmp_path_factory.mktemp("extract") / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    s = module_server(data_dir=data_dir, plugins=["chat"])
    chat = s.client(owner).post("/v1/keys", json={"name": "chat", "scopes": ["chat"]}).json()["key"]
    other = s.client(owner).post("/v1/keys", json={"name": "reader", "scopes": ["config:read"]}).json()["key"]
    return s, chat, other


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_a_text_file_and_a_pdf(served: Any) -> None:
    s, chat, _ = served
    c = s.client(chat)
    r = c.post("/api/chat/extract", json={"filename": "notes.md", "content_b64": b64(b"# Notes\n\nBuy milk.\n")})
    assert r.status_code == 200
    assert r.json() == {"filename": "notes.md", "text": "# Notes\n\nBuy milk.", "chars": 18, "truncated": False}
    fpdf = pytest.importorskip("fpdf")
    pdf = fpdf.FPDF()
    pdf.add_page()
    pdf.set_font("helvetica", size=12)
    pdf.cell(text="The quarterly report says revenue grew.")
    out = c.post("/api/chat/extract", json={"filename": "C:\\Users\\me\\report.pdf",
                                            "content_b64": b64(bytes(pdf.output())), "max_chars": 10}).json()
    assert out["filename"] == "report.pdf" and out["truncated"] is False  # clamped up to 500
    assert "revenue grew" in out["text"]


def test_refusals(served: Any) -> None:
    s, chat, other = served
    c = s.client(chat)
    assert c.post("/api/chat/extract", json={"filename": "x.txt", "content_b64": "%%%"}).status_code == 400
    assert c.post("/api/chat/extract", json={"filename": "x.txt"}).status_code == 400
    assert c.post("/api/chat/extract", json={"filename": "x.txt", "content_b64": b64(b"hi"),
                                             "max_chars": "9"}).status_code == 400
    binary = c.post("/api/chat/extract", json={"filename": "x.bin", "content_b64": b64(bytes(range(256)) * 8)})
    assert binary.status_code == 422
    big = "A" * (31 * 1024 * 1024 * 4 // 3)
    assert c.post("/api/chat/extract", json={"filename": "big.txt", "content_b64": big}).status_code == 413
    # a DOCX whose one part inflates a thousandfold: refused before it is unpacked
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/document.xml", b"<" + b"a" * (40 * 1024 * 1024))
    r = c.post("/api/chat/extract", json={"filename": "bomb.docx", "content_b64": b64(bomb.getvalue())})
    assert r.status_code == 413
    # the chat scope, and no other, reaches it
    assert s.client(other).post("/api/chat/extract", json={"filename": "a.txt", "content_b64": b64(b"hi")}).status_code == 403
    with httpx.Client(base_url=s.url) as nobody:
        assert nobody.post("/api/chat/extract", json={"filename": "a.txt", "content_b64": b64(b"hi")}).status_code == 401
