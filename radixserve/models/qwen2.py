"""Qwen2 / Qwen2.5: the Llama blocks with a bias on q, k and v."""

from __future__ import annotations

from radixserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
