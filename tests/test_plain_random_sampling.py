"""Decode steps whose rows all sample at a plain temperature draw with one C++ pass
(ModelRunner._sample_plain_random): the tokens must follow softmax(logits / T) of the model, as
transformers computes it, for each row's own temperature."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from distributions import assert_matches_distribution, reference_probs

from engine import LLM, SamplingParams

N = 4000
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=6, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   initializer_range=0.5, eos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("smallvocab_plain")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def test_plain_temperature_decode_steps_follow_the_distribution(small_vocab_model, monkeypatch):
    import transformers

    from worker.model_runner import ModelRunner

    fast_rows = []
    original = ModelRunner._sample_plain_random

    def counted(self, slots, hidden):
        fast_rows.append(len(slots))
        return original(self, slots, hidden)

    monkeypatch.setattr(ModelRunner, "_sample_plain_random", counted)
    llm = LLM(str(small_vocab_model), max_model_len=32, max_num_seqs=256)
    temperatures = [1.0 if i % 2 else 0.6 for i in range(N)]  # mixed in every batch
    outs = llm.generate([PROMPT] * N, [SamplingParams(temperature=t, max_tokens=2, ignore_eos=True)
                                       for t in temperatures])
    assert sum(fast_rows) >= N // 2, f"the plain-temperature path drew only {sum(fast_rows)} tokens"

    model = transformers.AutoModelForCausalLM.from_pretrained(small_vocab_model, dtype=torch.float32).eval()
    pairs = collections.Counter((t, tuple(o.token_ids)) for t, o in zip(temperatures, outs))
    tested = 0
    for temp in (0.6, 1.0):
        firsts = collections.Counter(toks[0] for t, toks in zip(temperatures, (o.token_ids for o in outs)) if t == temp)
        for t1, n in firsts.items():
            if n < 600:
                continue
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + [t1]])).logits[0, -1].numpy()
            seconds = np.array([t2 for (t, (a, t2)), k in pairs.items() if t == temp and a == t1 for _ in range(k)])
            assert_matches_distribution(seconds, reference_probs(logits, temperature=temp), f"T={temp}, after {t1}")
            tested += 1
    assert tested >= 2, f"too few first tokens with enough samples: {pairs}"
