"""Images from a request to decoded pictures (vLLM's MediaConnector): bytes with a MIME type, a
`data:` URL, or an http(s) URL when remote media is allowed; every limit checked before the
expensive step it guards (encoded size before decoding; pixel count, sides and aspect ratio from
the header, before any pixel is decoded or resized). Errors name the request part and never echo
decoder internals (vLLM's CVE-2026-22778: an error message that leaked a heap address).
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from frontend_svc.errors import InvalidRequest
from frontend_svc.inputs.remote_media import RemoteMediaFetcher
from frontend_svc.requests import ImageInput

if TYPE_CHECKING:
    from PIL.Image import Image

MiB = 1024 * 1024

IMAGE_FORMATS: dict[str, str] = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
    "image/bmp": "BMP",
}
"""MIME types served, with the Pillow decoder each may use."""


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """Bounds on the images of one request (the frontend's flags)."""

    max_images_per_prompt: int = 4
    """--limit-mm-per-prompt's image count."""
    max_image_bytes: int = 10 * MiB
    """Largest encoded image (inline or fetched)."""
    max_image_pixels: int = 4096 * 4096
    """Largest decoded image, width x height."""
    max_image_side: int = 16384
    """Longest width or height."""
    max_image_aspect_ratio: float = 200.0
    """Largest long side / short side (Hugging Face's bound in Qwen2-VL's `smart_resize`). A
    shortest-edge resize (CLIP, LLaVA) first makes an S x (S * ratio) image: the ratio bounds it
    (a 1 x 300000 PNG of 1 KB became a 3 GB resize)."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts http(s) image URLs may name; empty: remote URLs are refused."""
    media_fetch_timeout: float = 5.0
    """Seconds one remote image may take to fetch."""
    mm_processor_threads: int = 2
    """Images decoded and processed at once, frontend-wide (each can take a few hundred MB)."""


DEFAULT_MEDIA_LIMITS = MediaLimits()


def parse_limit_mm_per_prompt(value: str) -> int:
    """vLLM's `--limit-mm-per-prompt`: JSON `{"image": N}` (or `image=N`); the image count."""
    try:
        parsed: Any = json.loads(value)
    except json.JSONDecodeError:
        key, _, count = value.partition("=")
        parsed = {key.strip(): count.strip()}
    if not isinstance(parsed, dict) or set(parsed) - {"image"}:
        raise ValueError('expected {"image": N}: images are the only modality served')
    images = int(parsed.get("image", 0))
    if images < 0:
        raise ValueError("the image count must be >= 0")
    return images


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image file as sent or fetched, with its declared MIME type."""

    where: str
    data: bytes
    mime_type: str


class ImageLoader:
    """Decodes the images of requests within `limits`: `encoded` (bytes, within the byte limit),
    `open` (the header, within the size limits), then `decode` (the pixels)."""

    def __init__(self, limits: MediaLimits) -> None:
        from PIL import Image as PilImage

        self.limits = limits
        self.fetcher = RemoteMediaFetcher(
            limits.allowed_media_domains, limits.media_fetch_timeout, limits.max_image_bytes
        )
        # `open` checks every image's size from its header with the limits' own messages;
        # Pillow's guard would refuse the largest first, as "not a valid image".
        PilImage.MAX_IMAGE_PIXELS = None

    def load(self, image: ImageInput) -> Image:
        """The decoded RGB image; InvalidRequest naming `image.where` otherwise."""
        encoded = self.encoded(image)
        return self.decode(self.open(encoded), encoded)

    def encoded(self, image: ImageInput) -> EncodedImage:
        """The image's file: its bytes, a data: URL unpacked or an http(s) URL fetched."""
        where = image.where
        if image.data is not None:
            if not image.mime_type:
                raise InvalidRequest(f"{where}: set mime_type (e.g. image/png) with data", where)
            self._check_bytes(len(image.data), where)
            return EncodedImage(where, image.data, image.mime_type)
        url = (image.url or "").strip()
        if not url:
            raise InvalidRequest(f"{where}: the image has neither data nor a url", where)
        colon = url.find(":", 0, 32)
        scheme = url[:colon].lower() if colon > 0 else ""  # schemes are case-insensitive
        if scheme == "data":
            return self._data_url(url, where)
        if scheme in ("http", "https"):
            return EncodedImage(where, *self.fetcher.fetch(url, where))
        raise InvalidRequest(
            f"{where}: image URLs must be data: URLs (or http(s) URLs when the server allows "
            f"remote media); got scheme {scheme[:16] or '(none)'!r}",
            where,
        )

    def _data_url(self, url: str, where: str) -> EncodedImage:
        header, comma, payload = url.partition(",")
        params = header[len("data:") :].split(";")
        if not comma or "base64" not in (p.strip().lower() for p in params[1:]):
            raise InvalidRequest(
                f"{where}: a data: URL needs the form data:image/png;base64,<data>", where
            )
        # base64 grows data by 4/3: refuse before decoding what cannot fit anyway.
        self._check_bytes(len(payload) * 3 // 4, where)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"{where}: the data: URL is not valid base64", where) from None
        return EncodedImage(where, data, params[0] or "text/plain")

    def _check_bytes(self, num_bytes: int, where: str) -> None:
        limit = self.limits.max_image_bytes
        if num_bytes > limit:
            raise InvalidRequest(
                f"{where}: the image has {num_bytes} bytes, more than the {limit} allowed "
                "(--max-image-bytes); send a smaller image",
                where,
            )

    def open(self, image: EncodedImage) -> Image:
        """The image with only its header read (by the Pillow decoder of the declared type),
        its size checked against every limit."""
        from PIL import Image as PilImage

        where, mime_type = image.where, image.mime_type
        pil_format = IMAGE_FORMATS.get(mime_type.split(";")[0].strip().lower())
        if pil_format is None:
            raise InvalidRequest(
                f"{where}: MIME type {mime_type[:64]!r} is not a supported image type; send "
                + ", ".join(sorted(set(IMAGE_FORMATS) - {"image/jpg"})),
                where,
            )
        try:
            opened = PilImage.open(io.BytesIO(image.data), formats=[pil_format])
        except Exception:  # noqa: BLE001 (any decoder failure; its text is not echoed)
            raise InvalidRequest(
                f"{where}: the data is not a valid {mime_type[:64]} image", where
            ) from None
        problem = self._size_problem(*opened.size)
        if problem:
            width, height = opened.size
            raise InvalidRequest(f"{where}: the image is {width}x{height} pixels: {problem}", where)
        return opened

    def _size_problem(self, width: int, height: int) -> str:
        """What is wrong with an image of this size, or ''."""
        limits = self.limits
        if width < 1 or height < 1:
            return "an empty image; send one with pixels"
        if width * height > limits.max_image_pixels:
            return (
                f"more than the {limits.max_image_pixels} allowed (--max-image-pixels); send a "
                "smaller image"
            )
        if max(width, height) > limits.max_image_side:
            return (
                f"a side longer than the {limits.max_image_side} allowed (--max-image-side); "
                "send a smaller image"
            )
        ratio = max(width, height) / min(width, height)
        if ratio > limits.max_image_aspect_ratio:
            return (
                f"an aspect ratio of {ratio:.0f}:1, more than the "
                f"{limits.max_image_aspect_ratio:g}:1 allowed (--max-image-aspect-ratio); crop "
                "or pad it"
            )
        return ""

    def decode(self, opened: Image, image: EncodedImage) -> Image:
        """The pixels of an `open`ed image, as RGB."""
        try:
            opened.load()
            return opened if opened.mode == "RGB" else opened.convert("RGB")
        except Exception:  # noqa: BLE001 (truncated or corrupt pixel data)
            raise InvalidRequest(
                f"{image.where}: the {image.mime_type[:64]} image is truncated or corrupt",
                image.where,
            ) from None


def release_freed_memory() -> None:
    """Give the memory freed by a large decode back to the system (glibc keeps freed heap
    memory in its arenas otherwise: a decoded image's few hundred MB stayed resident)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return None


_LIBC = _load_libc()
