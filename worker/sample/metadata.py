"""Per-position sampling settings, built from the request-state slots.

A step samples one or more output positions per row (a verify window has 1 + k). Each position
gets its request's settings, the generator keyed by (seed, output index) where it needs one, the
min_tokens ban of that index and, where a penalty is on, the context a non-speculative step
would see there.
"""
from __future__ import annotations

import numpy as np
import torch

from worker.sample.sampler import GREEDY_TEMPERATURE_EPS, SamplingMetadata, position_generator
from worker.states import RequestStates


def num_output(states: RequestStates, slots: np.ndarray) -> np.ndarray:
    """Output tokens each slot has so far."""
    return states.total_len_np[slots] - states.prompt_len[slots]


class PositionMetadata:
    """Builds SamplingMetadata with one row per sampled output position."""

    def __init__(self, states: RequestStates, eos_token_ids: list[int], device: torch.device) -> None:
        self.states, self.eos_token_ids, self.device = states, eos_token_ids, device

    def __call__(self, slots: np.ndarray, out_index: np.ndarray, drafts_before: list[list[int]] | None,
                 drafted: np.ndarray | None = None) -> SamplingMetadata:
        """One row per (slot, output index): `drafts_before`, when given and a penalty is on, the
        drafts before that position (their penalty context); `drafted`: the positions a draft is
        (or will be) verified at (None: all).

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

    def for_draft(self, slots: np.ndarray, j: int) -> SamplingMetadata | None:
        """For the drafter: the settings and keyed noise of the output position draft j will be
        verified against (n_out + j, n_out counted after this step's write-back); no penalties.
        None when every row is greedy."""
        if all(self.states.sampling_params[s].temperature < GREEDY_TEMPERATURE_EPS for s in slots.tolist()):
            return None
        return self(slots, num_output(self.states, slots) + j, None)
