"""Greedy outputs token-identical to transformers on tiny random models and on the embedded SmolLM2."""

from __future__ import annotations

import pytest
import torch
from model_utils import hf_greedy, make_runner, make_tiny_model

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3], [200, 100, 50, 25, 12, 6, 3, 1, 9, 10, 11, 12, 13]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama3-rope"])
def test_greedy_matches_transformers(kind: str, tmp_path) -> None:
    hf = make_tiny_model(kind, str(tmp_path))
    runner = make_runner(str(tmp_path))
    ours = StaticBatch(runner).generate(PROMPTS, 24)  # the three prompts batched together
    for prompt, got in zip(PROMPTS, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 24), f"{kind}: prompt {prompt}"
    assert runner.token_to_kv_pool.available_size() == runner.token_to_kv_pool.size


def test_prefill_logits_match_transformers(tmp_path) -> None:
    hf = make_tiny_model("qwen2", str(tmp_path))
    runner = make_runner(str(tmp_path))
    sb = StaticBatch(runner)
    batch, _ = sb.prefill([PROMPTS[2]])
    ours = sb.last_logits.next_token_logits[0]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    sb.release(batch)


def test_extend_on_cached_prefix_equals_full_prefill(tmp_path) -> None:
    """Prefill a prefix, then extend the rest on top of its KV: the logits equal one full prefill."""
    make_tiny_model("llama", str(tmp_path))
    runner = make_runner(str(tmp_path))
    sb = StaticBatch(runner)
    full = PROMPTS[2]
    batch, _ = sb.prefill([full])
    ref = sb.last_logits.next_token_logits[0].clone()
    sb.release(batch)

    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.sampling.sampling_params import SamplingParams

    head, tail = full[:8], full[8:]
    batch, _ = sb.prefill([head])
    req = batch.reqs[0]
    prefix_slots = runner.req_to_token_pool.read(req.req_pool_idx, 0, len(head))
    runner.req_to_token_pool.free(req.req_pool_idx)
    r2 = Req("x", full, SamplingParams.from_dict({"temperature": 0}))
    r2.prefix_indices = prefix_slots
    r2.fill_ids = list(full)
    r2.extend_input_len = len(tail)
    b2 = ScheduleBatch([r2], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device,
                       runner.model_config.vocab_size)
    b2.prepare_for_extend()
    assert b2.prefix_lens == [8] and b2.extend_lens == [len(tail)]
    sb._run(b2)
    torch.testing.assert_close(sb.last_logits.next_token_logits[0], ref, atol=1e-5, rtol=1e-5)


def test_batch_equals_each_alone(tmp_path) -> None:
    make_tiny_model("qwen3", str(tmp_path))
    runner = make_runner(str(tmp_path))
    together = StaticBatch(runner).generate(PROMPTS, 12)
    alone = [StaticBatch(runner).generate([p], 12)[0] for p in PROMPTS]
    assert together == alone


def test_embedded_smollm2_matches_transformers_and_knows_paris(embedded_model_path) -> None:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(embedded_model_path)
    hf = tf.AutoModelForCausalLM.from_pretrained(embedded_model_path, dtype=torch.float32).eval()
    runner = make_runner(embedded_model_path)
    questions = ["What is the capital of France?", "What is 2 + 2?"]
    prompts = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    ours = StaticBatch(runner).generate(prompts, 16)
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 16)
    assert "Paris" in tok.decode(ours[0])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_greedy_agrees_with_transformers_teacher_forced(kind: str, tmp_path) -> None:
    """bf16 on the CPU: every position's greedy choice matches transformers', or the two are a near-tie in
    transformers' own logits (the same check runs on CUDA in tests/gpu)."""
    from model_utils import peaky_tiny_model, teacher_forced_agreement

    hf = peaky_tiny_model(kind, str(tmp_path)).to(torch.bfloat16)
    runner = make_runner(str(tmp_path), dtype_override="bfloat16")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2048, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(12)]
    exact, near, total = teacher_forced_agreement(hf, runner, prompts, 24)
    assert (exact + near) / total >= 0.99, f"{exact} exact + {near} near-ties of {total}"
    assert exact / total >= 0.95


def test_greedy_matches_transformers_at_a_dozen_rows(tmp_path) -> None:
    """Twelve requests in one batch: prefill and decode run the linears through the oneDNN-reordered weights (above a
    few rows) and the tail through the small-batch kernel; every output still token-identical to transformers."""
    from radixserve.layers import cpu_ops

    hf = make_tiny_model("llama", str(tmp_path))
    runner = make_runner(str(tmp_path))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (12,), generator=g)]
    ours = StaticBatch(runner).generate(prompts, 16)
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 16), f"prompt {prompt}"
    if cpu_ops.PACKED and torch.backends.mkldnn.is_available():
        weight = runner.model.model.layers[0].mlp.gate_up_proj.weight
        assert getattr(weight, cpu_ops._PACKED_ATTR)[1] is not None
    assert runner.token_to_kv_pool.available_size() == runner.token_to_kv_pool.size


@pytest.mark.parametrize("kind", ["llama", "deepseek_v2"])
def test_context_length_past_max_position_embeddings_matches_transformers(kind: str, tmp_path) -> None:
    """A context length above the config's max_position_embeddings (allowed, with a warning): the rotary tables cover
    the served context, and a prompt reaching past max_position_embeddings (64 here) decodes as transformers does,
    which computes RoPE at any position (the tables held max_position_embeddings positions: the CPU kernel raised,
    CUDA read past their end). The sizes are small because DeepSeek-V2's prefill runs its MLA kernels under the
    Triton interpreter on the CPU: what matters is only that the prompt and decode pass max_position_embeddings."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    max_pos, context = 64, 128
    hf = make_tiny_model(kind, str(tmp_path), initializer_range=0.08, max_position_embeddings=max_pos)
    args = ServerArgs(model_path=str(tmp_path), device="cpu", dtype="float32", max_total_tokens=2048,
                      max_running_requests=4, context_length=context)
    runner = ModelRunner(ModelConfig(str(tmp_path), context_length=context), args)
    prompt = [(7 * i + 3) % 250 + 2 for i in range(max_pos + 16)]
    assert StaticBatch(runner).generate([prompt], 8)[0] == hf_greedy(hf, prompt, 8)
    if kind == "llama":  # one set of tables for every layer (identical), covering the served context
        rotaries = {id(layer.self_attn.rotary_emb) for layer in runner.model.model.layers}
        assert len(rotaries) == 1 and runner.model.model.layers[1].self_attn.rotary_emb.cos_cache.shape[0] >= context


@pytest.mark.parametrize("kind", ["llama", "deepseek_v2"])
def test_unsupported_hidden_act_is_refused(kind: str, tmp_path) -> None:
    """The MLPs compute SiLU-gated products: a config naming another activation is refused by name, not served with
    SiLU in its place (a Llama with hidden_act gelu loaded and answered differently from transformers)."""
    make_tiny_model(kind, str(tmp_path), hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        make_runner(str(tmp_path))
