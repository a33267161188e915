"""The text model of a multimodal checkpoint, served as text (Gemma 3 4B-27B, Mistral Small 3.x, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL): the language model's weights under its old or new prefix mapped to the causal LM's names, the
image encoder's skipped. Image content parts are refused at the API (a 400), so nothing would read an image
embedding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

# transformers 4 saved `language_model.model.*` and `language_model.lm_head.*`; transformers 5 saves
# `model.language_model.*` and a top-level `lm_head.*`
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
# Qwen-VL: `visual.*` beside `model.layers.*` (the released Qwen2-VL / Qwen2.5-VL files), or `model.visual.*`
VISION_PARTS = ("vision_tower", "multi_modal_projector", "vision_model", "visual.")


def text_weight_name(name: str) -> str | None:
    """The causal LM's name for a multimodal checkpoint's tensor, or None for the image encoder's."""
    if any(part in name for part in VISION_PARTS):
        return None
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name


def text_config(config: Any) -> Any:
    """The language model's config of a (possibly) multimodal one. Whether its embeddings are tied is the top-level
    config's `tie_word_embeddings` where that sets one, as transformers ties them (Mistral 3's text config says
    False while the checkpoint holds no separate lm_head)."""
    if not hasattr(config, "get_text_config"):
        return config
    text = config.get_text_config()
    if text is not config and getattr(config, "tie_word_embeddings", None) is not None:
        text.tie_word_embeddings = bool(config.tie_word_embeddings)
    return text


class TextOfMultimodal:
    """Mixin (before a causal LM class) for a multimodal checkpoint served as text: the model is built from the
    text config and loads the language model's weights only (the image encoder's are skipped)."""

    tie_word_embeddings: bool

    def __init__(self, config: Any, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(text_config(config), tp_rank, tp_size)  # type: ignore[call-arg]

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        name = text_weight_name(name)
        if name is None or name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return super().load_weight(params, name, tensor)  # type: ignore[misc]
