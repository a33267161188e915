"""Multi-LoRA serving: PEFT adapters loaded at start or at run time, a fixed GPU pool of adapter slots filled from
host memory (LRU), and batched shrink/expand kernels that apply a different adapter (or none) to each row.

- `config.py`: an adapter's `adapter_config.json` (rank, alpha, rsLoRA, what is supported).
- `adapter.py`: reading a PEFT folder into per-layer A/B tensors.
- `layers.py`: which base linear layers carry LoRA, and how their A/B shard under tensor parallelism.
- `pool.py`: the device buffers of the adapter slots and each adapter's host copy in the same layout.
- `batch_info.py`: the per-row adapter slots of a batch, grouped by adapter, as one packed int64 tensor.
- `ops.py`: the torch reference of the LoRA delta and the dispatch to the Triton kernels (`triton_ops.py`).
- `manager.py`: the worker side (adapters, pool, hooks in the model, CUDA-graph buffers).
- `slots.py`: the scheduler side (which adapter sits in which slot, LRU).
"""
