"""Helpers for tests that run tiny random HF models through radixserve and through transformers."""

from __future__ import annotations

from typing import Any

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)


def make_tiny_model(kind: str, path: str, seed: int = 0, **over: Any) -> Any:
    """Build a random HF model of `kind` (llama, qwen2, qwen3, llama3-rope), save it to `path`, return it."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **over}
    if kind == "llama":
        cfg = tf.LlamaConfig(**kw, tie_word_embeddings=False)
    elif kind == "llama3-rope":
        cfg = tf.LlamaConfig(**kw, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**kw, tie_word_embeddings=True)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**kw, head_dim=32, tie_word_embeddings=False)
    else:
        raise ValueError(kind)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # make biases and norms non-trivial so a dropped term is visible
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def make_runner(path: str, **server_kw: Any) -> Any:
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=4096,
                      max_running_requests=16, **server_kw)
    return ModelRunner(ModelConfig(path), args)
