"""Helpers for tests that run tiny random HF models through radixserve and through transformers."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import Any

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)


def load_benchmark(name: str) -> ModuleType:
    """Import benchmarks/<name>.py (the folder is not a package) as a module."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {script}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tiny_model(kind: str, path: str, seed: int = 0, **over: Any) -> Any:
    """Build a random HF model of `kind` (llama, qwen2, qwen3, llama3-rope, phi3, smollm3, granite, gemma2, gemma3,
    gpt_oss, cohere, cohere2, glm4, glm4_moe, olmo2, olmo3, ernie4_5, ernie4_5_moe, minimax_m2, seed_oss, exaone4,
    granitemoe, granitemoeshared, or one of MOE_KINDS), save it to `path`, return it."""
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
    elif kind == "phi3":
        cfg = tf.Phi3Config(**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif kind == "granite":  # multipliers far from 1, so that each shows
        cfg = tf.GraniteConfig(**{"embedding_multiplier": 6.0, "attention_multiplier": 0.05, "residual_multiplier": 0.4,
                                  "logits_scaling": 4.0, "tie_word_embeddings": True, **kw})
    elif kind == "smollm3":  # every fourth layer without rotary
        cfg = tf.SmolLM3Config(**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif kind == "gemma2":  # every second layer slides, as the real ones; caps low enough to matter here
        cfg = tf.Gemma2Config(**{"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 5,
                                 "attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.5, **kw})
    elif kind == "gemma3":  # every second layer slides (the real pattern is 5 of 6)
        kw.pop("rope_theta")
        cfg = tf.Gemma3TextConfig(**{"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 5,
                                     "sliding_window_pattern": 2, **kw})
    elif kind == "gpt_oss":  # sliding and full layers alternating, YaRN as the released models (scaled down)
        kw.pop("rope_theta")
        cfg = tf.GptOssConfig(**{**kw, "intermediate_size": 64}, head_dim=16, num_local_experts=8,
                              num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.5, tie_word_embeddings=False,
                              layer_types=["sliding_attention", "full_attention"] * (kw["num_hidden_layers"] // 2),
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 128})
        cfg._attn_implementation = "eager"  # the reference that spells the sinks out
    elif kind in ("cohere", "cohere2"):  # Command-R / R7B: LayerNorm, parallel blocks; Cohere2: layers 0, 2, .. slide
        kw["layer_norm_eps"] = kw.pop("rms_norm_eps")
        ids = {"logit_scale": 4.0, "bos_token_id": 1, "eos_token_id": 2}
        cfg = (tf.CohereConfig(**{**ids, **kw}) if kind == "cohere" else
               tf.Cohere2Config(**{**ids, "sliding_window": 5, "sliding_window_pattern": 2, **kw}))
    elif kind == "glm4":  # GLM-4-0414: interleaved partial rotation, four norms a layer, q/k/v bias
        cfg = tf.Glm4Config(**kw, head_dim=32, attention_bias=True, pad_token_id=0, tie_word_embeddings=False)
    elif kind == "glm4_moe":  # GLM-4.5: neox partial rotation, q/k norm, sigmoid + correction-bias grouped top-k
        cfg = tf.Glm4MoeConfig(**kw, head_dim=32, attention_bias=True, use_qk_norm=True, moe_intermediate_size=32,
                               n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                               n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                               norm_topk_prob=True, tie_word_embeddings=False)
    elif kind == "olmo2":  # post-norms only, q/k normed over all their heads
        cfg = tf.Olmo2Config(**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    elif kind == "olmo3":  # OLMo 2 + sliding and full layers alternating, YaRN on the full ones (scaled down)
        cfg = tf.Olmo3Config(**kw, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=5,
                             layer_types=["sliding_attention", "full_attention"] * (kw["num_hidden_layers"] // 2),
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                           "beta_fast": 32.0, "beta_slow": 1.0})
    elif kind in ("ernie4_5", "ernie4_5_moe"):  # interleaved rotation; MoE: softmax + correction-bias top-k
        theta = kw.pop("rope_theta")
        common = dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": theta}, pad_token_id=0)
        cfg = (tf.Ernie4_5Config(**kw, **common, use_bias=True, tie_word_embeddings=True) if kind == "ernie4_5" else
               tf.Ernie4_5_MoeConfig(**kw, **common, moe_intermediate_size=32, moe_num_experts=8, moe_k=3,
                                     moe_num_shared_experts=2, moe_layer_start_index=1, tie_word_embeddings=False))
    elif kind == "minimax_m2":  # whole-width q/k norm, partial neox rotation, sigmoid + correction-bias top-k
        cfg = tf.MiniMaxM2Config(**{**kw, "intermediate_size": 32}, head_dim=32, rotary_dim=16, num_local_experts=8,
                                 num_experts_per_tok=3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        # transformers before 5.2x ignore the released checkpoints' `rotary_dim` (their reference then rotates the
        # whole head): state the partial rotation in their form too, as 5.2x derives it
        cfg.rope_parameters = {**(cfg.rope_parameters or {}), "partial_rotary_factor": 16 / 32}
        cfg.partial_rotary_factor = 16 / 32
    elif kind == "seed_oss":  # Llama with q/k/v biases (o_proj's and the MLP's off, as released), head_dim set
        cfg = tf.SeedOssConfig(**{"attention_bias": True, "attention_out_bias": False, "mlp_bias": False, **kw},
                               head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    elif kind == "exaone4":  # post-norms, per-head q/k norm; layers 0, 2, .. slide and rotate, 1, 3, .. are NoPE
        theta = kw.pop("rope_theta")
        cfg = tf.Exaone4Config(**{"sliding_window": 5, "sliding_window_pattern": 2, "pad_token_id": 0,
                                  "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": theta}, **kw})
    elif kind in ("granitemoe", "granitemoeshared"):  # Granite's multipliers far from 1; 8 experts, top 2
        theta = kw.pop("rope_theta")
        common = {"embedding_multiplier": 6.0, "attention_multiplier": 0.05, "residual_multiplier": 0.4,
                  "logits_scaling": 4.0, "tie_word_embeddings": True, "num_local_experts": 8,
                  "num_experts_per_tok": 2, "pad_token_id": 0,
                  "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                  **kw, "intermediate_size": kw["intermediate_size"] // 4}
        cfg = (tf.GraniteMoeConfig(**common) if kind == "granitemoe" else
               tf.GraniteMoeSharedConfig(**{"shared_intermediate_size": 48, **common}))
    elif kind in MOE_KINDS:
        cfg = moe_config(kind, kw)
    else:
        raise ValueError(kind)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    if kind == "gpt_oss":  # transformers before 5.18 clamp at a fixed 7.0, not the config's swiglu_limit
        for layer in model.model.layers:
            layer.mlp.experts.limit = cfg.swiglu_limit
    with torch.no_grad():  # make biases and norms non-trivial so a dropped term is visible
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith((".bias", "_proj_bias")):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight",
                              "block_sparse_moe.router.weight")):
                p.mul_(40.0)  # routers with clear winners: no near-tie between two experts decides a token
            if name.endswith(("e_score_correction_bias", "self_attn.sinks")):
                p.copy_(torch.randn_like(p) * 0.5)
        for name, b in model.named_buffers():  # transformers 5 holds DeepSeek-V3's correction bias as a buffer
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
    model.save_pretrained(path)
    return model


MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v2_lora", "deepseek_v2_group",
             "deepseek_v3", "deepseek_v3_yarn")


def moe_config(kind: str, kw: dict[str, Any]) -> Any:
    """Tiny MoE / MLA configs: 8 experts (an uneven vocabulary of routes), k = 2 (DeepSeek-V3: 3 of 8 in 4 groups)."""
    import transformers as tf

    kw = dict(kw)
    inter = kw.pop("intermediate_size")
    if kind == "mixtral":
        return tf.MixtralConfig(**kw, intermediate_size=inter // 2, num_local_experts=8, num_experts_per_tok=2,
                                tie_word_embeddings=False)
    if kind == "qwen2_moe":
        only = kw.pop("mlp_only_layers", [1])
        return tf.Qwen2MoeConfig(**kw, intermediate_size=inter, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                 mlp_only_layers=only, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**kw, intermediate_size=inter, moe_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True, head_dim=32, tie_word_embeddings=False)
    kw.pop("num_key_value_heads")
    mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=None,
               moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, first_k_dense_replace=1,
               intermediate_size=inter, num_key_value_heads=kw["num_attention_heads"], tie_word_embeddings=False)
    if kind == "deepseek_v2":
        return tf.DeepseekV2Config(**kw, **mla, num_experts_per_tok=2, topk_method="greedy")
    if kind == "deepseek_v2_lora":
        return tf.DeepseekV2Config(**kw, **{**mla, "q_lora_rank": 48}, num_experts_per_tok=2, topk_method="greedy",
                                   routed_scaling_factor=1.5)
    if kind == "deepseek_v2_group":
        return tf.DeepseekV2Config(**kw, **mla, num_experts_per_tok=2, topk_method="group_limited_greedy",
                                   n_group=4, topk_group=1)  # one group: a choice plain top-2 would not make
    if kind == "deepseek_v3":
        return tf.DeepseekV3Config(**kw, **{**mla, "q_lora_rank": 48}, num_experts_per_tok=3, n_group=4, topk_group=2,
                                   norm_topk_prob=True, routed_scaling_factor=2.5)
    if kind == "deepseek_v3_yarn":
        kw["rope_scaling"] = {"rope_type": "yarn", "factor": kw["max_position_embeddings"] / 64,
                              "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                              "mscale": 1.0, "mscale_all_dim": 0.707}  # cos/sin and the softmax scale both change
        return tf.DeepseekV3Config(**kw, **mla, num_experts_per_tok=2, n_group=2, topk_group=1,
                                   norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=False)
    raise ValueError(kind)


def stub_gguf(path: str, arch: str) -> str:
    """A one-tensor GGUF file of llama.cpp architecture `arch` at `path`: enough for a refusal by name to read."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def make_runner(path: str, dtype_override: str = "float32", **server_kw: Any) -> Any:
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    kw: dict[str, Any] = dict(device="cpu", dtype=dtype_override, max_total_tokens=4096, max_running_requests=16)
    args = ServerArgs(model_path=path, **{**kw, **server_kw})
    return ModelRunner(ModelConfig(path), args)


def peaky_tiny_model(kind: str, path: str) -> Any:
    """A small random model whose next token is usually decided by a margin, as in a trained model: random init
    gives nearly flat logits, so the output layer is scaled up before saving."""
    hf = make_tiny_model(kind, path, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=4, vocab_size=2048)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(30.0)
    hf.save_pretrained(path)
    return hf


def teacher_forced_agreement(hf: Any, runner: Any, prompts: list[list[int]], steps: int) -> tuple[int, int, int]:
    """Greedy agreement with transformers in low precision, free of compounding: HF generates `steps` tokens per
    prompt; radixserve prefills prompt + those tokens once and reports its top-1 prediction at every position (prompt
    logprobs). Returns (exact matches, near-ties, total): a near-tie is a mismatch where HF's own logits rank the
    two tokens within 1% of the largest |logit| — rounding decides those, not the model."""
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.managers.tp_worker import run_model_worker_batch
    from radixserve.sampling.sampling_params import SamplingParams

    device = next(hf.parameters()).device
    exact = near = total = 0
    for prompt in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            seq = prompt + ref
            hf_logits = hf(torch.tensor([seq], device=device)).logits[0, len(prompt) - 1:-1].float().cpu()
        req = Req("t", seq, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1}), return_logprob=True,
                  logprob_start_len=len(prompt) - 1, top_logprobs_num=1)
        req.init_next_round_input(None)
        batch = ScheduleBatch([req], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device,
                              runner.model_config.vocab_size)
        batch.prepare_for_extend()
        result = run_model_worker_batch(runner, batch.get_model_worker_batch())
        ours = result.logits_output.input_top_logprobs_idx[0][:, 0].tolist()
        for j, (got, want) in enumerate(zip(ours, ref, strict=True)):
            total += 1
            if got == want:
                exact += 1
            elif hf_logits[j, want] - hf_logits[j, got] < 0.01 * hf_logits[j].abs().max():
                near += 1
        runner.token_to_kv_pool.free(runner.req_to_token_pool.read(req.req_pool_idx, 0, req.kv_committed_len))
        runner.req_to_token_pool.free(req.req_pool_idx)
    return exact, near, total


def rewrite_checkpoint(path: str, convert: Any, extra: dict[str, torch.Tensor] | None = None) -> str:
    """Rewrite the model saved at `path` tensor by tensor as a quantized checkpoint: `convert(name, tensor)` gives
    the tensors to store for it ({name: tensor}) and its dequantised form, or None to keep it as it is; `extra`
    tensors are stored too. The dequantised weights are saved with the other files in `path`/deq (returned), for a
    transformers reference."""
    import shutil

    from safetensors.torch import load_file, save_file

    deq_dir = os.path.join(path, "deq")
    os.makedirs(deq_dir)
    for f in os.listdir(path):
        if f.endswith(".json"):
            shutil.copy(os.path.join(path, f), deq_dir)
    out, deq = {}, {}
    for name, t in load_file(os.path.join(path, "model.safetensors")).items():
        converted = convert(name, t)
        if converted is None:
            out[name] = deq[name] = t
        else:
            out.update(converted[0])
            deq[name] = converted[1]
    out.update(extra or {})
    save_file(out, os.path.join(path, "model.safetensors"))
    save_file(deq, os.path.join(deq_dir, "model.safetensors"))
    return deq_dir


def set_quantization_config(path: str, qc: dict[str, Any] | None) -> None:
    """Write `qc` as the `quantization_config` of the model saved at `path` (None removes it)."""
    import json

    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


# prompts for `scheduler_waves`: two share an 11-token head (so the second wave's hits it in the radix cache), one
# long prompt crosses several 5-token chunks
SHARED_HEAD = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]
WAVE_PROMPTS = [SHARED_HEAD + [40, 41], SHARED_HEAD + [50], [200, 100, 50, 25, 12, 6, 3, 1, 9, 10, 11, 12, 13, 30, 31,
                                                              32, 33, 34, 35, 36, 37], SHARED_HEAD + [60, 61, 62, 63]]


def scheduler_waves(path: str, prompts: list[list[int]] | None = None, max_new_tokens: int = 12,
                    expect_hits: bool = True, **server_kw: Any) -> list[list[int]]:
    """Greedy tokens of `prompts` (default WAVE_PROMPTS) through one CPU float32 Scheduler with 5-token chunked
    prefill and mixed chunks: the first half runs to its end before the second half is sent, so the second finds
    the first's prefixes cached. Checks that the cache was hit (unless not `expect_hits`: a model served without
    the prefix cache) and the memory accounting holds."""
    from radixserve.managers import io_struct as io
    from radixserve.managers.scheduler import Scheduler
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

    prompts = WAVE_PROMPTS if prompts is None else prompts
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", max_total_tokens=2048, skip_tokenizer_init=True,
                              chunked_prefill_size=5, enable_mixed_chunk=True)
    s = Scheduler(ServerArgs(model_path=path, **{**kw, **server_kw}), port_args={})
    got: dict[str, list[int]] = {}
    half = len(prompts) // 2
    for first, wave in ((0, prompts[:half]), (half, prompts[half:])):
        for i, p in enumerate(wave):
            s.process_input_requests([io.TokenizedGenerateReqInput(
                rid=str(first + i), input_text=None, input_ids=p, sampling_params=SamplingParams.from_dict(
                    {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}))])
        while s.step() or not s.is_idle():
            pass
        for msg in s.outbox:
            for rid, ids in zip(msg.rids, msg.new_token_ids, strict=True):
                got.setdefault(rid, []).extend(ids)
        s.outbox.clear()
    assert (s.cache_hit_tokens > 0) == expect_hits and s.check_memory()
    return [got[str(i)] for i in range(len(prompts))]
