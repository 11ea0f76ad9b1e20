"""A chat with images as a prompt: the image parts of the messages (`gpullama.chat.messages` reads every API's
shape of them into ``{"type": "image", "image": ImageRef}``) go to the chat template as ``{"type": "image"}``, which
the model's template writes as its marker (Gemma 3: ``<start_of_image>``; SmolVLM / Idefics3: ``<image>``;
Qwen2-VL, Qwen3-VL: ``<|image_pad|>`` between ``<|vision_start|>`` and ``<|vision_end|>``); each
marker becomes what the model's HF processor makes of it (its `ImageFormat`), and the runs of image tokens in it
take the image's embeddings (`ImageSpan`, one per tile)."""

from __future__ import annotations

from typing import Any

from gpullama.checks import RequestError, check_count
from gpullama.vision import ImageSpan, mrope_image_positions
from gpullama.vision.images import LIBRARY_POLICY, ImagePolicy, ImageRef, load_image

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


class ImageFormat:
    """How a projector type's images sit in the prompt: the `marker` the chat template writes for an image, the
    `image_token` each embedding takes the place of, the `tokens` the vocabulary must hold, and the text one image
    becomes (`expand`); `causal`: the image tokens attend causally as text does (else both ways); `mrope`: they
    take M-RoPE positions; `media`: what llama.cpp's ``<__media__>`` marker becomes."""

    marker = ""
    image_token = ""
    tokens: tuple[str, ...] = ()
    causal = False
    mrope = False
    model = ""

    @property
    def media(self) -> str:
        """What llama.cpp's ``<__media__>`` marker becomes in a prompt (the model's own marker)."""
        return self.marker

    def expand(self, tokens_per_tile: int, rows: int, cols: int) -> str:
        """The text of one image of rows x cols tiles (0 x 0: one tile, the whole image)."""
        raise NotImplementedError


class Gemma3Format(ImageFormat):
    """Gemma 3's processor: ``\\n\\n<start_of_image>`` + N ``<image_soft_token>`` + ``<end_of_image>\\n\\n``; the
    image's tokens attend to each other both ways."""

    marker, image_token, tokens, model = BOI, SOFT, (BOI, EOI, SOFT), "Gemma 3"

    def expand(self, tokens_per_tile: int, rows: int, cols: int) -> str:
        return f"\n\n{BOI}{SOFT * tokens_per_tile}{EOI}\n\n"


class Gemma4Format(ImageFormat):
    """Gemma 4's processor: the template's ``<|image|>`` becomes ``<|image>`` + N ``<|image|>`` + ``<image|>`` (N
    the image's own count); causal attention (transformers' Gemma 4 with ``use_bidirectional_attention`` unset, as
    the E2B / E4B models and llama.cpp for them)."""

    marker = image_token = "<|image|>"
    tokens = ("<|image>", "<|image|>", "<image|>")
    causal = True
    model = "Gemma 4"

    def expand(self, tokens_per_tile: int, rows: int, cols: int) -> str:
        return f"<|image>{'<|image|>' * tokens_per_tile}<image|>"


class Idefics3Format(ImageFormat):
    """Idefics3's (SmolVLM's) processor: each tile ``<fake_token_around_image><row_R_col_C>`` + N ``<image>``, a
    ``\\n`` after each row, then ``\\n<fake_token_around_image><global-img>`` + N ``<image>`` +
    ``<fake_token_around_image>`` (the global image alone when the image is one tile); causal attention."""

    marker = image_token = "<image>"
    tokens = ("<image>", "<fake_token_around_image>", "<global-img>")
    causal = True
    model = "Idefics3 / SmolVLM"

    def expand(self, tokens_per_tile: int, rows: int, cols: int) -> str:
        fake, run = "<fake_token_around_image>", "<image>" * tokens_per_tile
        tiles = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                        for r in range(rows))
        return f"{tiles}\n{fake}<global-img>{run}{fake}" if rows else f"{fake}<global-img>{run}{fake}"


class Qwen2VLFormat(ImageFormat):
    """Qwen2-VL's processor: the template's ``<|vision_start|><|image_pad|><|vision_end|>`` with the pad repeated
    once a token of the image (its merged grid, rows x cols); causal attention, M-RoPE positions."""

    marker = image_token = "<|image_pad|>"
    tokens = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
    causal = mrope = True
    model = "Qwen2-VL"

    @property
    def media(self) -> str:
        return "<|vision_start|><|image_pad|><|vision_end|>"

    def expand(self, tokens_per_tile: int, rows: int, cols: int) -> str:
        return "<|image_pad|>" * tokens_per_tile


class Qwen3VLFormat(Qwen2VLFormat):
    """Qwen3-VL's processor: Qwen2-VL's."""

    model = "Qwen3-VL"


FORMATS: dict[str, type[ImageFormat]] = {"gemma3": Gemma3Format, "gemma4v": Gemma4Format, "idefics3": Idefics3Format,
                                         "qwen2vl_merger": Qwen2VLFormat, "qwen2.5vl_merger": Qwen2VLFormat,
                                         "qwen3vl_merger": Qwen3VLFormat}
"""Projector type -> its images' place in the prompt."""


class PromptIds(list):
    """A prompt's token ids (a list) with the images whose embeddings take the place of some of them."""

    images: list[ImageSpan]

    def __init__(self, ids: list[int], images: list[ImageSpan] | None = None):
        super().__init__(ids)
        self.images = list(images or [])


class VisionModel:
    """A loaded mmproj tower with the text model's image tokens: turns rendered prompt text plus images into
    prompt ids with image spans."""

    def __init__(self, tower, tokenizer):
        self.tower = tower
        self.tokenizer = tokenizer
        self.format = fmt = FORMATS[tower.config.projector]()
        ids = {}
        for name in fmt.tokens:
            found = tokenizer.encode(name)
            if len(found) != 1:
                raise ValueError(f"the model's vocabulary has no {name} token, which {fmt.model}'s mmproj needs: "
                                 f"is {tower.path} the projector of this model?")
            ids[name] = found[0]
        self.image_token_id = ids[fmt.image_token]
        self.marker = fmt.marker
        self.media_marker = fmt.media  # what llama.cpp's <__media__> becomes

    @property
    def modalities(self) -> list[str]:
        return ["text", "image"]

    def encode_images(self, refs: list[ImageRef], policy: ImagePolicy = LIBRARY_POLICY
                      ) -> list[tuple[Any, bytes, int, int]]:
        """Each image's embeddings ``[tiles, tokens_per_tile, hidden]``, content hash, and rows and columns of
        tiles (Qwen2-VL: of its merged grid; loaded and checked as `policy` says)."""
        check_count("images", len(refs), policy.max_images)
        loaded = [load_image(ref, policy) for ref in refs]
        if not loaded:
            return []
        encoded = self.tower.encode_images([img.image for img in loaded])
        return [(e, img.key, rows, cols) for (e, rows, cols), img in zip(encoded, loaded)]

    def prompt(self, text: str, refs: list[ImageRef], policy: ImagePolicy = LIBRARY_POLICY,
               add_special_tokens: bool = False) -> PromptIds:
        """Token ids of rendered prompt `text` whose image markers (one per image, in order) are expanded, with
        the images' spans."""
        parts = text.split(self.marker)
        if len(parts) - 1 != len(refs):
            raise RequestError(f"the prompt has {len(parts) - 1} {self.marker} markers for {len(refs)} images (the "
                               "chat template writes one per image part; a text that spells the marker itself is "
                               "refused)", "messages")
        encoded = self.encode_images(refs, policy)
        expanded = parts[0] + "".join(self.format.expand(embeds.shape[1], rows, cols) + part
                                      for (embeds, _, rows, cols), part in zip(encoded, parts[1:]))
        ids = self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
        runs = []
        i, n = 0, len(ids)
        while i < n:
            if ids[i] == self.image_token_id:
                j = i
                while j < n and ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        tiles = [(embeds[t], key, rows, cols) for embeds, key, rows, cols in encoded for t in range(embeds.shape[0])]
        if len(runs) != len(tiles) or any(j - i != len(tile[0]) for (i, j), tile in zip(runs, tiles)):
            raise RequestError(f"the prompt's image tokens ({self.tokenizer.decode([self.image_token_id])}) do not "
                               f"form {len(tiles)} runs of {', '.join(str(len(t[0])) for t in tiles)}: a text that "
                               "spells the image token itself is refused", "messages")
        spans, shift = [], 0
        for (start, end), (embeds, key, rows, cols) in zip(runs, tiles):
            rope = None
            if self.format.mrope:  # from the image's first position; the text after it from one past the largest
                rope = mrope_image_positions(start + shift, rows, cols)
                shift = start + shift + max(rows, cols) - end
            spans.append(ImageSpan(start, embeds, key, self.format.causal, rope))
        return PromptIds(ids, spans)
