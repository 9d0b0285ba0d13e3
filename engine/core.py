"""The engine core of one process: scheduler + model runner, stepped in a loop.

`step()` reads like the design: schedule -> execute -> update. Input validation lives in
`add_request`, so bad input raises a ValueError before it can touch running requests.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from scheduler.block_manager import BlockManager
from scheduler.scheduler import RequestUpdate, Scheduler
from worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    num_preemptions: int


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.model_config = ModelConfig.from_dir(config.model)
        config.validate(self.model_config)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.model_config)
        num_blocks = self.runner.num_kv_blocks
        if num_blocks * config.block_size < config.max_model_len:
            raise ValueError(f"num_kv_blocks: {num_blocks} blocks of {config.block_size} tokens cannot hold one "
                             f"request of max_model_len={config.max_model_len}; raise num_kv_blocks or lower max_model_len")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                                   self.block_manager, config.num_lookahead_tokens)
        logger.info("engine ready: model=%s dtype=%s device=%s kv_blocks=%d x %d tokens", config.model, config.dtype,
                    config.device, num_blocks, config.block_size)

    # -- requests ------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within "
                             f"max_model_len={self.config.max_model_len}")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, req_id: str | None = None) -> str:
        self.validate_prompt(prompt_token_ids, params)
        req_id = req_id or uuid.uuid4().hex
        if req_id in self.scheduler.requests:
            raise ValueError(f"request_id {req_id!r} is already in use")
        self.scheduler.add_request(Request(req_id, list(prompt_token_ids), params, self.model_config.eos_token_ids))
        return req_id

    def abort_request(self, req_id: str) -> bool:
        return self.scheduler.abort_request(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop body -------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        sched = self.scheduler.schedule()
        result = self.runner.execute_model(sched)
        return self.scheduler.update_from_output(sched, result)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.block_manager.num_free_blocks,
                           self.block_manager.num_blocks, s.num_preemptions)
