"""The model runner: turns one SchedulerOutput into one forward pass and a RunnerOutput.

execute_model reads top to bottom: update slots -> build the batch -> prepare inputs ->
forward -> sample -> write back -> report.
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
from engine.types import TokenLogprobs
from scheduler.output import RunnerOutput, SchedulerOutput
from worker import fused_ops, invariants, kernels
from worker.attention import AttentionContext, allocate_kv_caches, default_backend
from worker.compilation import ModelForward
from worker.drafter import MTPDrafter, NgramDrafter
from worker.input_batch import InputBatch, StepLayout
from worker.kv_tap import KVTap
from worker.model_loader import DTYPES, activation_dtype, load_model, resolve_draft_dtype, resolve_draft_vocab
from worker.prompt_logprobs import compute_prompt_logprobs
from worker.rejection_sampler import accept_matching_prefix
from worker.sampler import GREEDY_TEMPERATURE_EPS, Sampler, SamplingMetadata, mix_seed, position_generator
from worker.spec_policy import SpecPolicy, SpecPolicyMode
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
        self.fused_sampling = self.device.type == "cpu" and fused_ops.enable()
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
        self.sampler = Sampler(seed=noise_seed, device=self.device)
        self.grammar = GrammarStates(config.max_num_seqs,
                                     GrammarCompiler(config.model, model_cfg.vocab_size, model_cfg.eos_token_ids))
        self.drafter: MTPDrafter | NgramDrafter | None = None
        if config.speculative_method == "mtp":
            if self.device.type == "cpu":  # the row counts of drafting at up to ~16 rows
                self.model.warm_up_draft_gemms(max_rows=16 * (1 + self.num_spec))
            self.drafter = MTPDrafter(self.model, self.states, self.kv_views, self.block_size, self.num_spec,
                                      self.device, self.sampler, model_cfg.sliding_window, grammar=self.grammar,
                                      window=config.mtp_window or None)
        elif config.speculative_method == "ngram":
            self.drafter = NgramDrafter(self.states, self.num_spec, grammar=self.grammar)
        # n-gram drafts vary in length per row, which the cost model does not time: always fixed K.
        mode = SpecPolicyMode(config.spec_policy) if config.speculative_method == "mtp" else SpecPolicyMode.FIXED
        self.spec_policy = SpecPolicy(self.num_spec, mode)
        self._last_step_end: float | None = None
        self._sampled_step = False  # whether the last step sampled a non-greedy row (set by _sample)
        self.eos_token_ids = model_cfg.eos_token_ids
        self.check_invariants = invariants.enabled()
        self.kv_tap: KVTap | None = None  # set by a prefill engine in PD (layer-wise KV push)
        # False on a prefill engine in PD: its requests leave after t0, so it runs the MTP layer over
        # the prompts (their MTP KV is handed over) but never drafts, and its steps neither consult
        # the policy nor count in the chosen-k metric (under load they would skew it toward k=0).
        self.proposes_drafts = config.proposes_drafts

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

        input_ids = self._prepare_input_ids(batch)
        ctx = AttentionContext(self.kv_views, batch.layout, self.block_size, self.device, self.model_cfg.sliding_window,
                               self.attention_backend)
        step_tap = self.kv_tap.step(batch.req_ids, batch.layout) if self.kv_tap is not None else None
        if step_tap is not None:
            ctx.tap = step_tap.layer_tap(batch.req_ids, batch.layout)
        hidden = self.forward(input_ids, ctx.positions, ctx)
        if step_tap is not None and not isinstance(self.drafter, MTPDrafter):
            step_tap.last_layer_done()  # else the MTP pass writes the last KV layer
        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, batch, self.states)
        accepted, logprobs = self._sample(batch, hidden)
        self._check_in_vocab(accepted, "sampled")
        self._write_back(batch, accepted)
        drafts = [[] for _ in batch.req_ids]
        if self.drafter is not None:
            self.drafter.kv_tap = step_tap  # the MTP layers' KV of the chunk is reported too
            k = self._choose_num_drafts(batch, accepted)
            drafts = self.drafter.propose(batch, hidden, accepted, k, self._draft_metadata)
            self._check_in_vocab(drafts, "draft")
            if k or not batch.steady:  # else nothing was verified or proposed: no buffer to update
                self._store_drafts(batch, drafts)
            self._time_step(batch, k, start)
        return RunnerOutput(batch.req_ids, accepted, drafts, logprobs, prompt_logprobs)

    # -- pieces --------------------------------------------------------------------------

    def _check_in_vocab(self, rows: list[list[int]], what: str) -> None:
        """The last line of defence of the sampler's contract (every id in [0, vocab), whatever the
        logits hold): an id outside would be streamed to the client and index past the embedding
        table as the next input. Raising fails this step's requests (EngineCore._fail_step)."""
        vocab = self.model_cfg.vocab_size
        for row in rows:
            if row and not all(0 <= t < vocab for t in row):
                raise RuntimeError(f"a {what} token id in {row} is outside the vocabulary [0, {vocab})")

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
            if new.handoff_hidden is not None and isinstance(self.drafter, MTPDrafter):
                self.drafter.seed(slot, new.num_computed_tokens, new.handoff_hidden)
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

    def _sample(self, batch: InputBatch,
                hidden: torch.Tensor) -> tuple[list[list[int]], list[list[TokenLogprobs]] | None]:
        """Tokens each row keeps this step: one sampled token, or verified drafts plus a bonus."""
        if batch.steady and self._plain_greedy(batch.slots):
            # Every row decodes one token by plain argmax: what the general path below computes
            # for such a batch, without its bookkeeping, which is a visible share of a small batch's step.
            self._sampled_step = False
            tokens = fused_ops.argmax(self.model.compute_logits(hidden).float()).tolist()
            return [[t] for t in tokens], None
        if batch.steady and self.fused_sampling and self._plain_random(batch.slots):
            self._sampled_step = True
            return self._sample_plain_random(batch.slots, hidden)
        accepted: list[list[int]] = [[] for _ in batch.req_ids]
        rows = np.nonzero(batch.samples)[0]
        if not len(rows):
            self._sampled_step = False
            return accepted, None
        k = batch.num_drafts[rows]
        # Row r needs logits at its last 1 + k[r] positions (the verified drafts and the bonus);
        # decode and verify steps need every position, prefill chunks only their ends.
        if int(k.sum()) + len(rows) < hidden.shape[0]:
            ends = batch.layout.query_start_loc[1:][rows]
            positions = np.concatenate([np.arange(e - 1 - n, e) for e, n in zip(ends, k)])
            hidden = hidden[torch.from_numpy(positions).to(self.device)]
        logits = self.model.compute_logits(hidden)
        slots = batch.slots[rows]
        table = self.states.draft_tokens_np[slots, : max(1, int(k.max()))].tolist()
        drafts = [row[:n] for row, n in zip(table, k.tolist())]
        # Rows whose drafts were drawn independently go to the standard rejection sampler with their
        # q; the others are verified by matching the target's own (keyed) samples. Most steps are all
        # one or the other, and skip the split (its small array ops are not free at batch 1).
        independent = self.states.draft_has_probs[slots] & (k > 0)
        self._sampled_step = False
        if independent.all():
            kept = self._verify_independent(logits, k, slots, drafts)
            self._sampled_step = True
        elif not independent.any():
            kept = self._verify_matching(logits, k, slots, drafts)
        else:
            kept = [[] for _ in rows]
            starts = np.cumsum(k + 1) - (k + 1)  # row r's logits are [starts[r], starts[r] + 1 + k[r])
            for group, verify in ((np.nonzero(independent)[0], self._verify_independent),
                                  (np.nonzero(~independent)[0], self._verify_matching)):
                picked = logits[torch.from_numpy(np.concatenate(
                    [np.arange(starts[i], starts[i] + 1 + k[i]) for i in group])).to(self.device)]
                for i, toks in zip(group.tolist(), verify(picked, k[group], slots[group], [drafts[i] for i in group])):
                    kept[i] = toks
            self._sampled_step = True
        for row, toks in zip(rows.tolist(), kept):
            accepted[row] = toks
        return accepted, self._logprobs(logits, k, slots, rows, kept, len(batch.req_ids))

    def _verify_matching(self, logits: torch.Tensor, k: np.ndarray, slots: np.ndarray,
                         drafts: list[list[int]]) -> list[list[int]]:
        """Tokens kept per row: every verified position sampled from the target (argmax for greedy
        rows; the noise of a drafted position keyed, see _position_metadata), and the drafts that
        equal those samples (rejection_sampler.accept_matching_prefix). Sets _sampled_step."""
        if self._plain_greedy(slots):  # the target's argmax at every position, no metadata needed
            self._sampled_step = False
            targets = fused_ops.argmax(logits.float()).tolist()
            return accept_matching_prefix(targets, k.tolist(), drafts).accepted_token_ids
        # Row r owns positions [starts[r], starts[r] + 1 + k[r]) at output indices n_out[r] + 0..k[r].
        width = k + 1
        starts = np.cumsum(width) - width
        pos_slots = np.repeat(slots, width)
        out_index = np.repeat(self._num_output(slots) - starts, width) + np.arange(int(width.sum()))
        drafts_before = [d[:j] for d in drafts for j in range(len(d) + 1)]
        drafted = np.arange(int(width.sum())) < np.repeat(starts + k, width)  # all but each row's bonus
        meta = self._position_metadata(pos_slots, out_index, drafts_before, drafted)
        self._sampled_step = not meta.all_greedy  # (for the speculation policy's cost tables)
        constrained = self.grammar.any_active(slots.tolist())
        if constrained:  # structured output: position j masked after drafts[:j]
            meta.allowed_token_mask = self.grammar.position_masks(slots.tolist(), drafts)
        targets = self.sampler(logits, meta).sampled_token_ids.tolist()  # the step's one sync
        kept = accept_matching_prefix(targets, k.tolist(), drafts).accepted_token_ids
        if constrained:  # unconstrained batches skip the per-row matcher calls
            for slot, toks in zip(slots.tolist(), kept):
                self.grammar.advance(slot, toks)
        return kept

    def _verify_independent(self, logits: torch.Tensor, k: np.ndarray, slots: np.ndarray,
                            drafts: list[list[int]]) -> list[list[int]]:
        """Tokens kept per row whose drafts were drawn independently from q (DraftMode.INDEPENDENT:
        unseeded, plain temperature, past min_tokens): the standard rejection sampler
        (fused_ops.rejection_verify). Its uniforms come from the sampler's default generator: these
        rows have no seed to key them by."""
        st, dev = self.states, self.device
        slot_list, k_list = slots.tolist(), k.tolist()
        q = (st.draft_probs[slot_list[0], : k_list[0]] if len(slot_list) == 1
             else torch.cat([st.draft_probs[s, :n] for s, n in zip(slot_list, k_list)]))
        flat = [t for d in drafts for t in d]
        gen = self.sampler._default_generator(dev)  # noqa: SLF001 - same package
        u = torch.rand(len(flat) + len(slot_list), generator=gen, device=dev)  # each draft's, then each row's
        result = fused_ops.rejection_verify(
            logits.float(), torch.tensor([st.sampling_params[s].temperature for s in slot_list], device=dev),
            torch.tensor(k_list, dtype=torch.int32, device=dev), torch.tensor(flat, dtype=torch.int32, device=dev),
            q, self.model.draft_vocab, u[: len(flat)], u[len(flat) :]).tolist()
        return [d[:m] + [tok] for d, (m, tok) in zip(drafts, result)]

    def _sample_plain_random(self, slots: np.ndarray,
                             hidden: torch.Tensor) -> tuple[list[list[int]], list[list[TokenLogprobs]] | None]:
        """One token per row from softmax(logits / T), by inverse CDF with one uniform each from the
        default generator: what the general path draws for such rows (Sampler.sample_from_probs),
        as one C++ pass -- fused_ops.rejection_verify with no drafts, whose final draw is that one --
        instead of the per-position metadata and ~15 torch ops, whose dispatch dominates at a few rows."""
        st, dev, n = self.states, self.device, len(slots)
        logits = self.model.compute_logits(hidden).float()
        temps = torch.tensor([st.sampling_params[s].temperature for s in slots.tolist()], dtype=torch.float32)
        gen = self.sampler._default_generator(dev)  # noqa: SLF001 - same package
        u = torch.rand(n, generator=gen, device=dev)
        no_drafts = torch.empty(0, dtype=torch.int32)
        drawn = fused_ops.rejection_verify(logits, temps, torch.zeros(n, dtype=torch.int32), no_drafts,
                                           torch.empty(0, 0), None, torch.empty(0), u)
        kept = [[t] for t in drawn[:, 1].tolist()]
        return kept, self._logprobs(logits, np.zeros(n, dtype=np.int64), slots, np.arange(n), kept, n)

    def _plain_random(self, slots: np.ndarray) -> bool:
        """Whether sampling these slots' next positions is a plain-temperature draw from the default
        generator: unseeded, no penalties, grammar, top-k, top-p or min-p (RequestStates.plain_random),
        and past min_tokens (no stop token banned)."""
        st = self.states
        return bool(st.plain_random[slots].all() and (self._num_output(slots) >= st.min_tokens[slots]).all())

    def _plain_greedy(self, slots: np.ndarray) -> bool:
        """Whether sampling these slots' next positions is the argmax of the raw logits: greedy,
        no penalties, grammar or logprobs, and past min_tokens (so no stop token is banned at
        any position of a verify window either)."""
        st = self.states
        return bool(st.plain_greedy[slots].all() and (self._num_output(slots) >= st.min_tokens[slots]).all())

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

    def _store_drafts(self, batch: InputBatch, drafts: list[list[int]]) -> None:
        st = self.states
        probs = {}  # batch row -> the distributions its drafts were drawn from (drawn independently)
        if self.drafter.probs is not None:
            probs = {row: self.drafter.probs[i] for i, row in enumerate(self.drafter.probs_rows.tolist())}
        for row in np.nonzero(batch.samples)[0].tolist():
            st.store_drafts(int(batch.slots[row]), drafts[row], probs.get(row) if drafts[row] else None)
        if not st.drafts_shared:
            idx = torch.from_numpy(batch.slots).to(self.device)
            st.draft_tokens[idx] = torch.from_numpy(st.draft_tokens_np[batch.slots]).to(self.device)

    def _num_output(self, slots: np.ndarray) -> np.ndarray:
        return self.states.total_len_np[slots] - self.states.prompt_len[slots]

    def _position_metadata(self, slots: np.ndarray, out_index: np.ndarray, drafts_before: list[list[int]] | None,
                           drafted: np.ndarray | None = None) -> SamplingMetadata:
        """One row per sampled output position: the request's settings, the generator keyed by
        (seed, output index) where it needs one, the min_tokens ban of that index, and -- when
        `drafts_before` is given and a penalty is on -- the penalty context a non-speculative step
        would see there. `drafted`: the positions a draft is (or will be) verified at (None: all).

        Keyed noise is for a seeded request (its tokens must not depend on where they are sampled)
        and for a drafted position (a coupled draft is drawn with the noise its verifier uses).
        Elsewhere an unseeded request draws from the engine's default generator: one uniform per row
        (Sampler.sample_from_probs), where V keyed uniforms would dominate the sampling of a big
        step, and most steps under load draft nothing."""
        st, dev = self.states, self.device
        slot_list, index_list = slots.tolist(), out_index.tolist()
        params = [st.sampling_params[s] for s in slot_list]

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        temps = [p.temperature for p in params]
        keyed = [True] * len(slot_list) if drafted is None else drafted.tolist()
        generators = [position_generator(st.seeds[s], i, dev)
                      if t >= GREEDY_TEMPERATURE_EPS and (key or p.seed is not None) else None
                      for t, s, i, key, p in zip(temps, slot_list, index_list, keyed, params)]
        # min_tokens: output index i may not stop while i < min_tokens (per position of a verify window).
        banned = [list(self.eos_token_ids) + p.stop_token_ids if i < p.min_tokens else []
                  for p, i in zip(params, index_list)]
        prompt_ids = output_ids = None
        if drafts_before is not None and any(p.needs_penalties for p in params):
            tokens = {s: st.all_token_ids[s, : st.total_len_np[s]].tolist() for s in set(slot_list)}
            prompt_ids = [tokens[s][: st.prompt_len[s]] for s in slot_list]
            output_ids = [tokens[s][st.prompt_len[s]:] + d for s, d in zip(slot_list, drafts_before)]
        return SamplingMetadata(
            temperature=col(temps, torch.float32),
            top_k=col([p.top_k for p in params], torch.int32),
            top_p=col([p.top_p for p in params], torch.float32),
            min_p=col([p.min_p for p in params], torch.float32),
            generators=generators,
            repetition_penalty=col([p.repetition_penalty for p in params], torch.float32),
            frequency_penalty=col([p.frequency_penalty for p in params], torch.float32),
            presence_penalty=col([p.presence_penalty for p in params], torch.float32),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            banned_token_ids=banned if any(banned) else None,
            max_num_logprobs=-1,
            all_greedy=all(t < GREEDY_TEMPERATURE_EPS for t in temps),
            no_greedy=all(t >= GREEDY_TEMPERATURE_EPS for t in temps),
            no_penalties=prompt_ids is None,
            no_top_k=all(p.top_k <= 0 for p in params),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p <= 0.0 for p in params),
        )

    def _draft_metadata(self, slots: np.ndarray, j: int) -> SamplingMetadata | None:
        """For the drafter: the settings and keyed noise of the output position draft j will be
        verified against (n_out + j, n_out counted after this step's write-back); no penalties."""
        if all(self.states.sampling_params[s].temperature < GREEDY_TEMPERATURE_EPS for s in slots.tolist()):
            return None
        return self._position_metadata(slots, self._num_output(slots) + j, None)

    # -- speculation policy --------------------------------------------------------------

    def _choose_num_drafts(self, batch: InputBatch, accepted: list[list[int]]) -> int:
        if not self.proposes_drafts:
            return 0
        if not batch.steady:
            verified = np.nonzero(batch.samples & (batch.num_drafts > 0))[0]
            if len(verified):
                self.spec_policy.record_acceptance(batch.num_drafts[verified].tolist(),
                                                   [len(accepted[r]) - 1 for r in verified.tolist()])
        rows = len(batch.slots) if batch.steady else int(batch.samples.sum())
        if self.spec_policy.holds_k0(rows, self._sampled_step):
            return 0
        pending = int(self.states.mtp_pending[batch.slots].sum()) if isinstance(self.drafter, MTPDrafter) else 0
        return self.spec_policy.choose(rows, pending, self._sampled_step)

    def _time_step(self, batch: InputBatch, k: int, start: float) -> None:
        """Feed the cost model: steady-state decode steps only (every row verified k drafts and
        proposed k; no prefill chunk, no stash flush), plus the engine's time between steps."""
        end = time.perf_counter()
        if self._last_step_end is not None and start - self._last_step_end < 0.05:
            self.spec_policy.record_overhead(start - self._last_step_end)
        self._last_step_end = end
        if k:
            steady = (batch.samples.all() and not batch.is_prefilling.any() and (batch.num_drafts == k).all()
                      and not self.drafter.flushed)
        else:
            steady = batch.steady and not self.drafter.flushed
        if steady:
            self.spec_policy.record_step(len(batch.slots), k, end - start, self._sampled_step)

    def _logprobs(self, logits: torch.Tensor, k: np.ndarray, slots: np.ndarray, rows: np.ndarray,
                  kept: list[list[int]], batch_size: int) -> list[list[TokenLogprobs]] | None:
        """Per kept token: its logprob and rank under the raw target logits, plus the top-n."""
        wants = [self.states.sampling_params[int(s)].logprobs for s in slots]
        if all(n is None for n in wants):
            return None
        starts = np.concatenate([[0], np.cumsum(k + 1)[:-1]])
        picks = [(i, starts[i] + j, tok) for i, toks in enumerate(kept) if wants[i] is not None
                 for j, tok in enumerate(toks)]
        idx = torch.tensor([p[1] for p in picks], dtype=torch.long, device=self.device)
        toks = torch.tensor([p[2] for p in picks], dtype=torch.long, device=self.device)
        n_max = max(n for n in wants if n is not None)
        lp = self.sampler.gather_logprobs(torch.log_softmax(logits[idx], dim=-1), toks, n_max)
        ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        result: list[list[TokenLogprobs]] = [[] for _ in range(batch_size)]
        for m, (i, _, _) in enumerate(picks):
            n = wants[i]
            result[int(rows[i])].append(TokenLogprobs(ids[m][0], vals[m][0], ranks[m],
                                                      list(zip(ids[m][1 : 1 + n], vals[m][1 : 1 + n]))))
        return result
