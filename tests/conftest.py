"""Shared fixtures: the embedded model (converted once per machine, cached in ~/.cache/radixserve) and a writer of
tiny llama.cpp-style GGUF files."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
import torch

# --dtype auto stays float32 on CPUs with fast bf16 (it would pick bfloat16 there): the correctness tests compare
# float32 tokens. Server and engine processes the tests start inherit it.
os.environ.setdefault("RADIXSERVE_CPU_AUTO_DTYPE", "float32")

# Triton kernels run on the CPU through its interpreter; it must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter_once_per_launch() -> None:
    """Triton's interpreter patches triton.language for the interpreter (`_patch_lang`) when a launch starts, and
    again at every call of a @triton.jit helper inside the kernel, for each program of the grid: the patches the
    launch (or the helper's first call) made stay in place until the launch ends, so the repeats change nothing,
    yet they walk triton.language's members with `inspect.getmembers` each time (about a third of the interpreted
    kernels' time here). Within one launch, each helper's patch is made once. Interpreter-mode only, and only for
    the Triton whose internals this matches; anything else leaves Triton as it is."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import threading

    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    grid_call = vars(getattr(ti, "GridExecutor", object)).get("__call__")
    patch_lang, scope_cls = getattr(ti, "_patch_lang", None), getattr(ti, "_LangPatchScope", None)
    if grid_call is None or patch_lang is None or scope_cls is None or getattr(patch_lang, "_once", False):
        return
    local = threading.local()  # the helpers patched in this thread's launch in progress (None between launches)

    def once_per_launch(fn: object) -> object:
        done = getattr(local, "done", None)
        if done is None:
            return patch_lang(fn)
        if fn in done:
            return scope_cls()  # nothing to undo; the caller (a helper's call) discards it anyway
        done.add(fn)
        return patch_lang(fn)

    def launch(self: object, *args: object, **kwargs: object) -> object:
        outer, local.done = getattr(local, "done", None), set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            local.done = outer

    once_per_launch._once = True  # type: ignore[attr-defined]
    ti._patch_lang = once_per_launch
    ti.GridExecutor.__call__ = launch


_patch_triton_interpreter_once_per_launch()


# Tests that start no process but take about a second or more on the 2-core CI machine (`--durations` of a quiet
# run): `slow`, so that `make test-fast` (not integration, not slow) stays an inner loop of about a minute.
# `make test` runs them all. Parametrised tests are listed once, by function.
SLOW_TESTS = frozenset({
    "tests/test_bench_profile_prefill.py::test_correctness_test_runs_at_batch_size_1",
    "tests/test_bench_profile_prefill.py::test_correctness_test_text_ends_at_the_end_of_sequence",
    "tests/test_double_sparsity.py::test_calibration_text_is_encoded_without_the_context_length_warning",
    "tests/test_double_sparsity.py::test_embedded_model_agrees_with_dense_at_2k_context",
    "tests/test_fused_ops.py::test_models_with_fused_kernels_match_transformers",
    "tests/test_gemma.py::test_gemma2_greedy_matches_transformers",
    "tests/test_gemma.py::test_greedy_matches_transformers",
    "tests/test_kernel_compile.py::test_decode_gemv_kernels_compile_for_sm90",
    "tests/test_kernel_compile.py::test_models_launches_compile_for_sm90",
    "tests/test_kv_cache_fp8.py::test_triton_decode_reads_fp8_pool_like_torch_native",
    "tests/test_loader.py::test_embedded_weights_equal_transformers_gguf_dequantization",
    "tests/test_lora_kernels.py::test_model_with_kernels_forced_equals_torch_path",
    "tests/test_model_correctness.py::test_bf16_greedy_agrees_with_transformers_teacher_forced",
    "tests/test_model_correctness.py::test_embedded_smollm2_matches_transformers_and_knows_paris",
    "tests/test_quant_fp8_rope.py::test_fp8_model_decodes_the_same_tokens_with_the_rotation_in_the_gemv",
    "tests/test_quant_quality.py::test_fp8_and_q8_0_keep_quality",
    "tests/test_quant_quality.py::test_kv_scale_sweep_rows_use_their_scales",
    "tests/test_sampling_engine.py::test_scheduler_finishes_on_stop_string_spanning_tokens",
    "tests/test_sliding_window.py::test_greedy_matches_transformers_with_a_short_window",
    "tests/test_speculative.py::test_constrained_requests_draft_within_their_grammar",
    "tests/test_speculative.py::test_repeat_prompt_accepts_more_than_one_token_per_step",
    "tests/test_speculative.py::test_sampling_with_speculation_keeps_the_target_distribution",
    "tests/test_speculative.py::test_verify_through_the_triton_extend_kernel",
    "tests/test_structured_output.py::test_json_outputs_validate_against_their_schemas",
    "tests/test_structured_output.py::test_many_seeds_all_valid",
    "tests/test_structured_output.py::test_overlap_gives_identical_constrained_outputs",
    "tests/test_structured_output.py::test_same_schema_twice_hits_the_compile_cache",
    "tests/test_structured_output.py::test_tiny_pool_retraction_and_chunked_prefill_keep_grammars_exact",
    "tests/test_triton_attention.py::test_cuda_graph_metadata_path_matches_eager",
    "tests/test_triton_attention.py::test_decode_matches_torch_native",
    "tests/test_triton_mla.py::test_deepseek_v3_with_triton_kernels_matches_transformers",
    "tests/test_triton_mla.py::test_mla_cuda_graph_metadata_path_matches_eager",
    "tests/test_triton_mla.py::test_mla_decode_matches_torch_native",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def embedded_model_path() -> str:
    """Folder of the converted embedded SmolLM2-135M-Instruct (converted on the first run, reused after)."""
    from radixserve.model_loader.embedded import ensure_embedded_model

    try:
        return ensure_embedded_model()
    except ValueError as e:
        if "pip install" in str(e):
            pytest.skip(str(e))
        raise


# A tiny Llama shape: GQA (4 query heads, 2 kv heads), head_dim 16.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_theta=10000.0)


def random_llama_tensors(seed: int = 0, *, tied: bool = False, **shape: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors of a random Llama with the TINY_LLAMA shape (or `shape` overrides)."""
    s = {**TINY_LLAMA, **shape}
    h, inter, vocab = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    hd = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def rnd(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g)

    out = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": 1 + 0.1 * rnd(h)}
    if not tied:
        out["lm_head.weight"] = rnd(vocab, h)
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter), p + "input_layernorm.weight": 1 + 0.1 * rnd(h),
            p + "post_attention_layernorm.weight": 1 + 0.1 * rnd(h),
        })
    return out


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's q/k row order, written here from its definition (rows of each head: the
    first and second rotary halves interleaved) so that the loader's inverse is checked independently."""
    hd = w.shape[0] // n_head
    out = torch.empty_like(w)
    for head in range(n_head):
        for i in range(hd // 2):
            out[head * hd + 2 * i] = w[head * hd + i]
            out[head * hd + 2 * i + 1] = w[head * hd + hd // 2 + i]
    return out


_HF_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
_HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def hf_to_gguf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem in _HF_TO_GGUF_TOP:
        return f"{_HF_TO_GGUF_TOP[stem]}.{kind}"
    parts = stem.split(".", 3)  # model, layers, N, rest
    return f"blk.{parts[2]}.{_HF_TO_GGUF_BLOCK[parts[3]]}.{kind}"


def write_llama_gguf(path: str, tensors: dict[str, torch.Tensor], *, arch: str = "llama", permute: bool = True,
                     quantize: dict[str, object] | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
                     **shape: int) -> None:
    """Write HF-named tensors as a llama.cpp GGUF: llama.cpp names, q/k rows permuted (when `permute`), metadata
    for `arch`. `quantize` maps HF names to a GGMLQuantizationType to store them quantized."""
    import gguf

    s = {**TINY_LLAMA, **shape}
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-test")
    w.add_block_count(s["num_hidden_layers"])
    w.add_context_length(s["max_position_embeddings"])
    w.add_embedding_length(s["hidden_size"])
    w.add_feed_forward_length(s["intermediate_size"])
    w.add_head_count(s["num_attention_heads"])
    w.add_head_count_kv(s["num_key_value_heads"])
    w.add_rope_freq_base(float(s["rope_theta"]))
    w.add_layer_norm_rms_eps(float(s["rms_norm_eps"]))
    w.add_vocab_size(s["vocab_size"])
    w.add_rope_dimension_count(s["hidden_size"] // s["num_attention_heads"])
    w.add_file_type(0)
    for name, t in tensors.items():
        if permute and name.endswith("self_attn.q_proj.weight"):
            t = llama_cpp_permute(t, s["num_attention_heads"])
        elif permute and name.endswith("self_attn.k_proj.weight"):
            t = llama_cpp_permute(t, s["num_key_value_heads"])
        array = t.numpy().astype(np.float32)
        qtype = (quantize or {}).get(name)
        if qtype is not None:
            from radixserve.layers.quantization.gguf_formats import quantize_to_ggml

            w.add_tensor(hf_to_gguf_name(name), quantize_to_ggml(array, qtype.name), raw_dtype=qtype)
        else:
            w.add_tensor(hf_to_gguf_name(name), array)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def gguf_writer() -> Callable[..., None]:
    return write_llama_gguf


@pytest.fixture(name="llama_cpp_permute")
def llama_cpp_permute_fixture() -> Callable[[torch.Tensor, int], torch.Tensor]:
    return llama_cpp_permute


@pytest.fixture
def tiny_llama_tensors() -> Callable[..., dict[str, torch.Tensor]]:
    return random_llama_tensors


@pytest.fixture
def clean_cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike) -> str:
    """RADIXSERVE_CACHE_DIR pointed at an empty temporary folder."""
    root = os.path.join(str(tmp_path), "cache")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", root)
    return root
