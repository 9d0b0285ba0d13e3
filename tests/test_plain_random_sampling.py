"""Decode steps whose rows all sample at a plain temperature draw with one C++ pass
(Verifier._sample_plain_random): the tokens must follow softmax(logits / T) of the model, as
transformers computes it, for each row's own temperature."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from conftest import make_small_vocab_checkpoint
from distributions import assert_matches_distribution, reference_probs

from engine import LLM, SamplingParams

N = 4000
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    return make_small_vocab_checkpoint(tmp_path_factory.mktemp("smallvocab_plain"), seed=5)


def test_plain_temperature_decode_steps_follow_the_distribution(small_vocab_model, monkeypatch):
    import transformers

    from worker.sample.verifier import Verifier

    fast_rows = []
    original = Verifier._sample_plain_random

    def counted(self, slots, hidden):
        fast_rows.append(len(slots))
        return original(self, slots, hidden)

    monkeypatch.setattr(Verifier, "_sample_plain_random", counted)
    llm = LLM(str(small_vocab_model), max_model_len=32, max_num_seqs=256)
    temperatures = [1.0 if i % 2 else 0.6 for i in range(N)]  # mixed in every batch
    outs = llm.generate([PROMPT] * N, [SamplingParams(temperature=t, max_tokens=2, ignore_eos=True)
                                       for t in temperatures])
    assert sum(fast_rows) >= N // 2, f"the plain-temperature path drew only {sum(fast_rows)} tokens"

    model = transformers.AutoModelForCausalLM.from_pretrained(small_vocab_model, dtype=torch.float32).eval()
    seconds = collections.defaultdict(list)  # (temperature, first token) -> the second tokens drawn after it
    for temp, out in zip(temperatures, outs):
        seconds[temp, out.token_ids[0]].append(out.token_ids[1])
    tested = 0
    for (temp, first), drawn in seconds.items():
        if len(drawn) < 600:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + [first]])).logits[0, -1].numpy()
        expected = reference_probs(logits, temperature=temp)
        assert_matches_distribution(np.array(drawn), expected, f"T={temp}, after {first}")
        tested += 1
    assert tested >= 2, f"too few first tokens with enough samples: { {k: len(v) for k, v in seconds.items()} }"
