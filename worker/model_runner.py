"""The model runner: turns one SchedulerOutput into one forward pass and a RunnerOutput.

execute_model reads top to bottom: update slots -> build the batch -> forward -> sample
(worker/sample/) -> write back -> propose drafts and observe the step (worker/spec_decode/).
"""
from __future__ import annotations

import logging
import os
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from scheduler.output import RunnerOutput, SchedulerOutput
from worker import fused_ops, invariants, kernels
from worker.attention import AttentionContext, allocate_kv_caches, default_backend
from worker.compilation import ModelForward
from worker.input_batch import InputBatch, StepLayout
from worker.kv_tap import KVTap, StepTap
from worker.model_loader import DTYPES, activation_dtype, load_model, resolve_draft_dtype, resolve_draft_vocab
from worker.prompt_logprobs import compute_prompt_logprobs
from worker.sample.sampler import mix_seed
from worker.sample.verifier import Verifier, check_in_vocab
from worker.spec_decode.drafter import Drafter
from worker.spec_decode.mtp import MTPDrafter
from worker.spec_decode.ngram import NgramDrafter
from worker.spec_decode.policy import SpecPolicy, SpecPolicyMode
from worker.spec_decode.speculator import Speculator
from worker.states import RequestStates
from worker.structured import GrammarCompiler, GrammarStates

logger = logging.getLogger(__name__)


def num_kv_blocks_for(config: EngineConfig, model_cfg: ModelConfig, num_layers: int) -> int:
    """KV budget: `num_kv_blocks` if given, else a fraction of host RAM (CPU) or free device memory."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    elem = torch.finfo(DTYPES[activation_dtype(config.dtype, config.device)]).bits // 8
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
        self.num_spec = config.num_speculative_tokens if config.speculative_method else 0
        num_mtp = 1 if config.speculative_method == "mtp" else 0
        lookahead = config.num_lookahead_tokens
        # The KV cache (and the drafter's default precision) follows the activations, not the weights.
        self.activation_dtype = DTYPES[activation_dtype(config.dtype, config.device)]
        self.draft_dtype = resolve_draft_dtype(config.draft_dtype, str(self.activation_dtype).removeprefix("torch."),
                                               config.device)
        self.model = load_model(Path(config.model), model_cfg, config.dtype, config.device,
                                max_positions=max_len + lookahead + 8, num_mtp_layers=num_mtp,
                                draft_dtype=self.draft_dtype, compiled=not config.enforce_eager,
                                quantization=config.quantization,
                                draft_vocab=resolve_draft_vocab(config.draft_vocab, config.model) if num_mtp else None)
        self.forward = ModelForward(self.model, compile_model=not config.enforce_eager)
        # Chosen (and on CPU the kernels built or loaded) now, before the engine serves.
        self.attention_backend = default_backend(self.device)
        # Plain-temperature decode steps sample with the C++ op (its torch reference is a loop per row).
        fused_sampling = self.device.type == "cpu" and fused_ops.enable()
        self.num_kv_layers = model_cfg.num_hidden_layers + num_mtp  # MTP layers get their own paged cache
        self.num_kv_blocks = num_kv_blocks_for(config, model_cfg, self.num_kv_layers)
        self.kv_cache, self.kv_views = allocate_kv_caches(
            self.num_kv_layers, self.num_kv_blocks, self.block_size, model_cfg.num_key_value_heads,
            model_cfg.head_dim, self.activation_dtype, config.device)
        with torch.inference_mode():
            self.forward.warm_up(self.kv_views, self.block_size, -(-(max_len + lookahead) // self.block_size) + 1,
                                 self.device)
        # Unseeded noise: the configured seed mixed with this instance's name, so that two engines
        # started with the same --seed (P and D, two replicas) never draw the same noise.
        noise_seed = mix_seed(config.seed, zlib.crc32(config.instance_name.encode()))
        self.states = RequestStates(config.max_num_seqs, max_len, -(-(max_len + lookahead) // self.block_size) + 1,
                                    self.num_spec, self.device, noise_seed=noise_seed)
        self.grammar = GrammarStates(config.max_num_seqs,
                                     GrammarCompiler(config.model, model_cfg.vocab_size, model_cfg.eos_token_ids))
        self.verifier = Verifier(self.model, self.states, self.grammar, model_cfg.eos_token_ids, self.device,
                                 noise_seed, fused_sampling)
        self.speculator = self._make_speculator() if config.speculative_method else None
        self.drafter: Drafter | None = None
        # Without speculation, a policy of 0 drafts: its counters read as "never drafted".
        self.spec_policy = SpecPolicy(0, SpecPolicyMode.FIXED)
        if self.speculator is not None:
            self.drafter, self.spec_policy = self.speculator.drafter, self.speculator.policy
        self.check_invariants = invariants.enabled()
        self.kv_tap: KVTap | None = None  # set by a prefill engine in PD (layer-wise KV push)
        # False on a prefill engine in PD: its requests leave after t0, so it runs the MTP layer over
        # the prompts (their MTP KV is handed over) but never drafts (Speculator.propose), and its steps
        # neither consult the policy nor count in the chosen-k metric (under load they would skew it toward k=0).
        self.proposes_drafts = config.proposes_drafts

    def _make_speculator(self) -> Speculator:
        config = self.config
        if config.speculative_method == "mtp":
            if self.device.type == "cpu":  # the row counts of drafting at up to ~16 rows
                self.model.warm_up_draft_gemms(max_rows=16 * (1 + self.num_spec))
            drafter = MTPDrafter(self.model, self.states, self.kv_views, self.block_size, self.num_spec, self.device,
                                 self.verifier.sampler, self.model_cfg.sliding_window, grammar=self.grammar,
                                 window=config.mtp_window or None)
            policy = SpecPolicy(self.num_spec, SpecPolicyMode(config.spec_policy))
        else:  # n-gram drafts vary in length per row, which the cost model does not time: always fixed K
            drafter = NgramDrafter(self.states, self.num_spec, grammar=self.grammar)
            policy = SpecPolicy(self.num_spec, SpecPolicyMode.FIXED)
        return Speculator(drafter, policy, self.states, self.model_cfg.vocab_size)

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        self._update_states(sched)
        if not sched.num_scheduled_tokens:
            return RunnerOutput([], [], [])
        batch = self._build_batch(sched)
        if self.check_invariants:
            invariants.check_step(self.states, sched, batch.req_ids, batch.slots, batch.is_prefilling, batch.num_drafts)

        step_tap = self.kv_tap.step(batch.req_ids, batch.layout) if self.kv_tap is not None else None
        hidden = self._forward(batch, step_tap)
        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, batch, self.states)
        tokens = self.verifier.sample(batch, hidden)
        check_in_vocab(tokens.accepted, self.model_cfg.vocab_size, "sampled")
        self._write_back(batch, tokens.accepted)
        drafts = [[] for _ in batch.req_ids]
        if self.speculator is not None:
            proposal = self.speculator.propose(batch, hidden, tokens, self.verifier.position_metadata.for_draft,
                                               step_tap, self.proposes_drafts)
            self.speculator.observe(batch, tokens, proposal, start)
            drafts = proposal.token_ids
        return RunnerOutput(batch.req_ids, tokens.accepted, drafts, tokens.logprobs, prompt_logprobs)

    # -- pieces --------------------------------------------------------------------------

    def _forward(self, batch: InputBatch, step_tap: StepTap | None) -> torch.Tensor:
        """The target's forward over the step's tokens; its hidden states at every position."""
        ctx = AttentionContext(self.kv_views, batch.layout, self.block_size, self.device, self.model_cfg.sliding_window,
                               self.attention_backend)
        if step_tap is not None:
            ctx.tap = step_tap.layer_tap(batch.req_ids, batch.layout)
        hidden = self.forward(self._prepare_input_ids(batch), ctx.positions, ctx)
        if step_tap is not None and not (self.drafter is not None and self.drafter.writes_kv):
            step_tap.last_layer_done()  # else the drafter's pass writes the last KV layer
        return hidden

    def _build_batch(self, sched: SchedulerOutput) -> InputBatch:
        st = self.states
        req_ids = list(sched.num_scheduled_tokens)
        slots = np.array([st.req_id_to_slot[r] for r in req_ids], dtype=np.int32)
        query_lens = np.array([sched.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        num_drafts = np.array([sched.num_draft_tokens.get(r, 0) for r in req_ids], dtype=np.int32)
        num_computed = st.num_computed_tokens_np[slots]
        # A row samples once every token it knows of has been computed (not mid-prefill).
        samples = num_computed + query_lens - num_drafts >= st.total_len_np[slots]
        return InputBatch(req_ids, slots, StepLayout(st.block_table[slots], num_computed, query_lens),
                         num_drafts, st.is_prefilling(slots), samples)

    def _update_states(self, sched: SchedulerOutput) -> None:
        st = self.states
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            if req_id in st.req_id_to_slot:
                self.grammar.release(st.req_id_to_slot[req_id])
            st.remove_request(req_id)
        if self.kv_tap is not None:
            self.kv_tap.forget([*sched.finished_req_ids, *sched.preempted_req_ids])
        for new in sched.new_requests:
            slot = st.add_request(new)
            self.grammar.admit(slot, new.sampling_params.grammar, new.all_token_ids[new.prompt_len:], new.grammar)
            if self.check_invariants:
                invariants.check_admission(st, slot)
            if new.handoff_hidden is not None and self.drafter is not None:
                self.drafter.seed_from_handoff(slot, new.num_computed_tokens, new.handoff_hidden)
        for cached in sched.cached_requests:
            st.update_request(cached)
        st.refresh_computed_prefill()
        if sched.num_scheduled_tokens:
            slots = [st.req_id_to_slot[r] for r in sched.num_scheduled_tokens]
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            st.num_computed_tokens[idx] = torch.from_numpy(st.num_computed_tokens_np[slots]).to(self.device)

    def _prepare_input_ids(self, batch: InputBatch) -> torch.Tensor:
        st, dev = self.states, self.device
        slots, layout, is_prefilling, num_drafts = batch.slots, batch.layout, batch.is_prefilling, batch.num_drafts
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

    def _write_back(self, batch: InputBatch, accepted: list[list[int]]) -> None:
        st, dev = self.states, self.device
        num_sampled = np.array([len(a) for a in accepted], dtype=np.int32)
        width = max(1, int(num_sampled.max()))
        table = np.zeros((len(accepted), width), dtype=np.int32)
        for row, toks in enumerate(accepted):
            table[row, : len(toks)] = toks
        kernels.post_step_update(st.all_token_ids, st.total_len, st.last_sampled_tokens,
                                 torch.from_numpy(table).to(dev), torch.from_numpy(num_sampled).to(dev),
                                 torch.from_numpy(batch.slots).to(dev))
        st.total_len_np[batch.slots] += num_sampled
