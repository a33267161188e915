"""Qwen3: the Llama blocks with RMSNorm on each head of q and k before the rotary embedding."""

from __future__ import annotations

from radixserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
