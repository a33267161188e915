"""Phi-3, Gemma 2, Gemma 3, SmolLM3, Granite and GPT-OSS on CUDA (Triton attention and rotary kernels, CUDA-graph
decode): float32 greedy tokens equal transformers' (Phi-3: partial rotation + LongRoPE + a sliding window; Gemma 2:
soft-capped scores and logits; Gemma 3: sliding and full layers, head_dim 256; SmolLM3: layers without rotary;
Granite: its multipliers through the fused paths; GPT-OSS: attention sinks, biased experts; GLM-4 / GLM-4.5: partial
rotation laid out at load; OLMo 2/3: whole-width q/k norms; Cohere: interleaved rotary, q/k LayerNorms, NoPE layers;
Llama 4: chunked attention, temperature-tuned NoPE layers; MiniMax-M2: whole-width q/k norms, partial rotation laid
out at load, sigmoid + correction-bias routing; Seed-OSS: its q/k/v, o_proj and MLP bias flags; EXAONE 4: per-head
q/k norm in the rotary kernel, NoPE layers; Granite MoE: multipliers through the MoE kernels, the shared MLP; Hunyuan:
q/k norms after the rotation, NTK-alpha rotary; Phi-3.5-MoE: biased LayerNorms and LM head, sparsemixer routing;
StarCoder2: biased LayerNorms, biased ungated GELU MLP, sliding window; Nemotron: LayerNorm1P, relu2, partial
rotation laid out at load; Arcee: relu2 MLP in Llama's RMSNorm layer, YaRN; OLMoE: whole-width q/k norms, clip_qkv,
softmax top-k kernels; DBRX: fused Wqkv clamped, bias-free LayerNorms, p-norm routing (p = 1 in the kernels, p = 2
as torch ops); dots.llm1: per-head q/k norms, grouped correction-bias routing, shared experts; Qwen3-Next /
Qwen3.5: Gated DeltaNet states through the decode graphs; Apertus: xIELU MLP in Llama's RMSNorm layer, per-head q/k
norms in the rotary kernel; NanoChat: the reversed rotation laid out at load, q/k norms after it; FlexOlmo:
whole-width q/k norms around the MoE kernels; Phi: the parallel biased-LayerNorm layer, partial rotation laid out at
load; StableLM 2 12B's flags: per-head q/k LayerNorms, parallel residual), and bf16 agrees position by position.
Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import hf_greedy, make_tiny_model, teacher_forced_agreement  # noqa: E402
from test_apertus import apertus  # noqa: E402
from test_arcee import arcee  # noqa: E402
from test_cohere import cohere  # noqa: E402
from test_dbrx import dbrx  # noqa: E402
from test_dots1 import dots1  # noqa: E402
from test_exaone4 import exaone  # noqa: E402
from test_flex_olmo import flex_olmo  # noqa: E402
from test_gemma import gemma3  # noqa: E402
from test_glm4 import glm  # noqa: E402
from test_gpt_oss import gpt_oss  # noqa: E402
from test_granite import granite  # noqa: E402
from test_granitemoe import granite_moe  # noqa: E402
from test_hunyuan import hunyuan  # noqa: E402
from test_llama4 import llama4  # noqa: E402
from test_minimax_m2 import minimax  # noqa: E402
from test_nanochat import nanochat  # noqa: E402
from test_nemotron import BIASED, nemotron  # noqa: E402
from test_olmo2 import olmo  # noqa: E402
from test_olmoe import olmoe  # noqa: E402
from test_phi import phi  # noqa: E402
from test_phi3 import KINDS, PROMPTS, phi3  # noqa: E402
from test_phimoe import phimoe  # noqa: E402
from test_qwen3_next import hybrid  # noqa: E402
from test_seed_oss import FLIPPED, seed_oss  # noqa: E402
from test_smollm3 import smollm3  # noqa: E402
from test_stablelm import V2_12B, stablelm  # noqa: E402
from test_starcoder2 import starcoder2  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402


def gpu_runner(path: str, dtype: str, **kw):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype=dtype, max_total_tokens=1 << 14, max_running_requests=16,
                      cuda_graph_max_bs=16, **kw)
    return ModelRunner(ModelConfig(path), args)


def build(family: str, path: str) -> torch.nn.Module:
    if family == "smollm3":
        return smollm3(path, use_sliding_window=True, sliding_window=5)
    if family == "granite":  # the multipliers through the fused CUDA paths (one-row GEMV + norm, graphs)
        return granite(path)
    if family == "gemma2":  # soft-capped scores in the Triton kernels, under CUDA graphs too
        return gemma3(path, family="gemma2")
    if family == "gpt_oss":  # sinks in the Triton kernels; biased experts through the small-batch and grouped GEMMs
        return gpt_oss(path)
    if family in ("glm4", "glm4_moe"):  # partial rotation (interleaved / neox) laid out at load, fused rotary paths
        return glm(family, path)
    if family in ("olmo2", "olmo3"):  # whole-width q/k norm: the fused rotary / q/k/v paths must stay off
        return olmo(path, family)
    if family in ("cohere_qk", "cohere2"):  # interleaved rotary laid out at load, q/k LayerNorm, NoPE layers
        return cohere(family, path)
    if family == "llama4":  # chunked attention in the Triton kernels (graphs too), input-weighted experts
        return llama4(path)
    if family == "minimax_m2":  # whole-width q/k norm (fused rotary / q/k/v paths off), sigmoid top-k kernels
        return minimax(path)
    if family == "seed_oss":  # o_proj and MLP biases (q/k/v unbiased) through the fused paths
        return seed_oss(path, **FLIPPED)
    if family == "exaone4":  # per-head q/k norm fused into the rotary kernel, on the NoPE table too
        return exaone(path)
    if family in ("granitemoe", "granitemoeshared"):  # multipliers around the small-batch / grouped MoE kernels
        return granite_moe(family, path)
    if family in ("hunyuan", "hunyuan_dense"):  # q/k norms after the (fused CUDA) rotation; fused top-k routers
        return hunyuan(path, moe=family == "hunyuan")
    if family == "phimoe":  # biased LayerNorms, the biased LM head, sparsemixer (torch) routing on CUDA
        return phimoe(path)
    if family == "starcoder2":  # biased LayerNorms (no RMSNorm-fused path), biased ungated MLP, the window in Triton
        return starcoder2(path)
    if family == "nemotron":  # LayerNorm1P, partial rotation laid out at load through the fused rotary paths
        return nemotron(path, **BIASED)
    if family == "arcee":  # Llama's fused RMSNorm paths around an ungated relu2 MLP, YaRN
        return arcee(path)
    if family == "olmoe":  # whole-width q/k norm and the clamp (fused q/k/v + rotary paths off), softmax top-k kernels
        return olmoe(path)
    if family in ("dbrx", "dbrx_p2"):  # the clamp with no fused q/k/v path, LayerNorms; p = 1 kernels or p = 2 torch
        return dbrx(path, p=2.0 if family == "dbrx_p2" else 1.0)
    if family == "dots1":  # per-head q/k norm in the rotary kernel, grouped sigmoid routing, shared experts folded
        return dots1(path)
    if family in ("qwen3_next", "qwen3_5"):  # Gated DeltaNet states in the decode graphs, gated partial-rope attention
        return hybrid(path, family)
    if family == "apertus":  # xIELU around Llama's fused RMSNorm paths, per-head q/k norms in the rotary kernel
        return apertus(path)
    if family == "nanochat":  # the reversed rotation laid out at load; q/k norms after it, K stored by the backend
        return nanochat(path)
    if family == "flex_olmo":  # whole-width q/k norm (fused q/k/v + rotary paths off), softmax top-k kernels
        return flex_olmo(path)
    if family == "phi":  # the parallel layer (LayerNorm, no fused norm path), partial rotation through fused rotary
        return phi(path, share=0.4)
    if family == "stablelm":  # per-head q/k LayerNorms before the rotary kernel, parallel residual
        return stablelm(path, **V2_12B)
    return phi3(path, "longrope", sliding_window=6) if family == "phi3" else gemma3(path, "head256")


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3", "smollm3", "granite", "gpt_oss", "glm4", "glm4_moe",
                                    "olmo2", "olmo3", "cohere_qk", "cohere2", "llama4", "minimax_m2", "seed_oss",
                                    "exaone4", "granitemoe", "granitemoeshared", "hunyuan", "hunyuan_dense",
                                    "phimoe", "starcoder2", "nemotron", "arcee", "olmoe", "dbrx", "dbrx_p2",
                                    "dots1", "qwen3_next", "qwen3_5", "apertus", "nanochat", "flex_olmo", "phi",
                                    "stablelm"])
@pytest.mark.parametrize("graphs", [True, False])
def test_float32_greedy_equals_transformers(family: str, graphs: bool, tmp_path) -> None:
    hf = build(family, str(tmp_path)).to("cuda")
    runner = gpu_runner(str(tmp_path), "float32", disable_cuda_graph=not graphs)
    assert (runner.cuda_graph_runner is not None) == graphs
    assert StaticBatch(runner).generate(PROMPTS, 16) == [hf_greedy(hf, p, 16) for p in PROMPTS]


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3"])
def test_bf16_agrees_with_transformers(family: str, tmp_path) -> None:
    extra = {"phi3": KINDS["partial"],  # Gemma 2: the released models' caps (the tiny tests' low ones flatten logits)
             "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}}.get(family, {})
    hf = make_tiny_model(family, str(tmp_path), hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=4, vocab_size=2048, **extra)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(30.0)  # peaky logits, as in a trained model
    hf.save_pretrained(str(tmp_path))
    hf = hf.to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, 2048, (int(n),), generator=g).tolist() for n in torch.randint(4, 64, (32,), generator=g)]
    exact, near, total = teacher_forced_agreement(hf, gpu_runner(str(tmp_path), "bfloat16"), ps, 32)
    assert (exact + near) / total >= 0.99 and exact / total >= 0.95, f"{exact} exact + {near} near of {total}"
