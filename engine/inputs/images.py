"""Image input (torch-free): decoding a client's image safely, preprocessing it with the
checkpoint's own image processor, and placing its soft tokens in a prompt.

- `decode_image`: PNG, JPEG, WebP or GIF (its first frame) from bytes, within `ImageLimits`:
  the byte size is checked before anything is parsed, and the pixel count from the file's header
  before any pixel is decompressed (a decompression bomb never expands). Anything else, a
  truncated or malformed file included, is a ParamError naming the part.
- `ImageProcessor`: the checkpoint's processor config (`preprocessor_config.json` or
  `processor_config.json`) through transformers' Gemma 4 image processor (its PIL backend, so
  the same resize everywhere): aspect-preserving resize to the patch budget, rescale to [0, 1],
  patches and their grid positions, padded to the budget. Call it off the event loop.
- `expand_image_tokens`: each image placeholder the chat template wrote becomes
  begin-of-image, one image token per soft token, end-of-image (what transformers'
  `Gemma4Processor` does to the text). The template writes placeholders only for image parts;
  a client's text never yields one (the tokenizer encodes it as plain text), so the count
  must match the images given, or the request is refused.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.params import ParamError

if TYPE_CHECKING:  # engine.model loads torch; the server imports this module
    from engine.model.config import VisionConfig

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what Pillow may decode (first frame of a GIF)
MIME_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request may send: bytes per image (encoded), pixels per image (width × height,
    read from the header before decoding), images per request."""

    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 25_000_000
    max_images: int = 8

    def __post_init__(self) -> None:
        if min(self.max_image_bytes, self.max_image_pixels, self.max_images) < 1:
            raise ValueError("image limits must be >= 1")


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImage:
    """One image as the vision tower takes it (the image processor's output for it alone)."""

    pixel_values: np.ndarray  # [max_patches, 3 * patch_size**2], pixels in [0, 1]
    position_ids: np.ndarray  # [max_patches, 2] (x, y) of each patch; (-1, -1): padding
    num_tokens: int  # soft tokens (image tokens in the prompt)
    digest: str  # sha256 of what the tower sees (pixels and positions): the content hash

    @staticmethod
    def build(pixel_values: np.ndarray, position_ids: np.ndarray, num_tokens: int) -> PreparedImage:
        h = hashlib.sha256()
        for array in (pixel_values, position_ids):
            h.update(repr((array.dtype.str, array.shape)).encode())
            h.update(np.ascontiguousarray(array).tobytes())
        return PreparedImage(pixel_values, position_ids, int(num_tokens), h.hexdigest())


def decode_image(data: bytes, param: str, limits: ImageLimits) -> Any:
    """A PIL RGB image from `data`; ParamError naming `param` for what is too big, not one of
    the formats, truncated or malformed."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise ParamError(
            param, f"image is {len(data)} bytes, more than the {limits.max_image_bytes} allowed"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
            width, height = image.size
            if width < 1 or height < 1:
                raise ParamError(param, f"image has no pixels ({width}x{height})")
            if width * height > limits.max_image_pixels:
                raise ParamError(
                    param,
                    f"image is {width}x{height} = {width * height} pixels, more than the "
                    f"{limits.max_image_pixels} allowed",
                )
            image.seek(0)  # a GIF's (or animated WebP's) first frame
            return image.convert("RGB")  # decodes; a truncated file raises here
    except ParamError:
        raise
    except UnidentifiedImageError:
        raise ParamError(
            param, "is not an image Canvas reads: send PNG, JPEG, WebP or GIF"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ParamError(param, "image is a decompression bomb (too many pixels)") from None
    except Exception as exc:  # Pillow's decoders raise OSError, ValueError, SyntaxError, ...
        raise ParamError(param, f"image could not be decoded ({type(exc).__name__})") from None


class ImageProcessor:
    """Preprocessing of a vision checkpoint: its own image processor and image token ids."""

    def __init__(self, model_dir: str | Path, limits: ImageLimits | None = None) -> None:
        """Raises ValueError naming `model_dir` when it has no vision tower or no processor
        config."""
        from transformers import AutoImageProcessor

        from engine.model.config import load_vision_config

        vision = load_vision_config(model_dir)
        if vision is None:
            raise ValueError(f"{model_dir}: config.json has no vision_config (text only)")
        self.vision: VisionConfig = vision
        self.limits = limits or ImageLimits()
        try:
            self._proc = AutoImageProcessor.from_pretrained(
                str(model_dir), backend="pil", local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise ValueError(f"{model_dir}: no usable image processor config ({exc})") from None
        if getattr(self._proc, "patch_size", None) != vision.patch_size:
            raise ValueError(
                f"{model_dir}: the image processor's patch_size "
                f"{getattr(self._proc, 'patch_size', None)} is not the vision tower's "
                f"{vision.patch_size}"
            )

    def prepare(self, data: bytes, param: str) -> PreparedImage:
        """Decode and preprocess one image; ParamError naming `param`."""
        return self.prepare_image(decode_image(data, param, self.limits), param)

    def prepare_image(self, image: Any, param: str) -> PreparedImage:
        """Preprocess a decoded (PIL) image; ParamError naming `param`."""
        try:
            out = self._proc(images=[image], return_tensors="np")
        except ValueError as exc:  # e.g. a size the resize rule cannot meet
            raise ParamError(param, f"image cannot be preprocessed ({exc})") from None
        (num_tokens,) = (int(n) for n in out["num_soft_tokens_per_image"])
        return PreparedImage.build(out["pixel_values"][0], out["image_position_ids"][0], num_tokens)


def expand_image_tokens(
    ids: list[int], images: list[PreparedImage], vision: VisionConfig, param: str = "messages"
) -> list[int]:
    """`ids` with its i-th image placeholder (`image_token_id`) replaced by begin-of-image,
    `images[i].num_tokens` image tokens and end-of-image. ParamError when the placeholders and
    the images differ in number."""
    found = ids.count(vision.image_token_id)
    if found != len(images):
        raise ParamError(
            param,
            f"the chat template wrote {found} image placeholders for {len(images)} images; "
            "every image part needs one",
        )
    out: list[int] = []
    pending = iter(images)
    for token in ids:
        if token != vision.image_token_id:
            out.append(token)
            continue
        image = next(pending)
        out += [vision.boi_token_id, *[token] * image.num_tokens, vision.eoi_token_id]
    return out


def image_token_positions(
    prompt_ids: list[int], images: tuple[PreparedImage, ...], vision: VisionConfig | None
) -> tuple[int, ...]:
    """Positions of the image tokens of a prompt with `images` (the k-th takes the k-th soft
    token of the images in order); ParamError when they are not exactly the images' soft
    tokens or the checkpoint has no vision tower."""
    if not images:
        return ()
    if vision is None:
        raise ParamError("messages", "this checkpoint has no vision tower: it takes no images")
    positions = tuple(i for i, t in enumerate(prompt_ids) if t == vision.image_token_id)
    want = sum(image.num_tokens for image in images)
    if len(positions) != want:
        raise ParamError(
            "messages",
            f"the prompt has {len(positions)} image tokens for {len(images)} images of "
            f"{want} soft tokens",
        )
    return positions


def image_spans(positions: tuple[int, ...], max_pass: int) -> tuple[tuple[int, int], ...]:
    """(first, last) of each run of consecutive image-token positions: one image each (the
    begin/end-of-image tokens around every image keep runs apart), the groups the reference's
    `get_block_sequence_ids_for_mask` builds from `mm_token_type_ids`. On a checkpoint with
    use_bidirectional_attention "vision" an image's tokens attend to each other both ways, so
    each image is computed in one pass of at most `max_pass` tokens (the prefill chunk):
    ParamError for a longer one."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p - 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    for first, last in out:
        if last - first + 1 > max_pass:
            raise ParamError(
                "messages",
                f"an image of {last - first + 1} tokens is more than the {max_pass} tokens of "
                "one prefill chunk (max_prefill_chunk); this checkpoint attends both ways "
                "within an image, so an image is computed in one chunk",
            )
    return tuple(out)
