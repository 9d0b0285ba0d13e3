"""Prompt logprobs (vLLM's `prompt_logprobs`; the OpenAI completions `echo` with `logprobs`).

Prompt token i's logprob is read from the target's distribution at position i - 1, so a prefill
chunk over positions [c, c + q) yields the logprobs of tokens c + 1 .. min(c + q, prompt_len - 1)
(the last prompt position predicts the first output token, which the sampler handles). Chunks of
a chunked prefill each add theirs; the scheduler strings them together. Only the slots the
scheduler flagged at admission run this, a bounded number of positions at a time, so that the
vocabulary-wide logits of a long chunk never exist all at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.types import TokenLogprobs
from worker.sample.sampler import Sampler

if TYPE_CHECKING:
    from worker.input_batch import InputBatch
    from worker.models.llama import CausalLM
    from worker.states import RequestStates

POSITIONS_PER_PASS = 256  # logits of [256, vocab] fp32 at a time: 150 MB for a 150k vocabulary


def compute_prompt_logprobs(model: CausalLM, hidden: torch.Tensor, batch: InputBatch,
                            states: RequestStates) -> dict[str, list[TokenLogprobs]]:
    """Per flagged row of the step: the logprobs of the prompt tokens its chunk predicts."""
    out: dict[str, list[TokenLogprobs]] = {}
    flagged = states.computes_prompt_logprobs[batch.slots]
    if not flagged.any():
        return out
    layout = batch.layout
    for row in flagged.nonzero()[0].tolist():
        slot = int(batch.slots[row])
        first = int(layout.num_computed[row])  # position of the chunk's first token
        end = min(first + int(layout.query_lens[row]), int(states.prompt_len[slot]) - 1)
        if end <= first:
            continue  # past the prompt (or a one-token prompt): nothing to predict inside it
        start = int(layout.query_start_loc[row])
        targets = states.all_token_ids[slot, first + 1 : end + 1]
        num_top = states.sampling_params[slot].prompt_logprobs or 0
        out[batch.req_ids[row]] = _logprobs(model, hidden[start : start + end - first], targets, num_top)
    return out


def _logprobs(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    result: list[TokenLogprobs] = []
    for i in range(0, hidden.shape[0], POSITIONS_PER_PASS):
        logits = model.compute_logits(hidden[i : i + POSITIONS_PER_PASS])
        lp = Sampler.gather_logprobs(torch.log_softmax(logits, dim=-1), targets[i : i + POSITIONS_PER_PASS], num_top)
        ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        result += [TokenLogprobs(t[0], v[0], r, list(zip(t[1:], v[1:]))) for t, v, r in zip(ids, vals, ranks)]
    return result
