"""ModelConfig: what the engine needs to know about a model, read once from `config.json` or GGUF metadata."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from radixserve.configs.encoder import encoder_max_tokens, is_encoder
from radixserve.configs.hybrid import kv_layer_count, linear_attention_layers

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# Config keys that different model families use for the longest sequence the model was trained for.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
_DEFAULT_CONTEXT_LEN = 2048


def sliding_window_size(cfg: Any, layer_id: int) -> int:
    """The attention window of layer `layer_id` (a query sees itself and the window - 1 keys before it), or -1 for
    full attention. Read from `sliding_window` (Mistral: every layer), switched off by `use_sliding_window: false`
    (Qwen2/Qwen3), and per layer from `layer_types` ("sliding_attention") or, without it, Qwen2's
    `max_window_layers` (the layers from that index on slide)."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return -1
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens; got {window}")
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_id] == "sliding_attention" else -1
    first = getattr(cfg, "max_window_layers", None)
    if first is not None and hasattr(cfg, "use_sliding_window"):
        return window if layer_id >= first else -1
    return window


# GGUF architectures (llama.cpp's names) whose files this loader would misread: refused before transformers' reader
_REFUSED_GGUF_ARCHS = {"command-r": "Cohere Command-R", "cohere2": "Cohere Command-R7B / Command-A",
                       "gpt-oss": "GPT-OSS", "glm4": "GLM-4", "glm4moe": "GLM-4.5", "olmo2": "OLMo 2 / OLMo 3",
                       "llama4": "Llama 4", "minimax-m2": "MiniMax-M2", "exaone4": "EXAONE 4.0",
                       "granitemoe": "Granite MoE", "hunyuan-moe": "Hunyuan MoE (Hunyuan-A13B)",
                       "hunyuan-dense": "Hunyuan dense", "phimoe": "Phi-3.5-MoE", "starcoder2": "StarCoder2",
                       "nemotron": "Nemotron", "arcee": "Arcee (AFM)", "olmoe": "OLMoE", "dbrx": "DBRX",
                       "dots1": "dots.llm1", "deepseek2": "DeepSeek-V2 / V3 and GLM-4.7-Flash (MLA)",
                       "gemma": "Gemma 1", "apertus": "Apertus", "phi2": "Phi-1 / 1.5 / 2", "stablelm": "StableLM",
                       "qwen3next": "Qwen3-Next"}


def _refuse_gguf_arch(path: str) -> None:
    """Refuse by name the GGUF files of families whose metadata or tensors this loader does not map: Cohere's
    (logit_scale, use_qk_norm, Cohere2's sliding pattern), GPT-OSS's (attention sinks, biased MXFP4 experts: its
    config transformers reads, the model would fail on its tensors only after building), GLM's and OLMo's
    (post-norms, GLM's rotary layout), Llama 4's (chunked attention, NoPE layers, stacked experts), MiniMax-M2's
    (whole-width q/k norms, partial rotation, correction-bias routing: transformers reads its config, no tensor map
    here lays them out), EXAONE 4's (post-norms, NoPE global layers) and Granite MoE's (its multipliers, fused
    experts, the shared MLP), Hunyuan's (q/k norms after the rotation, NTK-alpha rotary) and Phi-3.5-MoE's (biased
    LayerNorms and LM head, sparsemixer routing, LongRoPE mscales), StarCoder2's and Nemotron's (transformers reads
    their configs, but their biased LayerNorms, StarCoder2's c_fc / c_proj MLP, Nemotron's norm weights with
    llama.cpp's + 1 folded in and its partial rotation have no tensor map here), Arcee's (its ungated MLP), OLMoE's
    (whole-width q/k norms, clip_qkv), DBRX's (fused Wqkv with clip_qkv, bias-free LayerNorms, fused w1 / v1 / w2
    experts, p-norm routing), dots.llm1's (correction-bias grouped routing, shared experts, per-head q/k norms),
    llama.cpp's `deepseek2` files (DeepSeek-V2 / V3 and GLM-4.7-Flash: no tensor map here for their latent
    attention), Gemma 1's (norm weights stored with the 1 added), Apertus's (the xIELU activation's learned
    parameters, its ungated MLP), Phi-2's (fused biased q/k/v, the parallel layer's biased LayerNorm, partial
    rotation, the biased LM head) and StableLM's (transformers reads its config, but its biased LayerNorms, partial
    rotation and per-head q/k norms have no tensor map here) and Qwen3-Next's (its linear-attention layers), so that
    a reader that accepted them would not serve another model. An unreadable file is left to the reader's own
    message."""
    from radixserve.model_loader.gguf_loader import gguf_field, open_gguf

    try:
        arch = gguf_field(open_gguf(path), "general.architecture")
    except (ValueError, KeyError, IndexError):
        return
    if arch in _REFUSED_GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF files of {_REFUSED_GGUF_ARCHS[arch]} are not supported by this loader; "
                         f"serve the Hugging Face checkpoint")


def to_torch_dtype(value: Any) -> torch.dtype | None:
    """A torch.dtype from a torch.dtype, a name ("bfloat16", "torch.float16", "fp32") or None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.").lower()
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
        candidate = getattr(torch, name, None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise ValueError(f"unknown dtype {value!r}; expected one of {', '.join(DTYPES[1:])}")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"cannot read {path}: expected a JSON object, got {type(data).__name__}")
    return data


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple | set):
        return {int(v) for v in value if v is not None}
    return set()


class ModelConfig:
    """The model's shape and metadata.

    `path` is a Hugging Face folder holding `config.json`, a `.gguf` file, or None for the embedded
    SmolLM2-135M-Instruct (converted once to a cached safetensors folder).
    """

    def __init__(
        self,
        path: str | None,
        *,
        context_length: int | None = None,
        dtype: str = "auto",
        load_format: str = "auto",
        trust_remote_code: bool = False,
    ) -> None:
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.trust_remote_code = trust_remote_code

        if path is None:
            from radixserve.model_loader.embedded import ensure_embedded_model

            path = ensure_embedded_model()
        self.model_path, self.is_gguf = self._resolve_path(path)
        # A GGUF file carries its own tokenizer; load it with `gguf_file=` (see `tokenizer_gguf_file`).
        self.tokenizer_path = self.model_path

        if load_format == "auto":
            from radixserve.model_loader.weight_utils import checkpoint_format

            load_format = "gguf" if self.is_gguf else checkpoint_format(self.model_path)
        elif load_format == "gguf" and not self.is_gguf:
            raise ValueError(f"load_format 'gguf' needs a .gguf file, got the folder {self.model_path}")
        elif load_format in ("safetensors", "pt") and self.is_gguf:
            raise ValueError(f"load_format {load_format!r} needs a folder, got the GGUF file {self.model_path}")
        self.load_format = load_format

        self.hf_config = self._load_hf_config()
        cfg = self.hf_config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

        archs = list(getattr(cfg, "architectures", None) or [])
        if not archs:
            archs = self._architectures_from_model_type(getattr(cfg, "model_type", None))
            cfg.architectures = archs
        self.architectures: list[str] = archs

        self.hidden_size: int = self._required(text_cfg, "hidden_size")
        self.num_hidden_layers: int = self._required(text_cfg, "num_hidden_layers")
        self.num_attention_heads: int = self._required(text_cfg, "num_attention_heads")
        kv_heads = getattr(text_cfg, "num_key_value_heads", None)
        self.num_key_value_heads: int = int(kv_heads) if kv_heads else self.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None)
        if not head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"{self._config_source}: hidden_size {self.hidden_size} is not divisible by "
                                 f"num_attention_heads {self.num_attention_heads} and head_dim is not set")
            head_dim = self.hidden_size // self.num_attention_heads
        self.head_dim: int = int(head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self._config_source}: num_attention_heads {self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads {self.num_key_value_heads}")
        self.vocab_size: int = self._required(text_cfg, "vocab_size")
        self.tie_word_embeddings: bool = bool(getattr(text_cfg, "tie_word_embeddings", False))

        self.rope_theta, self.rope_scaling = self._rope(text_cfg)
        # Multi-head latent attention (DeepSeek-V2/V3): the KV pool holds kv_lora_rank + qk_rope_head_dim per token
        lora = getattr(text_cfg, "kv_lora_rank", None)
        self.kv_lora_rank: int | None = int(lora) if lora else None
        self.qk_rope_head_dim: int = int(getattr(text_cfg, "qk_rope_head_dim", 0) or 0)
        self.qk_nope_head_dim: int = int(getattr(text_cfg, "qk_nope_head_dim", 0) or 0)
        self.v_head_dim: int = int(getattr(text_cfg, "v_head_dim", 0) or 0) or self.head_dim

        self.context_len: int = self._context_len(text_cfg, context_length)
        self._check_dynamic_rope(text_cfg)
        self.is_encoder: bool = is_encoder(archs)  # BERT / XLM-R embedding models (configs/encoder.py)
        if self.is_encoder:  # no position past the table: the context is what it covers
            self.context_len = min(self.context_len, encoder_max_tokens(text_cfg))
        # hybrid models (Qwen3-Next, Qwen3.5, Granite 4.0, Nemotron-H): their linear-attention / Mamba2 layers hold a
        # recurrent state, not KV, and Nemotron-H's MLP-only layers neither; the attention layers take KV layer ids
        # 0, 1, .. (`models/qwen3_next.py`, `granitemoehybrid.py`, `nemotron_h.py`)
        self.linear_attention_layers: list[int] = linear_attention_layers(text_cfg)
        self.kv_layer_count: int = kv_layer_count(text_cfg, self.num_hidden_layers)
        # per layer: -1 (full attention) or the window in tokens
        self.sliding_windows: list[int] = [sliding_window_size(text_cfg, i) for i in range(self.num_hidden_layers)]

        # transformers 5 names it `dtype` (reading `torch_dtype` there warns); older releases `torch_dtype`
        raw_dtype = getattr(cfg, "dtype", None) if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)
        self.torch_dtype: torch.dtype = to_torch_dtype(raw_dtype) or torch.float32
        self.eos_token_ids: set[int] = self._eos_token_ids(text_cfg)

    # ------------------------------------------------------------------ public helpers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def attention_shape(self, tp_size: int = 1) -> tuple[int, int, int, int]:
        """(query heads, KV heads, q/k head dim, v head dim) per TP rank, as the attention backend sees them: for
        MLA, multi-query attention over the latent (k = latent + rope, v = latent)."""
        heads = self.num_attention_heads // tp_size
        if self.is_mla:
            return heads, 1, self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
        return heads, max(1, self.num_key_value_heads // tp_size), self.head_dim, self.head_dim

    @property
    def tokenizer_gguf_file(self) -> str | None:
        """The GGUF file name to pass as `gguf_file=` when the tokenizer lives in a GGUF, else None."""
        return os.path.basename(self.model_path) if self.is_gguf else None

    def __repr__(self) -> str:
        return (f"ModelConfig(model_path={self.model_path!r}, architectures={self.architectures}, "
                f"layers={self.num_hidden_layers}, hidden={self.hidden_size}, heads={self.num_attention_heads}/"
                f"{self.num_key_value_heads}x{self.head_dim}, vocab={self.vocab_size}, context_len={self.context_len})")

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _resolve_path(path: str) -> tuple[str, bool]:
        path = os.path.abspath(os.path.expanduser(str(path)))
        if not os.path.exists(path):
            raise ValueError(f"model path does not exist: {path} (expected a local Hugging Face folder with "
                             f"config.json or a .gguf file; hub ids are not downloaded)")
        if os.path.isfile(path):
            if not path.lower().endswith(".gguf"):
                raise ValueError(f"model path {path} is a file but not a .gguf file; pass the model folder instead")
            return path, True
        if os.path.isfile(os.path.join(path, "config.json")):
            return path, False
        ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            logger.info("no config.json in %s; loading its only GGUF file %s", path, ggufs[0])
            return os.path.join(path, ggufs[0]), True
        hint = f" (it holds several .gguf files: {', '.join(ggufs)}; pass one of them)" if ggufs else ""
        raise ValueError(f"no config.json in model folder {path}{hint}")

    @property
    def _config_source(self) -> str:
        return self.model_path if self.is_gguf else os.path.join(self.model_path, "config.json")

    def _load_hf_config(self) -> Any:
        from transformers import AutoConfig

        if self.is_gguf:
            folder, name = os.path.split(self.model_path)
            _refuse_gguf_arch(self.model_path)
            try:
                config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=self.trust_remote_code)
            except Exception as e:
                raise ValueError(f"cannot read the model config from GGUF file {self.model_path}: {e}") from e
            unmapped = {"phi3": "Phi-3 / Phi-4 (fused q/k/v and gate/up tensors, LongRoPE factors)",
                        "gemma2": "Gemma 2 (norms stored with the 1 added, four norms a layer)",
                        "gemma3": "Gemma 3 (norms stored with the 1 added, four norms a layer)",
                        "gemma3_text": "Gemma 3 (norms stored with the 1 added, four norms a layer)"}
            what = unmapped.get(getattr(config, "model_type", None))
            if what is not None:
                raise ValueError(f"{self.model_path}: GGUF files of {what} are not supported by this loader; serve "
                                 f"the Hugging Face checkpoint")
            from radixserve.model_loader.gguf_loader import (
                open_gguf,
                patch_llama_experts_config,
                patch_moe_config,
                patch_rope_config,
            )

            reader = open_gguf(self.model_path)
            if getattr(config, "num_experts", None):  # an MoE file: the expert sizes transformers leaves out
                patch_moe_config(config, reader)
            try:  # what transformers' reader drops: Mixtral's experts ("llama" files), RoPE scaling (Llama 3.x's
                patch_llama_experts_config(config, reader)  # rope_freqs tensor, rope.scaling.*)
                patch_rope_config(config, reader)
            except ValueError as e:
                raise ValueError(f"{self.model_path}: {e}") from e
            return config
        config_file = os.path.join(self.model_path, "config.json")
        _read_json(config_file)  # a clear message for a broken file before transformers' own
        try:
            return AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        except Exception as e:
            raise ValueError(f"cannot read the model config {config_file}: {e}") from e

    def _required(self, cfg: Any, name: str) -> int:
        value = getattr(cfg, name, None)
        if value is None:
            raise ValueError(f"{self._config_source}: '{name}' is missing from the model config")
        try:
            value = int(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self._config_source}: '{name}' must be an integer, got {value!r}") from e
        if value <= 0:
            raise ValueError(f"{self._config_source}: '{name}' must be positive, got {value}")
        return value

    def _architectures_from_model_type(self, model_type: str | None) -> list[str]:
        """GGUF-derived configs carry a model_type but no architectures; name the causal-LM class for it."""
        if not model_type:
            raise ValueError(f"{self._config_source}: the config names neither 'architectures' nor 'model_type'")
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if arch is None:
            raise ValueError(f"{self._config_source}: no causal-LM architecture known for model_type {model_type!r}")
        return [arch]

    @staticmethod
    def _rope(cfg: Any) -> tuple[float, dict[str, Any] | None]:
        """(rope_theta, rope_scaling) whether the config keeps them flat (transformers 4) or in
        `rope_parameters` (transformers 5). rope_scaling is None for plain RoPE."""
        params = getattr(cfg, "rope_parameters", None) or {}
        if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
            # per-layer-type parameters (e.g. {"full_attention": {...}, "sliding_attention": {...}})
            params = params.get("full_attention") or next(iter(params.values()))
        params = dict(params) if isinstance(params, dict) else {}
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
        theta = float(theta) if theta is not None else 10000.0
        scaling = getattr(cfg, "rope_scaling", None)
        if not isinstance(scaling, dict) or not scaling:
            scaling = params
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type in ("default", "mrope") or not rope_type:  # mrope: Qwen-VL's, 1-D on text (models/qwen_vl.py)
            return theta, None
        scaling.setdefault("rope_type", rope_type)
        return theta, scaling

    def _context_len(self, cfg: Any, override: int | None) -> int:
        model_len = None
        for key in _CONTEXT_KEYS:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                model_len = value
                break
        if override is None:
            if model_len is None:
                logger.warning("%s names no maximum sequence length; using %d", self._config_source,
                               _DEFAULT_CONTEXT_LEN)
                return _DEFAULT_CONTEXT_LEN
            return model_len
        if isinstance(override, bool) or not isinstance(override, int) or override <= 0:
            raise ValueError(f"context_length must be a positive integer, got {override!r}")
        if model_len is not None and override > model_len:
            logger.warning("context_length %d is larger than the model's %d (%s); outputs past %d tokens may be "
                           "poor", override, model_len, self._config_source, model_len)
        return override

    def _check_dynamic_rope(self, cfg: Any) -> None:
        """Dynamic NTK rope scaling (InternLM3's): transformers rotates with the config's frequencies while a
        sequence stays within the original context and rescales every position's once it grows past it, which keys
        already in a KV cache cannot follow; so the served context stops at the original one."""
        if (self.rope_scaling or {}).get("rope_type") != "dynamic":
            return
        limit = self.rope_scaling.get("original_max_position_embeddings") or getattr(cfg, "max_position_embeddings",
                                                                                      None)
        if limit and self.context_len > int(limit):
            raise ValueError(f"context_length {self.context_len} is past {int(limit)} positions, where dynamic NTK "
                             f"rope scaling (rope_type 'dynamic') would change the rotation of every cached key; "
                             f"serve at most {int(limit)} tokens (--context-length {int(limit)})")

    def _eos_token_ids(self, cfg: Any) -> set[int]:
        ids = _as_id_set(getattr(cfg, "eos_token_id", None))
        if not self.is_gguf:
            gen_file = os.path.join(self.model_path, "generation_config.json")
            if os.path.isfile(gen_file):
                try:
                    ids |= _as_id_set(_read_json(gen_file).get("eos_token_id"))
                except ValueError as e:
                    logger.warning("ignoring %s", e)
        return ids
