"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense) served as text (`models/multimodal_text.py`): the language model of
each, Qwen2 blocks (q/k/v bias) for the first two and Qwen3 blocks (per-head q/k RMSNorm) for Qwen3-VL; the vision
tower (`visual.*` or `model.visual.*`) is not loaded.

Their rotary embedding is multimodal (M-RoPE): each frequency of a head turns by one of three position components
(temporal, height, width), picked in contiguous `mrope_section` runs (Qwen2-VL, Qwen2.5-VL) or interleaved
(Qwen3-VL's `mrope_interleaved`). For text, all three components are the token's position, so whichever component a
frequency takes, it turns by that position: the ordinary 1-D rotary embedding of the same frequencies (and the same
rope scaling, whose attention factor both apply to cos and sin alike). The components differ only at the tokens of an
image or video, whose content parts are refused at the API; so are Qwen3-VL's "deepstack" visual features, added to
the hidden states at image tokens only. (transformers also gives text positions to an image token id sent without
pixels.)"""

from __future__ import annotations

from radixserve.models.multimodal_text import TextOfMultimodal
from radixserve.models.qwen2 import Qwen2ForCausalLM
from radixserve.models.qwen3 import Qwen3ForCausalLM


class Qwen2VLForConditionalGeneration(TextOfMultimodal, Qwen2ForCausalLM):
    pass


class Qwen2_5_VLForConditionalGeneration(TextOfMultimodal, Qwen2ForCausalLM):
    pass


class Qwen3VLForConditionalGeneration(TextOfMultimodal, Qwen3ForCausalLM):
    pass
