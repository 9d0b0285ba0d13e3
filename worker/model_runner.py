"""The model runner: turns one SchedulerOutput into one forward pass and a RunnerOutput.

execute_model reads top to bottom: update slots -> build the batch -> prepare inputs ->
forward -> sample -> write back -> report.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from scheduler.output import RunnerOutput, SchedulerOutput, TokenLogprobs
from worker import invariants, kernels
from worker.attention import AttentionContext, StepLayout, allocate_kv_caches
from worker.model_loader import DTYPES, load_model
from worker.sampler import Sampler, SamplerOutput, SamplingMetadata
from worker.states import RequestStates

logger = logging.getLogger(__name__)


def num_kv_blocks_for(config: EngineConfig, model_cfg: ModelConfig, num_layers: int) -> int:
    """KV budget: `num_kv_blocks` if given, else a fraction of host RAM (CPU) or free device memory."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    elem = torch.finfo(DTYPES[config.dtype]).bits // 8
    per_block = 2 * num_layers * config.block_size * model_cfg.num_key_value_heads * model_cfg.head_dim * elem
    if config.device.startswith("cuda"):
        budget = torch.cuda.mem_get_info()[0] * config.kv_memory_fraction
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * config.kv_memory_fraction
    # Never more than every slot at full length could use.
    ceiling = config.max_num_seqs * -(-config.max_model_len // config.block_size) + 1
    return max(1, min(int(budget // per_block), ceiling))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        max_len = config.max_model_len
        self.model = load_model(Path(config.model), model_cfg, config.dtype, config.device, max_positions=max_len + 8)
        self.num_kv_blocks = num_kv_blocks_for(config, model_cfg, model_cfg.num_hidden_layers)
        self.kv_cache, self.kv_views = allocate_kv_caches(
            model_cfg.num_hidden_layers, self.num_kv_blocks, self.block_size, model_cfg.num_key_value_heads,
            model_cfg.head_dim, DTYPES[config.dtype], config.device)
        self.max_draft_tokens = 0
        self.states = RequestStates(config.max_num_seqs, max_len, -(-max_len // self.block_size) + 1,
                                    self.max_draft_tokens, self.device)
        self.sampler = Sampler(seed=config.seed, device=self.device)
        self.eos_token_ids = model_cfg.eos_token_ids
        self.check_invariants = invariants.enabled()

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        self._update_states(sched)
        if not sched.num_scheduled_tokens:
            return RunnerOutput([], [], [])

        req_ids = list(sched.num_scheduled_tokens)
        st = self.states
        slots = np.array([st.req_id_to_slot[r] for r in req_ids], dtype=np.int32)
        query_lens = np.array([sched.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        num_drafts = np.array([sched.num_draft_tokens.get(r, 0) for r in req_ids], dtype=np.int32)
        num_computed = st.num_computed_tokens_np[slots]
        is_prefilling = st.is_prefilling(slots)
        # A row samples once every token it knows of has been computed (not mid-prefill).
        samples = num_computed + query_lens >= st.total_len_np[slots]
        if self.check_invariants:
            invariants.check_step(st, sched, req_ids, slots, is_prefilling, num_drafts)

        layout = StepLayout(st.block_table[slots], num_computed, query_lens)
        input_ids = self._prepare_input_ids(slots, layout, is_prefilling, num_drafts)
        ctx = AttentionContext(self.kv_views, layout, self.block_size, self.device, self.model_cfg.sliding_window)
        hidden = self.model(input_ids, ctx.positions, ctx)

        sample_rows = np.nonzero(samples)[0]
        sampled = [[] for _ in req_ids]
        logprobs: list[list[TokenLogprobs]] | None = None
        if len(sample_rows):
            last_pos = torch.from_numpy(layout.query_start_loc[1:][sample_rows] - 1).to(self.device)
            logits = self.model.compute_logits(hidden[last_pos])
            out = self.sampler(logits, self._sampling_metadata(slots[sample_rows]))
            self._write_back(slots, sample_rows, out.sampled_token_ids)
            tokens = out.sampled_token_ids.tolist()  # the step's one sync: outputs go to the CPU scheduler
            for row, tok in zip(sample_rows.tolist(), tokens):
                sampled[row] = [tok]
            logprobs = self._logprobs(out, slots, sample_rows, len(req_ids))
        return RunnerOutput(req_ids, sampled, [[] for _ in req_ids], logprobs)

    # -- pieces --------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        st = self.states
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            st.remove_request(req_id)
        for new in sched.new_requests:
            slot = st.add_request(new)
            if self.check_invariants:
                invariants.check_admission(st, slot)
        for cached in sched.cached_requests:
            st.update_request(cached)
        st.refresh_computed_prefill()
        if sched.num_scheduled_tokens:
            slots = [st.req_id_to_slot[r] for r in sched.num_scheduled_tokens]
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            st.num_computed_tokens[idx] = torch.from_numpy(st.num_computed_tokens_np[slots]).to(self.device)

    def _prepare_input_ids(self, slots: np.ndarray, layout: StepLayout, is_prefilling: np.ndarray,
                           num_drafts: np.ndarray) -> torch.Tensor:
        st, dev = self.states, self.device
        qsl = layout.query_start_loc
        input_ids = torch.empty(int(qsl[-1]), dtype=torch.int32, device=dev)
        idx_t = torch.from_numpy(slots).to(dev)
        qsl_t = torch.from_numpy(qsl).to(dev)
        prefill_t = torch.from_numpy(is_prefilling).to(dev)
        kernels.gather_prefill_tokens(input_ids, st.all_token_ids, idx_t, qsl_t,
                                      torch.from_numpy(layout.num_computed).to(dev), prefill_t)
        kernels.combine_sampled_and_draft_tokens(input_ids, st.last_sampled_tokens, st.draft_tokens,
                                                 torch.from_numpy(num_drafts).to(dev), idx_t, qsl_t, prefill_t)
        return input_ids

    def _write_back(self, slots: np.ndarray, sample_rows: np.ndarray, tokens: torch.Tensor) -> None:
        st = self.states
        num_sampled = np.zeros(len(slots), dtype=np.int32)
        num_sampled[sample_rows] = 1
        sampled = torch.zeros(len(slots), 1, dtype=torch.int32, device=self.device)
        sampled[torch.from_numpy(sample_rows).to(self.device), 0] = tokens.to(torch.int32)
        kernels.post_step_update(st.all_token_ids, st.total_len, st.last_sampled_tokens, sampled,
                                 torch.from_numpy(num_sampled).to(self.device), torch.from_numpy(slots).to(self.device))
        st.total_len_np[slots] += num_sampled

    def _sampling_metadata(self, slots: np.ndarray) -> SamplingMetadata:
        st = self.states
        params = [st.sampling_params[s] for s in slots.tolist()]
        dev = self.device

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        need_penalties = any(p.needs_penalties for p in params)
        prompt_ids = output_ids = None
        if need_penalties:
            rows = [st.all_token_ids[s, : st.total_len_np[s]].tolist() for s in slots.tolist()]
            plen = [int(st.prompt_len[s]) for s in slots.tolist()]
            prompt_ids = [r[:n] for r, n in zip(rows, plen)]
            output_ids = [r[n:] for r, n in zip(rows, plen)]
        banned = None
        num_out = st.total_len_np[slots] - st.prompt_len[slots]
        if any(p.min_tokens > n for p, n in zip(params, num_out)):
            banned = [list(self.eos_token_ids) + p.stop_token_ids if p.min_tokens > n else []
                      for p, n in zip(params, num_out)]
        return SamplingMetadata(
            temperature=col([p.temperature for p in params], torch.float32),
            top_k=col([p.top_k for p in params], torch.int32),
            top_p=col([p.top_p for p in params], torch.float32),
            min_p=col([p.min_p for p in params], torch.float32),
            generators=[st.generators[s] for s in slots.tolist()],
            repetition_penalty=col([p.repetition_penalty for p in params], torch.float32),
            frequency_penalty=col([p.frequency_penalty for p in params], torch.float32),
            presence_penalty=col([p.presence_penalty for p in params], torch.float32),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            banned_token_ids=banned,
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            all_greedy=all(p.greedy for p in params),
        )

    def _logprobs(self, out: SamplerOutput, slots: np.ndarray, sample_rows: np.ndarray,
                  batch: int) -> list[list[TokenLogprobs]] | None:
        """Per request: the sampled token's logprob and rank plus its own top-n (n as it asked)."""
        if out.logprobs is None:
            return None
        ids, vals = out.logprobs.token_ids.tolist(), out.logprobs.logprobs.tolist()
        ranks = out.logprobs.ranks.tolist()
        result: list[list[TokenLogprobs]] = [[] for _ in range(batch)]
        for i, row in enumerate(sample_rows.tolist()):
            n = self.states.sampling_params[int(slots[row])].logprobs
            if n is not None:
                top = list(zip(ids[i][1 : 1 + n], vals[i][1 : 1 + n]))
                result[row] = [TokenLogprobs(ids[i][0], vals[i][0], ranks[i], top)]
        return result
