"""Images as requests carry them, read with Pillow: the source (bytes, a path, a PIL image, a data URL or raw
base64), the limits (bytes, pixels, images per request), decoding (PNG, JPEG, WebP, GIF's first frame; EXIF
orientation; RGB) and the tower's preprocessing (resize to its square size, or Idefics3's tiles, then
``(x / 255 - mean) / std``).

Remote and local sources are resolved by the caller's policy (`ImagePolicy`): ``http(s)`` only from an allow-list of
domains (off by default; no network access otherwise), ``file://`` and plain paths only under an allowed folder
(the library, `LLM.chat`, allows any path the caller names)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpullama.checks import RequestError

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 50_000_000
MAX_IMAGES_PER_REQUEST = 8
FETCH_TIMEOUT = 10.0


@dataclass(frozen=True)
class ImagePolicy:
    """What a request's images may be and where they may come from: `max_bytes` of encoded data per image,
    `max_pixels` (width x height, checked before decoding: the decompression-bomb guard), `max_images` per request;
    `allowed_domains` for ``http(s)`` URLs (empty: none), `allowed_local_path` for ``file://`` URLs and paths (None:
    none; `any_path` allows any, as the library does)."""

    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES_PER_REQUEST
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    any_path: bool = False
    fetch_timeout: float = FETCH_TIMEOUT


LIBRARY_POLICY = ImagePolicy(any_path=True)


@dataclass
class ImageRef:
    """An image part of a chat message as read from a request, not yet loaded: `source` is bytes, a PIL image, a
    path, or a string (a data URL, raw base64, an http(s) or file URL); `where` names the request field."""

    source: Any
    where: str = "image"

    def __repr__(self) -> str:  # never print a megabyte of base64
        kind = type(self.source).__name__
        return f"ImageRef({kind} at {self.where!r})"


@dataclass
class LoadedImage:
    """A decoded image (RGB, orientation applied) and the hash of its content (its pixels and size)."""

    image: Any  # PIL.Image.Image
    key: bytes = field(default=b"")


def _error(message: str, where: str) -> RequestError:
    return RequestError(message, where)


def _read_limited(path: Path, policy: ImagePolicy, where: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise _error(f"'{where}': the image file is {size} bytes, over the limit of {policy.max_bytes} "
                         "(--max-image-bytes)", where)
        return path.read_bytes()
    except OSError as exc:
        raise _error(f"'{where}': cannot read the image file {str(path)[:200]!r}: {exc.strerror or exc}",
                     where) from None


def _local(path_text: str, policy: ImagePolicy, where: str) -> bytes:
    path = Path(path_text).expanduser()
    if not policy.any_path:
        if policy.allowed_local_path is None:
            raise _error(f"'{where}': local image files are not allowed; start the server with "
                         "--allowed-local-media-path DIR to allow files under DIR", where)
        root = Path(policy.allowed_local_path).resolve()
        resolved = path.resolve()
        if resolved != root and root not in resolved.parents:
            raise _error(f"'{where}': {str(path)[:200]!r} is outside the allowed local media path "
                         f"(--allowed-local-media-path {root})", where)
        path = resolved
    return _read_limited(path, policy, where)


def _remote(url: str, policy: ImagePolicy, where: str) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    allowed = any(host == d or host.endswith("." + d) for d in (d.lower().lstrip(".") for d in policy.allowed_domains))
    if not allowed:
        raise _error(f"'{where}': remote image URLs are not fetched"
                     + (f" from {host!r}" if policy.allowed_domains else "")
                     + "; send the image as a data URL or base64, or start the server with "
                       "--allowed-media-domains to allow a domain", where)
    try:
        with urllib.request.urlopen(url, timeout=policy.fetch_timeout) as answer:  # noqa: S310 (allow-listed)
            data = answer.read(policy.max_bytes + 1)
    except OSError as exc:
        raise _error(f"'{where}': fetching the image failed: {exc}", where) from None
    if len(data) > policy.max_bytes:
        raise _error(f"'{where}': the image is over the limit of {policy.max_bytes} bytes (--max-image-bytes)", where)
    return data


def _base64(text: str, policy: ImagePolicy, where: str) -> bytes:
    if len(text) * 3 // 4 > policy.max_bytes + 3:
        raise _error(f"'{where}': the image is over the limit of {policy.max_bytes} bytes (--max-image-bytes)", where)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _error(f"'{where}': not valid base64 image data", where) from None


def image_bytes(ref: ImageRef, policy: ImagePolicy) -> bytes | Any:
    """The encoded bytes of `ref` (or the PIL image it is), fetched or read as `policy` allows."""
    src, where = ref.source, ref.where
    if hasattr(src, "getbands"):  # a PIL image
        return src
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    elif isinstance(src, os.PathLike):
        data = _local(os.fspath(src), policy, where)
    elif isinstance(src, str):
        text = src.strip()
        lower = text[:16].lower()
        if lower.startswith("data:"):
            head, _, payload = text.partition(",")
            if ";base64" not in head.lower():
                raise _error(f"'{where}': a data URL must be base64 (data:image/png;base64,...)", where)
            data = _base64(payload, policy, where)
        elif lower.startswith(("http://", "https://")):
            data = _remote(text, policy, where)
        elif lower.startswith("file://"):
            data = _local(urllib.parse.unquote(urllib.parse.urlsplit(text).path), policy, where)
        elif policy.any_path and len(text) < 4096 and os.path.isfile(text):
            data = _local(text, policy, where)
        else:
            data = _base64(text, policy, where)
    else:
        raise _error(f"'{where}': an image must be a data URL, base64, a path, bytes or a PIL image, "
                     f"got {type(src).__name__}", where)
    if len(data) > policy.max_bytes:
        raise _error(f"'{where}': the image is {len(data)} bytes, over the limit of {policy.max_bytes} "
                     "(--max-image-bytes)", where)
    return data


def load_image(ref: ImageRef, policy: ImagePolicy = LIBRARY_POLICY) -> LoadedImage:
    """Decode `ref` as `policy` allows: RGB, EXIF orientation applied, GIF's first frame; its content hash.
    RequestError (naming the field and the limit) for a corrupt or unsupported payload or one over a limit."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    where = ref.where
    data = image_bytes(ref, policy)
    if isinstance(data, Image.Image):
        image = data
    else:
        try:
            image = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise _error(f"'{where}': not a readable image (PNG, JPEG, WebP or GIF): {exc}", where) from None
    width, height = image.size
    if width * height > policy.max_pixels:
        raise _error(f"'{where}': the image is {width}x{height} = {width * height} pixels, over the limit of "
                     f"{policy.max_pixels} (--max-image-pixels)", where)
    if width < 1 or height < 1:
        raise _error(f"'{where}': the image is empty ({width}x{height})", where)
    try:
        image.seek(0)  # GIF, animated WebP: the first frame
        image.load()
        image = ImageOps.exif_transpose(image)
        image = image.convert("RGB")
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise _error(f"'{where}': the image data is corrupt: {exc}", where) from None
    key = hashlib.blake2b(image.tobytes(), digest_size=16, person=b"gpullama-image")
    key.update(f"{image.size}".encode())
    return LoadedImage(image, key.digest())


def normalise(image: Any, mean: list[float], std: list[float]):
    """float32 pixels ``[3, H, W]`` of an RGB PIL image: scaled to [0, 1], normalised by `mean` and `std` per
    channel (as the HF image processors' rescale and normalize)."""
    import numpy as np
    import torch

    pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / np.float32(255.0)
    m = np.asarray(mean, dtype=np.float32)[:, None, None]
    s = np.asarray(std, dtype=np.float32)[:, None, None]
    return torch.from_numpy(np.ascontiguousarray((pixels - m) / s))


def preprocess(image: Any, size: int, mean: list[float], std: list[float], resample: str = "bilinear"):
    """float32 pixels ``[3, size, size]`` of an RGB PIL image: resized (Pillow's bilinear or bicubic, as the HF
    image processors do it on uint8 pixels), scaled to [0, 1], normalised by `mean` and `std` per channel."""
    from PIL import Image

    method = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}[resample]
    resized = image.resize((size, size), resample=method) if image.size != (size, size) else image
    return normalise(resized, mean, std)


IDEFICS3_MAX_SIDE = 4096
"""transformers' Idefics3 MAX_IMAGE_SIZE: no side of the resized image is longer."""


def idefics3_tiles(image: Any, tile: int, longest_edge: int) -> tuple[list[Any], int, int]:
    """An RGB PIL image cut as transformers' Idefics3 image processor (do_image_splitting) cuts it, with Pillow's
    Lanczos on uint8 pixels throughout: its longest side resized to `longest_edge` (aspect kept, the other side made
    even), both sides then up to multiples of `tile`, cut into rows x cols tiles (row-major) followed by the whole
    image resized to `tile` x `tile`; one tile and rows = cols = 0 when it fits in one. (tiles, rows, cols)."""
    from PIL import Image

    def resize(img, width: int, height: int):
        return img.resize((width, height), resample=Image.LANCZOS)

    width, height = image.size
    aspect = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > IDEFICS3_MAX_SIDE:
        width, height = IDEFICS3_MAX_SIDE, max(int(IDEFICS3_MAX_SIDE / aspect), 1)
    elif height > width and height > IDEFICS3_MAX_SIDE:
        width, height = max(int(IDEFICS3_MAX_SIDE * aspect), 1), IDEFICS3_MAX_SIDE
    image = resize(image, width, height)
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    image = resize(image, width, height)
    if height <= tile and width <= tile:
        return [image], 0, 0
    rows, cols = (height - tile) // tile + 1, (width - tile) // tile + 1
    tiles = [image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)]
    return [*tiles, resize(image, tile, tile)], rows, cols
