"""TpModelWorker: one tensor-parallel rank's model runner, driven by the scheduler with ModelWorkerBatches."""

from __future__ import annotations

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.model_executor.forward_batch_info import ForwardBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, tp_rank: int = 0, gpu_id: int = 0) -> None:
        self.model_runner = ModelRunner(model_config, server_args, tp_rank=tp_rank, tp_size=server_args.tp_size,
                                        gpu_id=gpu_id)
        self.device = self.model_runner.device
        self.max_total_num_tokens = self.model_runner.max_total_num_tokens
        self.max_running_requests = self.model_runner.max_running_requests

    def get_memory_pool(self) -> tuple:
        return self.model_runner.req_to_token_pool, self.model_runner.token_to_kv_pool

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> tuple[LogitsProcessorOutput, torch.Tensor]:
        forward_batch = ForwardBatch.init_new(batch, self.model_runner)
        logits_output = self.model_runner.forward(forward_batch)
        next_token_ids = self.model_runner.sample(logits_output, forward_batch)
        return logits_output, next_token_ids
