"""Multimodal checkpoints served as text: Mistral Small 3.x (`Mistral3ForConditionalGeneration`) on tiny random
models gives transformers' tokens for text prompts, its vision tower and projector left unloaded (Gemma 3's own
case is in test_gemma.py)."""

from __future__ import annotations

import torch
from model_utils import TINY, hf_greedy, make_runner

from radixserve.bench_one_batch import StaticBatch
from radixserve.configs.model_config import ModelConfig
from radixserve.models.multimodal_text import text_weight_name

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def test_mistral3_served_as_text(tmp_path) -> None:  # noqa: ANN001
    import transformers as tf

    torch.manual_seed(0)
    text = {**TINY, "model_type": "mistral", "sliding_window": None}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, head_dim=16)
    cfg = tf.Mistral3Config(text_config=text, vision_config=vision, image_token_index=250, spatial_merge_size=2)
    hf = tf.Mistral3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(str(tmp_path))
    assert ModelConfig(str(tmp_path)).architectures == ["Mistral3ForConditionalGeneration"]
    runner = make_runner(str(tmp_path))
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_text_weight_names() -> None:
    assert text_weight_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_weight_name("model.language_model.norm.weight") == "model.norm.weight"
    assert text_weight_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_weight_name("lm_head.weight") == "lm_head.weight"
    assert text_weight_name("model.vision_tower.transformer.layers.0.attention.q_proj.weight") is None
    assert text_weight_name("multi_modal_projector.linear_1.weight") is None
