"""Model classes by the `architectures` name of config.json, imported only when asked for."""

from __future__ import annotations

import importlib

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "radixserve.models.llama",
    "MistralForCausalLM": "radixserve.models.llama",
    "Mistral3ForConditionalGeneration": "radixserve.models.llama",
    "CwmForCausalLM": "radixserve.models.llama",
    "InternLM3ForCausalLM": "radixserve.models.llama",
    "Llama4ForCausalLM": "radixserve.models.llama4",
    "Llama4ForConditionalGeneration": "radixserve.models.llama4",
    "PhiForCausalLM": "radixserve.models.phi",
    "Phi3ForCausalLM": "radixserve.models.phi3",
    "StableLmForCausalLM": "radixserve.models.stablelm",
    "GraniteForCausalLM": "radixserve.models.granite",
    "GraniteMoeForCausalLM": "radixserve.models.granitemoe",
    "GraniteMoeSharedForCausalLM": "radixserve.models.granitemoe",
    "GraniteMoeHybridForCausalLM": "radixserve.models.granitemoehybrid",
    "SmolLM3ForCausalLM": "radixserve.models.smollm3",
    "CohereForCausalLM": "radixserve.models.cohere",
    "Cohere2ForCausalLM": "radixserve.models.cohere",
    "GemmaForCausalLM": "radixserve.models.gemma",
    "Gemma2ForCausalLM": "radixserve.models.gemma",
    "Gemma3ForCausalLM": "radixserve.models.gemma",
    "Gemma3ForConditionalGeneration": "radixserve.models.gemma",
    "Qwen2ForCausalLM": "radixserve.models.qwen2",
    "Qwen3ForCausalLM": "radixserve.models.qwen3",
    "Qwen2VLForConditionalGeneration": "radixserve.models.qwen_vl",
    "Qwen2_5_VLForConditionalGeneration": "radixserve.models.qwen_vl",
    "Qwen3VLForConditionalGeneration": "radixserve.models.qwen_vl",
    "MixtralForCausalLM": "radixserve.models.mixtral",
    "Qwen2MoeForCausalLM": "radixserve.models.qwen2_moe",
    "Qwen3MoeForCausalLM": "radixserve.models.qwen3_moe",
    "Qwen3NextForCausalLM": "radixserve.models.qwen3_next",
    "Qwen3_5ForCausalLM": "radixserve.models.qwen3_next",
    "Qwen3_5MoeForCausalLM": "radixserve.models.qwen3_next",
    "Qwen3_5ForConditionalGeneration": "radixserve.models.qwen3_next",
    "Qwen3_5MoeForConditionalGeneration": "radixserve.models.qwen3_next",
    "GptOssForCausalLM": "radixserve.models.gpt_oss",
    "DeepseekV2ForCausalLM": "radixserve.models.deepseek_v2",
    "DeepseekV3ForCausalLM": "radixserve.models.deepseek_v2",
    "Glm4ForCausalLM": "radixserve.models.glm4",
    "Glm4MoeForCausalLM": "radixserve.models.glm4",
    "Glm4MoeLiteForCausalLM": "radixserve.models.glm4",
    "Olmo2ForCausalLM": "radixserve.models.olmo2",
    "Olmo3ForCausalLM": "radixserve.models.olmo2",
    "Ernie4_5ForCausalLM": "radixserve.models.ernie4_5",
    "Ernie4_5_MoeForCausalLM": "radixserve.models.ernie4_5",
    "Exaone4ForCausalLM": "radixserve.models.exaone4",
    "HunYuanDenseV1ForCausalLM": "radixserve.models.hunyuan",
    "HunYuanMoEV1ForCausalLM": "radixserve.models.hunyuan",
    "PhimoeForCausalLM": "radixserve.models.phimoe",
    "PhiMoEForCausalLM": "radixserve.models.phimoe",  # the hub checkpoints' (remote-code) name
    "Starcoder2ForCausalLM": "radixserve.models.starcoder2",
    "NemotronForCausalLM": "radixserve.models.nemotron",
    "NemotronHForCausalLM": "radixserve.models.nemotron_h",
    "ArceeForCausalLM": "radixserve.models.arcee",
    "ApertusForCausalLM": "radixserve.models.apertus",
    "NanoChatForCausalLM": "radixserve.models.nanochat",
    "MiniMaxM2ForCausalLM": "radixserve.models.minimax_m2",
    "SeedOssForCausalLM": "radixserve.models.seed_oss",
    "OlmoeForCausalLM": "radixserve.models.olmoe",
    "FlexOlmoForCausalLM": "radixserve.models.flex_olmo",
    "DbrxForCausalLM": "radixserve.models.dbrx",
    "Dots1ForCausalLM": "radixserve.models.dots1",
    "BertModel": "radixserve.models.bert",  # encoders: embeddings only (configs/encoder.py)
    "BertForMaskedLM": "radixserve.models.bert",
    "RobertaModel": "radixserve.models.bert",
    "RobertaForMaskedLM": "radixserve.models.bert",
    "XLMRobertaModel": "radixserve.models.bert",
    "XLMRobertaForMaskedLM": "radixserve.models.bert",
    "BertForSequenceClassification": "radixserve.models.bert_rerank",  # cross-encoders: /v1/rerank, /v1/score
    "RobertaForSequenceClassification": "radixserve.models.bert_rerank",
    "XLMRobertaForSequenceClassification": "radixserve.models.bert_rerank",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str]) -> type:
    for arch in architectures or []:
        if arch in _MODELS:
            return getattr(importlib.import_module(_MODELS[arch]), arch)
    raise ValueError(f"model architecture(s) {architectures} not supported; supported: "
                     f"{', '.join(supported_architectures())}")
