"""localm.sdk.media: images and clips read from a request, every bound checked on what the client
sent before anything expands it (a decompression bomb is refused while it is still small)."""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib

import pytest

from localm import sdk
from localm.sdk import media

PIL = pytest.importorskip("PIL.Image")


def picture(fmt: str, size: tuple[int, int] = (33, 21)) -> bytes:
    out = io.BytesIO()
    PIL.new("RGB", size, (200, 30, 90)).save(out, format=fmt)
    return out.getvalue()


def uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def refusal(call) -> sdk.LocalmError:
    with pytest.raises(sdk.LocalmError) as err:
        call()
    return err.value


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_image_sizes_come_from_the_header(fmt: str) -> None:
    data = picture(fmt)
    assert media.image_size(data) == (fmt.lower(), 33, 21)
    got = media.image_from_url(uri(data), "messages[0].content[1].image_url.url")
    assert got.kind == "image" and got.data == data and len(got.digest) == 64


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels and holds one compressed row: what a bomb looks like."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = lambda kind, body: struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    bomb = png_header(60_000, 60_000)  # 3.6 gigapixels in a few dozen bytes
    assert len(bomb) < 200
    err = refusal(lambda: media.image_from_url(uri(bomb), "messages[0].content[0].image_url.url"))
    assert (err.status, err.code) == (413, "image_too_large")
    assert err.detail.startswith("messages[0].content[0].image_url.url: the image is 60000x60000 pixels")
    err = refusal(lambda: media.image_from_base64(base64.b64encode(png_header(9000, 10)).decode(), "images[0]"))
    assert (err.status, err.code) == (413, "image_too_large")  # one side too long
    assert media.image_from_base64(base64.b64encode(png_header(8192, 4096)).decode(), "images[0]").kind == "image"


def test_the_size_bound_is_checked_on_the_base64_text() -> None:
    text = "A" * (media.MAX_IMAGE_BYTES * 4 // 3 + 100)
    err = refusal(lambda: media.image_from_base64(text, "images[3]"))
    assert (err.status, err.code, err.extra["param"]) == (413, "image_too_large", "images[3]")


@pytest.mark.parametrize("url, said", [
    ("https://example.com/cat.png", "is a https URL"),
    ("file:///etc/passwd", "is a file URL"),
    ("cat.png", "is not a data URI"),
    ("data:text/plain;base64,aGk=", "a data URI of type text/plain is not an image"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64,!!!!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"GIF8 not really").decode(), "cannot be read"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0").decode(), "cut short"),
])
def test_what_is_not_an_inline_image_is_a_400_naming_the_place(url: str, said: str) -> None:
    err = refusal(lambda: media.image_from_url(url, "messages[1].content[0].image_url.url"))
    assert err.status == 400 and err.code == "invalid_image" and said in err.detail, err.detail
    assert err.detail.startswith("messages[1].content[0].image_url.url")


def wav(seconds: float, rate: int = 16000, width: int = 2, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(b"\0" * int(seconds * rate) * width * channels)
    return out.getvalue()


def test_a_wav_clip_is_bounded_by_its_length() -> None:
    assert media.wav_seconds(wav(1.5, channels=2)) == pytest.approx(1.5)
    clip = media.audio_from_base64(base64.b64encode(wav(0.5)).decode(), "wav", "messages[0].content[0].input_audio")
    assert clip.kind == "audio"
    err = refusal(lambda: media.audio_from_base64(base64.b64encode(wav(0.05)).decode(), "wav", "a"))
    assert (err.status, err.code) == (400, "invalid_audio") and "0.05 s" in err.detail
    long = wav(0.2)[:40] + struct.pack("<I", 16000 * 2 * 700) + b"\0" * 64  # a header claiming 700 s
    err = refusal(lambda: media.audio_from_base64(base64.b64encode(long).decode(), "wav", "a"))
    assert err.status == 400  # the data chunk is cut short: what is there is what counts
    eleven = base64.b64encode(wav(660, rate=8000, width=1)).decode()  # 11 minutes, 5 MB
    err = refusal(lambda: media.audio_from_base64(eleven, "wav", "a"))
    assert (err.status, err.code) == (413, "audio_too_large") and "660.00 s" in err.detail
    err = refusal(lambda: media.audio_from_base64(base64.b64encode(b"RIFF....WAVEjunk").decode(), "wav", "a"))
    assert (err.status, err.code) == (400, "invalid_audio")
    err = refusal(lambda: media.audio_from_base64("aGk=", "aiff", "a"))
    assert err.status == 400 and "'aiff' is not one of" in err.detail


def test_the_count_is_bounded() -> None:
    counter = media.Counter()
    for i in range(media.MAX_IMAGES):
        counter.add(f"images[{i}]")
    err = refusal(lambda: counter.add("images[16]"))
    assert (err.status, err.code) == (413, "too_many_images")
