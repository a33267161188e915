"""Multi-LoRA serving on the CPU: a tiny Llama with three PEFT adapters (ranks 4/8/16, different targets, one
rsLoRA); batches that mix all three and base rows give, row by row, the greedy tokens of transformers + PEFT
(float32), under every scheduler configuration, with fewer slots than adapters (LRU swapping), and the radix cache
keeps each adapter's KV apart."""

from __future__ import annotations

import pytest
import torch
from lora_utils import ADAPTERS, make_adapters, peft_greedy
from model_utils import make_tiny_model
from test_scheduler import drain, make_scheduler

from radixserve.lora.batch_info import LoRABatchInfo, group_rows
from radixserve.lora.slots import LoRASlotTable
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.mem_cache.radix_cache import RadixCache

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 13], [300, 2, 3, 4], [7] * 3 + list(range(100, 140))]
NEW = 10
NAMES = [None] + [a[0] for a in ADAPTERS]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    base = str(root / "base")
    make_tiny_model("llama", base, seed=3, vocab_size=512)
    paths = make_adapters(base, str(root))
    refs = {name: peft_greedy(base, paths.get(name) if name else None, PROMPTS, NEW) for name in NAMES}
    # the adapters change the outputs (otherwise a test of them proves nothing)
    for name in NAMES[1:]:
        assert refs[name] != refs[None], name
    return {"base": base, "paths": paths, "refs": refs,
            "lora_paths": [f"{n}={p}" for n, p in paths.items()]}


def run_mixed(setup: dict, **kw) -> tuple[dict, object]:
    s = make_scheduler(setup["base"], lora_paths=setup["lora_paths"], **kw)
    for i, prompt in enumerate(PROMPTS):
        for name in NAMES:
            s.process_input_requests([])
            submit_lora(s, f"{name}-{i}", prompt, NEW, name)
    res = drain(s)
    assert s.invariant_violations == 0
    return res, s


def submit_lora(s, rid: str, prompt: list[int], n: int, lora_id: str | None) -> None:
    from radixserve.managers import io_struct as io
    from radixserve.sampling.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    s.process_input_requests([io.TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=prompt,
                                                           sampling_params=params, lora_id=lora_id)])


@pytest.mark.parametrize("kw", [
    {},
    {"enable_overlap_schedule": True},
    {"chunked_prefill_size": 8, "enable_mixed_chunk": True},
    {"disable_radix_cache": True, "max_running_requests": 5},
    {"max_loras_per_batch": 2},
    {"max_loras_per_batch": 1, "enable_overlap_schedule": True, "max_lora_rank": 32},
    {"max_total_tokens": 120, "enable_overlap_schedule": True},  # out of KV: retraction
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_mixed_batch_matches_transformers_peft(lora_setup, kw) -> None:
    res, s = run_mixed(lora_setup, **kw)
    for i in range(len(PROMPTS)):
        for name in NAMES:
            assert res[f"{name}-{i}"]["ids"] == lora_setup["refs"][name][i], (name, i)
    state = s.get_internal_state()
    assert state["lora_adapters"] == ["a4", "b8", "c16"] and len(state["lora_slots"]) <= s.lora_table.num_slots
    if kw.get("max_loras_per_batch", 8) < 3:  # adapters were swapped in and out of the slots
        assert state["lora_slot_loads"] >= 3 > kw["max_loras_per_batch"]
    if "max_total_tokens" in kw:
        assert s.num_retractions > 0


def test_prompt_cached_under_one_adapter_is_not_reused_under_another(lora_setup) -> None:
    s = make_scheduler(lora_setup["base"], lora_paths=lora_setup["lora_paths"])
    prompt, refs = PROMPTS[2], lora_setup["refs"]
    submit_lora(s, "first", prompt, NEW, "a4")
    assert drain(s)["first"]["ids"] == refs["a4"][2]
    for rid, name in [("other", "b8"), ("base", None)]:
        submit_lora(s, rid, prompt, NEW, name)
        out = drain(s)[rid]
        assert out["meta"]["cached_tokens"] == 0, name
        assert out["ids"] == refs[name][2], name
    submit_lora(s, "again", prompt, NEW, "a4")
    out = drain(s)["again"]
    assert out["meta"]["cached_tokens"] >= len(prompt) - 1
    assert out["ids"] == refs["a4"][2]


def test_unknown_adapter_fails_alone(lora_setup) -> None:
    s = make_scheduler(lora_setup["base"], lora_paths=lora_setup["lora_paths"])
    submit_lora(s, "bad", PROMPTS[0], NEW, "nope")
    submit_lora(s, "good", PROMPTS[0], NEW, "b8")
    res = drain(s)
    assert res["bad"]["finish"]["type"] == "abort" and res["bad"]["finish"]["status_code"] == 404
    assert "nope" in res["bad"]["finish"]["message"]
    assert res["good"]["ids"] == lora_setup["refs"]["b8"][0]
    plain = make_scheduler(lora_setup["base"])
    submit_lora(plain, "x", PROMPTS[0], NEW, "a4")
    assert drain(plain)["x"]["finish"]["status_code"] == 400


def test_bad_adapter_folders_are_clear_errors(lora_setup, tmp_path) -> None:
    import json
    import shutil

    from radixserve.lora.adapter import read_lora_weights

    with pytest.raises(ValueError, match="adapter_config.json"):
        read_lora_weights(str(tmp_path), 2)
    bad = tmp_path / "dora"
    shutil.copytree(lora_setup["paths"]["a4"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_dora"):
        read_lora_weights(str(bad), 2)
    with pytest.raises(ValueError, match="max-lora-rank"):
        make_scheduler(lora_setup["base"], lora_paths=lora_setup["lora_paths"], max_lora_rank=8)
    with pytest.raises(ValueError, match="NAME=PATH|not a folder"):
        make_scheduler(lora_setup["base"], lora_paths=["x=/nonexistent"])
    # --lora-target-modules is per projection (the layers are patched per fused group: q/k/v, gate/up)
    paths = lora_setup["paths"]
    with pytest.raises(ValueError, match="targets down_proj, gate_proj, k_proj, o_proj, up_proj, which.*does not"):
        make_scheduler(lora_setup["base"], lora_paths=[f"b8={paths['b8']}"], lora_target_modules=["q_proj", "v_proj"])
    s = make_scheduler(lora_setup["base"], lora_paths=[f"a4={paths['a4']}"], lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="does not serve"):
        s.lora_manager.load_adapter("c16", paths["c16"])
    with pytest.raises(ValueError, match="served model"):
        make_scheduler(lora_setup["base"], lora_paths=[f"default={paths['a4']}"])
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="torch-compile"):
        ServerArgs(model_path=lora_setup["base"], enable_lora=True, enable_torch_compile=True)


# ---------------------------------------------------------------------------------------------- units
def test_group_rows_groups_tokens_by_slot() -> None:
    packed, groups, max_len = group_rows([2, -1, 0, 2], [3, 2, 1, 2], num_slots=4)
    head, order, sorted_slots = packed[:12].view(3, 4), packed[12:20], packed[20:]
    assert sorted_slots.tolist() == [-1, -1, 0, 2, 2, 2, 2, 2] and order[:2].tolist() == [3, 4]
    # tokens: req0 rows 0-2 (slot 2), req1 rows 3-4 (base), req2 row 5 (slot 0), req3 rows 6-7 (slot 2)
    assert head[0, :2].tolist() == [0, 2] and head[2].tolist() == [1, 5, 0, 0]
    starts = head[1, :2].tolist()
    assert order[starts[0]:starts[0] + 1].tolist() == [5]
    assert order[starts[1]:starts[1] + 5].tolist() == [0, 1, 2, 6, 7]
    assert max_len == 5
    assert groups[0] == (0, slice(5, 6)) and groups[1][0] == 2 and groups[1][1].tolist() == [0, 1, 2, 6, 7]
    packed, groups, max_len = group_rows([-1, -1], None, num_slots=2)
    assert groups == [] and max_len == 0 and packed[:6].tolist() == [0] * 6
    assert packed[6:].tolist() == [0, 1, -1, -1]  # the order, the slots


@pytest.mark.parametrize("num_slots,rows", [(3, 3), (3, 4), (4, 5), (5, 1)])
def test_packed_rows_start_on_16_bytes(num_slots: int, rows: int) -> None:
    """token_order and sorted_slots start on 16 bytes for odd slot and row counts (one compiled kernel for all)."""
    req_slots = [i % num_slots - (i == 0) for i in range(rows)]  # row 0 a base row
    packed, _, _ = group_rows(req_slots, None, num_slots)
    info = LoRABatchInfo(num_slots, packed=packed)
    assert info.num_rows == rows
    _, _, _, order, sorted_slots = info.views()
    assert order.data_ptr() % 16 == 0 and sorted_slots.data_ptr() % 16 == 0
    assert sorted(order.tolist()) == list(range(rows))
    assert sorted_slots.tolist() == sorted(req_slots)
    assert [req_slots[i] for i in order.tolist()] == sorted_slots.tolist()


def test_slot_table_lru() -> None:
    t = LoRASlotTable(2)
    slots, loads = t.assign(["a", None, "b", "a"])
    assert slots == [0, -1, 1, 0] and loads == [(0, "a"), (1, "b")]
    assert t.assign(["b"]) == ([1], [])
    slots, loads = t.assign(["c"])  # "a" is the least recently used
    assert slots == [0] and loads == [(0, "c")]
    slots, loads = t.assign(["b", "a"])  # "c" goes: "b" is needed
    assert slots == [1, 0] and loads == [(0, "a")]
    with pytest.raises(RuntimeError, match="slots"):
        t.assign(["x", "y", "z"])
    t.forget("a")
    assert t.assign(["a"])[1] == [(0, "a")]


def test_radix_cache_namespaces_are_separate() -> None:
    req_pool = ReqToTokenPool(4, 64, "cpu")
    kv = TokenToKVPool(64, torch.float32, 1, 4, 1, "cpu")
    cache = RadixCache(req_pool, kv)
    slots_base, slots_a = kv.alloc(5), kv.alloc(5)
    key = [1, 2, 3, 4, 5]
    assert cache.insert(key, slots_base) == 0
    assert len(cache.match_prefix(key, "a")[0]) == 0
    assert cache.insert(key, slots_a, "a") == 0
    assert cache.match_prefix(key, "a")[0].tolist() == slots_a.tolist()
    assert cache.match_prefix(key)[0].tolist() == slots_base.tolist()
    assert cache.evictable_size() == 10 == cache.total_size()
    assert cache.drop_namespace("a") == 5
    assert cache.evictable_size() == 5 and len(cache.match_prefix(key, "a")[0]) == 0
    assert kv.available_size() + cache.evictable_size() + cache.protected_size() == kv.size
    cache.insert(key, kv.alloc(5), "b")
    assert cache.evict(100) == 10 and kv.available_size() == kv.size
    cache.format_tree()


# ---------------------------------------------------------------------------------------------- the Engine
@pytest.mark.integration
def test_engine_adapters_at_run_time(lora_setup) -> None:
    """Select adapters per prompt, load one at run time, unload it while a request runs on it (the request
    finishes untouched, later ones are refused), load it again; two unloads at once each get their own answer;
    nothing leaks."""
    import threading
    import time

    from radixserve import Engine
    from radixserve.managers.tokenizer_manager import RequestError

    refs, paths = lora_setup["refs"], lora_setup["paths"]
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=lora_setup["base"], device="cpu", dtype="float32", max_total_tokens=2048,
                skip_tokenizer_init=True, lora_paths=[f"a4={paths['a4']}"], max_loras_per_batch=1,
                max_lora_rank=16, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "down_proj"]) as engine:
        outs = engine.generate(input_ids=PROMPTS[:2], sampling_params=sp, lora_path=["a4", None])
        assert [o["output_ids"] for o in outs] == [refs["a4"][0], refs[None][1]]
        with pytest.raises(RequestError, match="not loaded") as ei:
            engine.generate(input_ids=PROMPTS[0], sampling_params=sp, lora_path="c16")
        assert ei.value.status_code == 404
        assert "loaded" in engine.load_lora_adapter("c16", paths["c16"])
        with pytest.raises(RequestError, match="already loaded"):
            engine.load_lora_adapter("c16", paths["c16"])
        with pytest.raises(RequestError, match="adapter_config.json"):
            engine.load_lora_adapter("bad", lora_setup["base"])
        out = engine.generate(input_ids=PROMPTS[2], sampling_params=sp, lora_path="c16")
        assert out["output_ids"] == refs["c16"][2]
        # unload while a long request runs on the adapter: it finishes, and its tokens are right
        long_sp = {**sp, "max_new_tokens": 300}
        stream = engine.generate(input_ids=PROMPTS[2], sampling_params=long_sp, lora_path="c16", stream=True)
        first = next(stream)
        unloaded: list[str] = []
        t = threading.Thread(target=lambda: unloaded.append(engine.unload_lora_adapter("c16")))
        t.start()
        chunks = [first, *stream]
        t.join(timeout=120)
        assert unloaded and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert len(chunks[-1]["output_ids"]) == 300 and chunks[-1]["output_ids"][:NEW] == refs["c16"][2]
        with pytest.raises(RequestError, match="not loaded"):
            engine.generate(input_ids=PROMPTS[2], sampling_params=sp, lora_path="c16")
        engine.load_lora_adapter("c16", paths["c16"])
        out = engine.generate(input_ids=PROMPTS[2], sampling_params=sp, lora_path="c16")
        assert out["output_ids"] == refs["c16"][2]
        # two unloads at once: each caller gets its own answer (replies come as each unload is done: a4 waits for
        # its running request, c16 goes at once)
        longer = {**sp, "max_new_tokens": 460}  # (the tiny model's context is 512)
        stream = engine.generate(input_ids=PROMPTS[2], sampling_params=longer, lora_path="a4", stream=True)
        first = next(stream)
        unloaded.clear()
        t = threading.Thread(target=lambda: unloaded.append(engine.unload_lora_adapter("a4")))
        t.start()
        time.sleep(0.1)
        assert "'c16'" in engine.unload_lora_adapter("c16") and not unloaded
        chunks = [first, *stream]
        t.join(timeout=120)
        assert len(unloaded) == 1 and "'a4'" in unloaded[0]
        state = engine.get_internal_state()
        assert state["memory_ok"] and state["invariant_violations"] == 0


@pytest.mark.integration
def test_tensor_parallel_two_ranks_equal_one(tmp_path) -> None:
    """TP=2 over gloo (A of o/down split by input, B of q/k/v/gate/up split by output) gives the tokens of TP=1."""
    from parallel_utils import SERVER_KW, make_model

    from radixserve import Engine

    base = make_model("llama", str(tmp_path / "base"), seed=4, vocab_size=512)
    paths = make_adapters(base, str(tmp_path))
    lora_paths = [f"{n}={p}" for n, p in paths.items()]
    s = make_scheduler(base, lora_paths=lora_paths)
    for i, prompt in enumerate(PROMPTS):
        for name in NAMES:
            submit_lora(s, f"{name}-{i}", prompt, NEW, name)
    ref = {rid: r["ids"] for rid, r in drain(s).items()}
    assert len({tuple(ref[f"{n}-0"]) for n in NAMES}) == len(NAMES)  # every adapter changes the output
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=base, tp_size=2, lora_paths=lora_paths, **SERVER_KW) as engine:
        prompts = [p for p in PROMPTS for _ in NAMES]
        names = [n for _ in PROMPTS for n in NAMES]
        outs = engine.generate(input_ids=prompts, sampling_params=sp, lora_path=names)
    got = {f"{n}-{i // len(NAMES)}": o["output_ids"] for i, (n, o) in enumerate(zip(names, outs, strict=True))}
    assert got == ref


@pytest.mark.parametrize("overlap", [False, True])
def test_unload_waits_for_running_requests(lora_setup, overlap) -> None:
    from radixserve.managers import io_struct as io

    s = make_scheduler(lora_setup["base"], lora_paths=lora_setup["lora_paths"], enable_overlap_schedule=overlap)
    submit_lora(s, "running", PROMPTS[2], NEW, "b8")
    submit_lora(s, "other", PROMPTS[0], NEW, "a4")
    for _ in range(3):
        s.step()
    s.process_input_requests([io.UnloadLoRAAdapterReq(name="b8")])
    submit_lora(s, "late", PROMPTS[1], NEW, "b8")  # refused: the adapter is being unloaded
    assert not any(isinstance(m, io.UnloadLoRAAdapterReqOutput) for m in s.outbox)  # still in use
    res = {}
    for _ in range(200):
        s.step()
        s.process_input_requests([])
        if any(isinstance(m, io.UnloadLoRAAdapterReqOutput) for m in s.outbox) and s.is_idle():
            break
    replies = [m for m in s.outbox if isinstance(m, io.UnloadLoRAAdapterReqOutput)]
    res = drain(s)
    assert len(replies) == 1 and replies[0].success and replies[0].name == "b8", replies
    assert res["running"]["ids"] == lora_setup["refs"]["b8"][2]
    assert res["other"]["ids"] == lora_setup["refs"]["a4"][0]
    assert res["late"]["finish"]["status_code"] == 404 and "unloaded" in res["late"]["finish"]["message"]
    assert "b8" not in s.lora_manager.adapters and "b8" not in s.lora_table.slot_of
    assert s.tree_cache.match_prefix(PROMPTS[2], "b8")[0].numel() == 0  # its cache entries are gone
    assert s.tree_cache.match_prefix(PROMPTS[0], "a4")[0].numel() > 0  # another adapter's stay
    # two unloads asked while one adapter is in use: answered as each is done, each reply naming its request
    submit_lora(s, "busy", PROMPTS[2], NEW, "a4")
    s.step()
    s.outbox.clear()
    s.process_input_requests([io.UnloadLoRAAdapterReq(name="a4", seq=7), io.UnloadLoRAAdapterReq(name="c16", seq=8)])
    for _ in range(200):
        s.step()
        s.process_input_requests([])
        if s.is_idle() and not s.lora_unloads:
            break
    replies = [(m.seq, m.name, m.success) for m in s.outbox if isinstance(m, io.UnloadLoRAAdapterReqOutput)]
    assert replies == [(8, "c16", True), (7, "a4", True)], replies


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_lora_shards_recombine_to_the_full_delta(num_kv_heads: int) -> None:
    """Column-parallel q/k/v (KV heads split, or replicated when fewer than ranks) and row-parallel o: each rank's
    base + LoRA output is its slice (q/k/v) or its partial sum (o) of the unsharded result."""
    from torch import nn

    from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear
    from radixserve.lora.adapter import LoRAWeights
    from radixserve.lora.config import LoRAConfig
    from radixserve.lora.layers import find_lora_targets
    from radixserve.lora.ops import lora_delta_torch
    from radixserve.lora.pool import LoRAMemoryPool

    torch.manual_seed(0)
    hidden, head_dim, heads, tp, r = 32, 8, 4, 2, 4
    kv = num_kv_heads * head_dim
    full = {"q_proj": torch.randn(heads * head_dim, hidden), "k_proj": torch.randn(kv, hidden),
            "v_proj": torch.randn(kv, hidden), "o_proj": torch.randn(hidden, heads * head_dim)}
    ab = {m: (torch.randn(r, w.shape[1]), torch.randn(w.shape[0], r)) for m, w in full.items()}
    cfg = LoRAConfig(path="x", r=r, lora_alpha=8.0, use_rslora=False, target_modules=tuple(full))
    weights = LoRAWeights(cfg, {(0, m): pair for m, pair in ab.items()})
    x = torch.randn(3, hidden)
    o_in = torch.randn(3, heads * head_dim)  # the o projection's (unsharded) input
    ref = {m: (x if m != "o_proj" else o_in) @ w.T + ((x if m != "o_proj" else o_in) @ ab[m][0].T) @ ab[m][1].T
           * cfg.scaling for m, w in full.items()}
    o_partials = []
    for rank in range(tp):
        attn = nn.Module()
        attn.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, num_kv_heads, False, rank, tp)
        attn.o_proj = RowParallelLinear(heads * head_dim, hidden, False, rank, tp)
        model = nn.Module()
        model.layers = nn.ModuleList([nn.Module()])
        model.layers[0].self_attn = attn
        for sid in "qkv":
            attn.qkv_proj.weight.weight_loader(attn.qkv_proj.weight, full[f"{sid}_proj"], sid)
        attn.o_proj.weight.weight_loader(attn.o_proj.weight, full["o_proj"])
        targets = find_lora_targets(model, {"qkv_proj", "o_proj"})
        pool = LoRAMemoryPool(targets, 1, 8, torch.float32, "cpu")
        pool.load(0, pool.host_copy("x", weights))
        outs = {}
        for t in targets:  # o: this rank's columns of its input
            inp = x if t.group == "qkv_proj" else o_in[:, rank * t.in_local:(rank + 1) * t.in_local]
            out = t.base(inp)  # no process group: the row-parallel all-reduce is a no-op here
            lora_delta_torch(inp, out, pool.a[(0, t.group)], pool.b[(0, t.group)], t.out_slices,
                             [(0, slice(0, 3))], pool.ranks, pool.scalings_cpu, pool.sub_masks[t.group])
            outs[t.group] = out
        nq, nkv = attn.qkv_proj.num_heads * head_dim, attn.qkv_proj.num_kv_heads * head_dim
        kv_head = (rank * attn.qkv_proj.num_heads) // (heads // num_kv_heads)
        want = torch.cat([ref["q_proj"][:, rank * nq:(rank + 1) * nq],
                          ref["k_proj"][:, kv_head * head_dim:kv_head * head_dim + nkv],
                          ref["v_proj"][:, kv_head * head_dim:kv_head * head_dim + nkv]], dim=-1)
        torch.testing.assert_close(outs["qkv_proj"], want)
        o_partials.append(outs["o_proj"])
    torch.testing.assert_close(sum(o_partials), ref["o_proj"])


def test_an_adapter_without_a_slot_is_not_overtaken(lora_setup) -> None:
    """One adapter slot, a steady stream of requests for a4 and one for b8: once b8 waits for the slot, no adapter
    request behind it is admitted (a4's kept it for ever), so b8 runs as soon as the a4 requests admitted before it
    end; a base-model request behind it still goes at once."""
    s = make_scheduler(lora_setup["base"], lora_paths=lora_setup["lora_paths"], max_loras_per_batch=1)
    submit_lora(s, "a-0", PROMPTS[0], NEW, "a4")
    s.step()
    submit_lora(s, "b", PROMPTS[1], NEW, "b8")
    first_token: dict[str, int] = {}
    for step in range(200):
        submit_lora(s, f"a-{step + 1}", PROMPTS[step % len(PROMPTS)], NEW, "a4")  # a new a4 request every step
        if step == 0:
            submit_lora(s, "base", PROMPTS[2], NEW, None)
        s.step()
        for r in s.running_batch.reqs if s.running_batch is not None else []:
            first_token.setdefault(r.rid, step)
        if "b" in first_token:
            break
    assert "b" in first_token and first_token["b"] <= NEW + 2, first_token.get("b")
    assert first_token["base"] <= 1
