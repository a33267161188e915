"""DeepSeek-V2/V3 (multi-head latent attention + DeepSeek-MoE) greedy token-identical to transformers in float32:
q_lora_rank None and set, plain / group-limited / corrected-sigmoid grouped routing, interleaved and neox rotary with
YaRN; through the scheduler with chunked prefill and a radix hit; and the latent pool's accounting and capacity."""

from __future__ import annotations

import pytest
import torch
from test_moe_models import check_scheduler, check_static

from radixserve.mem_cache.memory_pool import TokenToKVPool
from radixserve.mem_cache.mla_memory_pool import MLATokenToKVPool


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v2_lora", "deepseek_v2_group", "deepseek_v3",
                                  "deepseek_v3_yarn"])
def test_mla_greedy_matches_transformers(kind: str, tmp_path) -> None:
    check_static(kind, str(tmp_path))


@pytest.mark.parametrize("overlap", [False, True])
def test_mla_chunked_prefill_and_radix_hit_match_transformers(overlap: bool, tmp_path) -> None:
    """Also under overlap scheduling (the forward on its own thread, next tokens resolved on the device)."""
    check_scheduler("deepseek_v3", str(tmp_path), overlap)


def test_mla_latent_pool_with_pages(tmp_path) -> None:
    """The latent pool takes the paged allocator as it is: chunks of 8 and a 16-token radix hit on 8-token pages."""
    check_scheduler("deepseek_v3", str(tmp_path), page_size=8)


def test_latent_pool_stores_one_vector_per_token() -> None:
    pool = MLATokenToKVPool(16, torch.float32, kv_lora_rank=8, qk_rope_head_dim=4, num_layers=2, device="cpu")
    slots = pool.alloc(3)
    k = torch.randn(3, 1, 12)
    pool.set_kv_buffer(1, slots, k, k[..., :8])
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert torch.equal(k_buf[slots], k) and torch.equal(v_buf[slots], k[..., :8])
    assert v_buf.data_ptr() == k_buf.data_ptr()  # V is a view of K's latent part, not a second buffer
    assert not pool.get_kv_buffer(0)[0].any()
    pool.free(slots)
    assert pool.available_size() == 16
    with pytest.raises(ValueError):
        pool.free(slots)


def test_latent_pool_holds_over_five_times_the_tokens_at_deepseek_v2_lite_shape() -> None:
    """Same bytes: DeepSeek-V2-Lite's latent (27 layers x (512 + 64)) against the same model's expanded per-head K and
    V (16 heads, K 192 and V 128 dims) in an MHA pool: 8.9x the tokens."""
    from radixserve.configs.model_config import ModelConfig

    cfg = ModelConfig("radixserve/configs/shapes/deepseek-v2-lite", load_format="dummy")
    mla = MLATokenToKVPool.cell_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_hidden_layers, torch.bfloat16)
    qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    k_and_v = TokenToKVPool(1, torch.bfloat16, cfg.num_attention_heads, qk_dim, cfg.num_hidden_layers,
                            "cpu").bytes_per_token() * (qk_dim + cfg.v_head_dim) // (2 * qk_dim)
    assert mla == 27 * 576 * 2 and k_and_v == 27 * 16 * (192 + 128) * 2
    assert k_and_v / mla >= 5, k_and_v / mla


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe"])
def test_budgeted_mixed_steps_match_transformers(kind: str, tmp_path) -> None:
    """The step token budget on MLA and MoE models: a prompt arriving while another decodes is prefilled in steps of
    at most 12 tokens with the decode riding along (MIXED); both answers stay token-identical to transformers."""
    from model_utils import hf_greedy, make_tiny_model
    from test_scheduler import drain, make_scheduler, submit

    from radixserve.model_executor.forward_batch_info import ForwardMode

    hf = make_tiny_model(kind, str(tmp_path), initializer_range=0.08)
    first = [(7 * i + 3) % 250 + 2 for i in range(9)]
    second = [(5 * i + 11) % 250 + 2 for i in range(30)]
    s = make_scheduler(str(tmp_path), max_total_tokens=2048, chunked_prefill_size=64, step_token_budget=12)
    modes: list[tuple[ForwardMode, int]] = []
    launch = s.run_batch

    def record(batch):  # noqa: ANN001, ANN202
        modes.append((batch.forward_mode, len(batch.input_ids)))
        return launch(batch)

    s.run_batch = record
    submit(s, "first", first, 12)
    for _ in range(3):
        s.step()
    submit(s, "second", second, 8)
    res = drain(s)
    assert s.invariant_violations == 0
    mixed = [n for mode, n in modes if mode == ForwardMode.MIXED]
    assert len(mixed) >= 3 and max(mixed) <= 12  # 30 prompt tokens in steps of at most 11 beside the decode
    assert res["first"]["ids"] == hf_greedy(hf, first, 12)
    assert res["second"]["ids"] == hf_greedy(hf, second, 8)
