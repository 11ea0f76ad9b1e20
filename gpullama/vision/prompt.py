"""A chat with images as a prompt: the image parts of the messages (`gpullama.chat.messages` reads every API's
shape of them into ``{"type": "image", "image": ImageRef}``) go to the chat template as ``{"type": "image"}``, which
Gemma 3's template writes as ``<start_of_image>``; each of those becomes what the HF Gemma 3 processor makes of it,
``\\n\\n<start_of_image>`` + N ``<image_soft_token>`` + ``<end_of_image>\\n\\n``, and the N soft tokens' embeddings
are the image's (`ImageSpan`)."""

from __future__ import annotations

from typing import Any

from gpullama.checks import RequestError, check_count
from gpullama.vision import ImageSpan
from gpullama.vision.images import LIBRARY_POLICY, ImagePolicy, ImageRef, load_image

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"


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
        ids = {}
        for name in (BOI, EOI, SOFT):
            found = tokenizer.encode(name)
            if len(found) != 1:
                raise ValueError(f"the model's vocabulary has no {name} token, which Gemma 3's mmproj needs: is "
                                 f"{tower.path} the projector of this model?")
            ids[name] = found[0]
        self.image_token_id = ids[SOFT]
        self.marker = BOI
        self.expanded = f"\n\n{BOI}{SOFT * tower.tokens_per_image}{EOI}\n\n"

    @property
    def modalities(self) -> list[str]:
        return ["text", "image"]

    def encode_images(self, refs: list[ImageRef], policy: ImagePolicy = LIBRARY_POLICY) -> list[tuple[Any, bytes]]:
        """Each image's embeddings ``[tokens, hidden]`` and content hash (loaded and checked as `policy` says)."""
        import torch

        check_count("images", len(refs), policy.max_images)
        loaded = [load_image(ref, policy) for ref in refs]
        if not loaded:
            return []
        pixels = torch.stack([self.tower.preprocess(img.image) for img in loaded])
        embeds = self.tower.encode(pixels)
        return [(embeds[i], img.key) for i, img in enumerate(loaded)]

    def prompt(self, text: str, refs: list[ImageRef], policy: ImagePolicy = LIBRARY_POLICY,
               add_special_tokens: bool = False) -> PromptIds:
        """Token ids of rendered prompt `text` whose image markers (one per image, in order) are expanded, with
        the images' spans."""
        markers = text.count(self.marker)
        if markers != len(refs):
            raise RequestError(f"the prompt has {markers} {self.marker} markers for {len(refs)} images (the chat "
                               "template writes one per image part; a text that spells the marker itself is "
                               "refused)", "messages")
        encoded = self.encode_images(refs, policy)
        ids = self.tokenizer.encode(text.replace(self.marker, self.expanded), add_special_tokens=add_special_tokens)
        spans = []
        i, n = 0, len(ids)
        runs = []
        while i < n:
            if ids[i] == self.image_token_id:
                j = i
                while j < n and ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        per_image = self.tower.tokens_per_image
        if len(runs) != len(encoded) or any(j - i != per_image for i, j in runs):
            raise RequestError(f"the prompt's image tokens ({self.tokenizer.decode([self.image_token_id])}) do not "
                               f"form {len(encoded)} runs of {per_image}: a text that spells the image token "
                               "itself is refused", "messages")
        for (start, _), (embeds, key) in zip(runs, encoded):
            spans.append(ImageSpan(start, embeds, key))
        return PromptIds(ids, spans)
