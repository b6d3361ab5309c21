"""Images from a request to decoded pictures (vLLM's MediaConnector): bytes with a MIME type, a
`data:` URL, or an http(s) URL when remote media is allowed; every limit checked before the
expensive step it guards (encoded size before decoding, pixel count before the pixels are
decoded). Errors name the request part and never echo decoder internals (vLLM's CVE-2026-22778:
an error message that leaked a heap address).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from frontend_svc.errors import InvalidRequest
from frontend_svc.remote_media import RemoteMediaFetcher
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
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts http(s) image URLs may name; empty: remote URLs are refused."""
    media_fetch_timeout: float = 5.0
    """Seconds one remote image may take to fetch."""


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


class ImageLoader:
    """Decodes the images of requests within `limits`."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self.fetcher = RemoteMediaFetcher(
            limits.allowed_media_domains, limits.media_fetch_timeout, limits.max_image_bytes
        )

    def load(self, image: ImageInput) -> Image:
        """The decoded RGB image; InvalidRequest naming `image.where` otherwise."""
        data, mime_type = self._encoded(image)
        return self.decode(data, mime_type, image.where)

    def _encoded(self, image: ImageInput) -> tuple[bytes, str]:
        where = image.where
        if image.data is not None:
            if not image.mime_type:
                raise InvalidRequest(f"{where}: set mime_type (e.g. image/png) with data", where)
            self._check_bytes(len(image.data), where)
            return image.data, image.mime_type
        url = (image.url or "").strip()
        if not url:
            raise InvalidRequest(f"{where}: the image has neither data nor a url", where)
        if url.startswith("data:"):
            return self._data_url(url, where)
        if url.startswith(("http://", "https://")):
            return self.fetcher.fetch(url, where)
        scheme = url.split(":", 1)[0][:16] if ":" in url else "(none)"
        raise InvalidRequest(
            f"{where}: image URLs must be data: URLs (or http(s) URLs when the server allows "
            f"remote media); got scheme {scheme!r}",
            where,
        )

    def _data_url(self, url: str, where: str) -> tuple[bytes, str]:
        header, comma, payload = url.partition(",")
        params = header[len("data:") :].split(";")
        if not comma or "base64" not in params[1:]:
            raise InvalidRequest(
                f"{where}: a data: URL needs the form data:image/png;base64,<data>", where
            )
        # base64 grows data by 4/3: refuse before decoding what cannot fit anyway.
        self._check_bytes(len(payload) * 3 // 4, where)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"{where}: the data: URL is not valid base64", where) from None
        return data, params[0] or "text/plain"

    def _check_bytes(self, num_bytes: int, where: str) -> None:
        limit = self.limits.max_image_bytes
        if num_bytes > limit:
            raise InvalidRequest(
                f"{where}: the image has {num_bytes} bytes, more than the {limit} allowed "
                "(--max-image-bytes); send a smaller image",
                where,
            )

    def decode(self, data: bytes, mime_type: str, where: str) -> Image:
        """Decode with the Pillow decoder of the declared type only; the pixel count is checked
        from the header, before any pixel is decoded."""
        from PIL import Image as PilImage

        pil_format = IMAGE_FORMATS.get(mime_type.split(";")[0].strip().lower())
        if pil_format is None:
            raise InvalidRequest(
                f"{where}: MIME type {mime_type[:64]!r} is not a supported image type; send "
                + ", ".join(sorted(set(IMAGE_FORMATS) - {"image/jpg"})),
                where,
            )
        try:
            image = PilImage.open(io.BytesIO(data), formats=[pil_format])
        except Exception:  # noqa: BLE001 (any decoder failure; its text is not echoed)
            raise InvalidRequest(
                f"{where}: the data is not a valid {mime_type} image", where
            ) from None
        width, height = image.size
        if width * height > self.limits.max_image_pixels:
            raise InvalidRequest(
                f"{where}: the image is {width}x{height} pixels, more than the "
                f"{self.limits.max_image_pixels} allowed (--max-image-pixels); send a smaller "
                "image",
                where,
            )
        try:
            image.load()
            return image.convert("RGB")
        except Exception:  # noqa: BLE001 (truncated or corrupt pixel data)
            raise InvalidRequest(
                f"{where}: the {mime_type} image is truncated or corrupt", where
            ) from None
