"""Module calls straight to forward on the CPU: same outputs, classes still what they were, hooks still fire."""

from __future__ import annotations

import torch
from model_utils import make_runner, make_tiny_model

from radixserve.bench_one_batch import StaticBatch
from radixserve.model_executor import cpu_direct_calls as dc
from radixserve.models.llama import LlamaDecoderLayer


def test_direct_calls_keep_outputs_classes_and_hooks(tmp_path) -> None:
    make_tiny_model("llama", str(tmp_path))
    runner = make_runner(str(tmp_path))
    layer = runner.model.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    if dc.ENABLED:
        assert type(layer) is not LlamaDecoderLayer and type(layer).__name__ == "LlamaDecoderLayer"
        assert type(layer).__call__ is not torch.nn.Module.__call__
    prompts = [[5, 17, 42, 99, 3], [1, 2, 3]]
    fast = StaticBatch(runner).generate(prompts, 8)
    assert dc.direct_calls(runner.model) == 0  # every module already changed: nothing twice
    seen = []
    handle = layer.mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    with_hook = StaticBatch(runner).generate(prompts, 8)
    handle.remove()
    assert with_hook == fast
    assert seen and seen[0] == 8  # the prefill's 5 + 3 tokens, then one row per request per step
    seen.clear()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: seen.append(type(m).__name__))
    try:
        StaticBatch(runner).generate(prompts[:1], 2)
    finally:
        handle.remove()
    assert "LlamaMLP" in seen
    plain_keys = set(type(runner.model).__mro__[1].state_dict(runner.model)) if dc.ENABLED else None
    assert plain_keys is None or plain_keys == set(runner.model.state_dict())
