"""Images and sounds in a chat request, read the way every surface reads them: a base64 data URI
(an OpenAI ``image_url`` part, an Ollama ``images`` item, an Anthropic ``image`` block, a
Responses ``input_image``) or an ``input_audio`` part becomes a :class:`~localm.sdk.engines.Media`.

Nothing here decodes pixels or samples. Every bound is checked on what the client sent before
anything expands it: the base64 text's length bounds the bytes it decodes to, and an image's
width and height come from its file header (PNG, JPEG, GIF, WebP, BMP), so a small file that
would decode to gigabytes of pixels is refused while it is still small. A WAV clip's length
comes from its header the same way. The refusals are ``LocalmError``: 413 ``image_too_large``
(or ``audio_too_large``) past a size bound, 413 ``too_many_images`` past the count, 400
``invalid_image`` / ``invalid_audio`` for what cannot be read, each naming the place as the
client spelled it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct

from localm.kernel.errors import LocalmError
from localm.kernel.engines import Media

__all__ = ["MAX_IMAGES", "MAX_IMAGE_BYTES", "MAX_IMAGE_SIDE", "MAX_IMAGE_PIXELS", "MAX_AUDIO_BYTES",
           "MIN_AUDIO_SECONDS", "MAX_AUDIO_SECONDS", "IMAGE_FORMATS", "AUDIO_FORMATS", "image_size",
           "wav_seconds", "image_from_url", "image_from_base64", "audio_from_base64", "Counter"]

#: The most images (and audio clips) one request may carry (413 too_many_images past it).
MAX_IMAGES = 16
#: The largest image file, decoded (413 image_too_large past it: checked on the base64 text).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: The widest or tallest image, and the most pixels (413 image_too_large past either).
MAX_IMAGE_SIDE = 8192
MAX_IMAGE_PIXELS = 8192 * 4096
#: The largest audio clip, encoded, and its shortest and longest length in seconds.
MAX_AUDIO_BYTES = 50 * 1024 * 1024
MIN_AUDIO_SECONDS = 0.1
MAX_AUDIO_SECONDS = 600.0
IMAGE_FORMATS = ("png", "jpeg", "gif", "webp", "bmp")
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "m4a", "webm")

_DATA_URI = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[^;,]*)*)(;base64)?,", re.ASCII)


def _decoded_length(text: str) -> int:
    """The bytes a base64 text decodes to, from its length alone."""
    stripped = len(text.rstrip("="))
    return stripped * 3 // 4


def _b64decode(text: str, where: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        compact = re.sub(r"\s+", "", text)  # line-wrapped base64 (MIME style) is still base64
        try:
            return base64.b64decode(compact, validate=True)
        except (binascii.Error, ValueError):
            raise LocalmError(400, f"{where}: the {what} is not valid base64", code=f"invalid_{what}",
                              param=where) from None


# --- image headers ----------------------------------------------------------------------------

def _jpeg_size(data: bytes) -> tuple[int, int]:
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            raise ValueError("a JPEG marker was expected")
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2:at + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame
            height, width = struct.unpack(">HH", data[at + 5:at + 9])
            return width, height
        at += 2 + length
    raise ValueError("no JPEG frame header")


def _webp_size(data: bytes) -> tuple[int, int]:
    chunk = data[12:16]
    if chunk == b"VP8 ":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L":
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    raise ValueError("an unknown WebP chunk")


def image_size(data: bytes) -> tuple[str, int, int]:
    """(format, width, height) from an image file's header, without decoding it; ValueError when
    it is none of PNG, JPEG, GIF, WebP, BMP or its header is cut short."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            width, height = struct.unpack(">II", data[16:24])
            return "png", width, height
        if data.startswith(b"\xff\xd8"):
            return ("jpeg", *_jpeg_size(data))
        if data[:6] in (b"GIF87a", b"GIF89a"):
            width, height = struct.unpack("<HH", data[6:10])
            return "gif", width, height
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return ("webp", *_webp_size(data))
        if data[:2] == b"BM":
            width, height = struct.unpack("<ii", data[18:26])
            return "bmp", abs(width), abs(height)
    except struct.error:
        raise ValueError("its header is cut short") from None
    raise ValueError("it is not a PNG, JPEG, GIF, WebP or BMP file")


def _checked_image(data: bytes, where: str) -> Media:
    try:
        fmt, width, height = image_size(data)
    except ValueError as exc:
        raise LocalmError(400, f"{where}: the image cannot be read: {exc}", code="invalid_image", param=where) \
            from None
    if width <= 0 or height <= 0:
        raise LocalmError(400, f"{where}: the image is {width}x{height} pixels", code="invalid_image", param=where)
    if max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
        raise LocalmError(413, f"{where}: the image is {width}x{height} pixels; at most {MAX_IMAGE_SIDE} a side "
                               f"and {MAX_IMAGE_PIXELS:,} pixels are accepted", code="image_too_large", param=where)
    return Media("image", data, hashlib.sha256(data).hexdigest())


def image_from_base64(text: str, where: str) -> Media:
    """An image sent as bare base64 (Ollama's ``images``, Anthropic's base64 source)."""
    if not isinstance(text, str) or not text:
        raise LocalmError(400, f"{where}: an image must be a non-empty base64 string", code="invalid_image",
                          param=where)
    if _decoded_length(text) > MAX_IMAGE_BYTES + 3:
        raise LocalmError(413, f"{where}: the image is over {MAX_IMAGE_BYTES // (1024 * 1024)} MB",
                          code="image_too_large", param=where)
    return _checked_image(_b64decode(text, where, "image"), where)


def image_from_url(url: str, where: str) -> Media:
    """An image given as a URL: a ``data:image/...;base64,`` URI. Any other URL is refused (the
    server fetches nothing a request names)."""
    if not isinstance(url, str) or not url:
        raise LocalmError(400, f"{where}: must be a data URI", code="invalid_image", param=where)
    found = _DATA_URI.match(url)
    if found is None:
        scheme = url.split(":", 1)[0] if ":" in url[:16] else ""
        said = f"a {scheme} URL" if scheme else "not a data URI"
        raise LocalmError(400, f"{where} is {said}: send the image inline as data:image/...;base64,... "
                               "(the server fetches no URL)", code="invalid_image", param=where)
    mime, _, b64 = found.groups()
    if mime is not None and not mime.lower().startswith("image/"):
        raise LocalmError(400, f"{where}: a data URI of type {mime} is not an image", code="invalid_image",
                          param=where)
    if not b64:
        raise LocalmError(400, f"{where}: the data URI must be base64 (;base64,)", code="invalid_image", param=where)
    return image_from_base64(url[found.end():], where)


# --- audio --------------------------------------------------------------------------------------

def wav_seconds(data: bytes) -> float:
    """A WAV file's length in seconds from its header; ValueError when it is not a WAV file whose
    format (PCM 8/16/24/32-bit or 32/64-bit float) and data chunk can be read."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("it is not a WAV file")
    at, rate, block = 12, None, None
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], int.from_bytes(data[at + 4:at + 8], "little")
        body = data[at + 8:at + 8 + size]
        if chunk == b"fmt ":
            if len(body) < 16:
                raise ValueError("its fmt chunk is cut short")
            fmt, channels, rate, _, block, bits = struct.unpack("<HHIIHH", body[:16])
            if fmt == 0xFFFE and len(body) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the sub-format's tag
                fmt = int.from_bytes(body[24:26], "little")
            if (fmt, bits) not in {(1, 8), (1, 16), (1, 24), (1, 32), (3, 32), (3, 64)} or not channels or not rate:
                raise ValueError(f"its sample format ({fmt}, {bits}-bit) is not PCM or float")
        elif chunk == b"data":
            if rate is None or not block:
                raise ValueError("its data comes before its format")
            return min(size, len(data) - at - 8) / block / rate
        at += 8 + size + (size & 1)
    raise ValueError("it has no data chunk")


def audio_from_base64(text: str, fmt: str, where: str) -> Media:
    """An ``input_audio`` part's clip: base64 ``data`` in ``format`` (wav, mp3, ...). A WAV clip's
    length is checked here (0.1 s to 10 minutes); other formats when they are decoded."""
    if not isinstance(text, str) or not text:
        raise LocalmError(400, f"{where}.data: must be a non-empty base64 string", code="invalid_audio",
                          param=where)
    if fmt not in AUDIO_FORMATS:
        raise LocalmError(400, f"{where}.format: {fmt!r} is not one of {', '.join(AUDIO_FORMATS)}",
                          code="invalid_audio", param=where)
    if _decoded_length(text) > MAX_AUDIO_BYTES + 3:
        raise LocalmError(413, f"{where}: the clip is over {MAX_AUDIO_BYTES // (1024 * 1024)} MB",
                          code="audio_too_large", param=where)
    data = _b64decode(text, where, "audio")
    if fmt == "wav":
        try:
            seconds = wav_seconds(data)
        except ValueError as exc:
            raise LocalmError(400, f"{where}: the clip cannot be read: {exc}", code="invalid_audio",
                              param=where) from None
        if not MIN_AUDIO_SECONDS <= seconds <= MAX_AUDIO_SECONDS:
            raise LocalmError(400 if seconds < MIN_AUDIO_SECONDS else 413,
                              f"{where}: the clip is {seconds:.2f} s; {MIN_AUDIO_SECONDS} s to "
                              f"{MAX_AUDIO_SECONDS / 60:.0f} minutes are accepted",
                              code="invalid_audio" if seconds < MIN_AUDIO_SECONDS else "audio_too_large", param=where)
    return Media("audio", data, hashlib.sha256(data).hexdigest())


class Counter:
    """Counts a request's images and clips as they are read: the one past MAX_IMAGES is a 413."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, where: str) -> None:
        self.count += 1
        if self.count > MAX_IMAGES:
            raise LocalmError(413, f"{where}: a request may carry at most {MAX_IMAGES} images and audio clips",
                              code="too_many_images", param=where)
