"""Prompt logprobs (issue 16 item 3): the engine's prompt_logprobs against transformers' fp32
log_softmax, over chunked prefill, prefix caching and preemption; and the completions API's
`echo` + `logprobs` through the official `openai` client, colocated and PD (computed on P)."""
from __future__ import annotations

import openai
import pytest
import torch
from conftest import BUNDLED_MODEL, Reference, random_prompts
from http_harness import served

from engine import LLM, SamplingParams

TOL = 1e-4
BLOCK = 16


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """transformers fp32: row i is log_softmax of the logits at position i (it predicts token i + 1)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_prompt_logprobs(ours, prompt: list[int], ref: torch.Tensor, num_top: int, label: str) -> None:
    assert ours is not None and len(ours) == len(prompt), f"{label}: one entry per prompt token"
    assert ours[0] is None, f"{label}: the first prompt token has no logprob"
    for i in range(1, len(prompt)):
        lp, row = ours[i], ref[i - 1]
        want = float(row[prompt[i]])
        assert lp.token_id == prompt[i], f"{label}: position {i} is about the wrong token"
        assert abs(lp.logprob - want) <= TOL, f"{label}: token {i}: {lp.logprob} vs transformers {want}"
        # Rank 1 = most likely; allow float-noise ties around the token's own value.
        assert int((row > want + TOL).sum()) + 1 <= lp.rank <= int((row > want - TOL).sum()) + 1, f"{label}: rank {i}"
        assert len(lp.top) == num_top, f"{label}: {num_top} alternatives at {i}"
        best = row.topk(num_top).values.tolist() if num_top else []
        for (tok, value), ref_value in zip(lp.top, best):
            assert abs(value - ref_value) <= TOL and abs(value - float(row[tok])) <= TOL, f"{label}: top at {i}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_prompt_logprobs_equal_transformers(arch, checkpoints, references):
    """Chunked prefill (32-token budget), several requests per step, top-n 0 and 5, one without;
    then again: a prompt-logprob request skips the prefix cache, a plain one hits it."""
    llm = LLM(str(checkpoints[arch]), max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4,
              block_size=BLOCK, num_kv_blocks=128)
    prompts = random_prompts(5, 1, 150, 384, seed=7)
    wants = [5, 0, 5, None, 2]
    params = [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=n) for n in wants]
    refs = [reference_logprobs(references[arch].model, p) for p in prompts]
    for round_ in range(2):
        outs = llm.generate(prompts, params)
        for i, (p, n, out) in enumerate(zip(prompts, wants, outs)):
            label = f"{arch}/round {round_}/prompt {i} ({len(p)} tokens)"
            if n is None:
                assert out.prompt_logprobs is None, label
                expected_hit = (len(p) - 1) // BLOCK * BLOCK if round_ else 0
                assert out.num_cached_tokens == expected_hit, label
            else:
                assert_prompt_logprobs(out.prompt_logprobs, p, refs[i], n, label)
                assert out.num_cached_tokens == 0, f"{label}: prompt logprobs skip the prefix cache"
            assert out.token_ids == references[arch].generate(p, 2)[0], label


def test_prompt_logprobs_survive_preemption(checkpoints, references):
    """Too few KV blocks for four long prompts at once: requests are preempted mid-prefill and
    prefill again from scratch; their prompt logprobs are still whole and exact."""
    llm = LLM(str(checkpoints["qwen3"]), max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4,
              block_size=BLOCK, num_kv_blocks=17)
    prompts = random_prompts(4, 120, 150, 384, seed=11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1))
    assert llm.engine.scheduler.num_preemptions > 0, "the test needs preemption to happen"
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = reference_logprobs(references["qwen3"].model, p)
        assert_prompt_logprobs(out.prompt_logprobs, p, ref, 1, f"preempted/prompt {i}")
        references["qwen3"].assert_matches(p, out.token_ids, 24, f"preempted/prompt {i}")


# -- over HTTP ---------------------------------------------------------------------------------

MODEL = "pdserve-tiny"
PROMPT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
          "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nclass Stack:\n    def __init__(self):\n"
          "        self.items = []\n\n    def push(self, item):\n")
NEW = 6


@pytest.fixture(scope="module")
def bundled_ref() -> Reference:
    return Reference(BUNDLED_MODEL)


@pytest.fixture(scope="module", params=["colocated", "pd"])
def oai(request, tmp_path_factory, tokenizer):
    """The bundled model behind the HTTP API as `make serve` runs it (MTP on); a 64-token budget makes
    P prefill the prompt in chunks."""
    with served(tmp_path_factory.mktemp(request.param), request.param, tokenizer, MODEL, model=str(BUNDLED_MODEL),
                max_model_len=512, block_size=BLOCK, max_num_batched_tokens=64, speculative_method="mtp",
                num_speculative_tokens=2) as s:
        yield request.param, openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_http_echo_logprobs_equal_transformers(oai, bundled_ref, tokenizer):
    mode, client = oai
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True, logprobs=3,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**args)
    choice = r.choices[0]
    prompt = choice.prompt_token_ids
    assert len(prompt) > 64, "the prompt must span several prefill chunks"
    lps = choice.logprobs
    n = len(prompt)
    assert len(lps.tokens) == n + NEW and lps.tokens[:n] == [tokenizer.decode([t]) for t in prompt]
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None, f"{mode}: the first token's is null"
    ref = reference_logprobs(bundled_ref.model, prompt)
    for i in range(1, n):
        want = float(ref[i - 1, prompt[i]])
        assert abs(lps.token_logprobs[i] - want) <= TOL, f"{mode}: prompt token {i}"
        top = lps.top_logprobs[i]
        assert 3 <= len(top) <= 4 and abs(top[lps.tokens[i]] - want) <= TOL, f"{mode}: prompt token {i}'s top"
        assert abs(max(top.values()) - float(ref[i - 1].max())) <= TOL, f"{mode}: prompt token {i}'s best"
    # The generated part goes on as without echo: greedy == transformers, logprobs of its logits.
    out_ids, out_logits = bundled_ref.generate(prompt, NEW)
    assert choice.token_ids == out_ids
    gen_ref = torch.log_softmax(out_logits, dim=-1)
    for j, t in enumerate(out_ids):
        assert abs(lps.token_logprobs[n + j] - float(gen_ref[j, t])) <= TOL, f"{mode}: output token {j}"
    assert choice.text.startswith(PROMPT)
    assert lps.text_offset[0] == 0 and lps.text_offset[n] == len(PROMPT)
    assert lps.text_offset == sorted(lps.text_offset)
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # such a request skips the prefix cache

    # Streamed: the prompt (and its logprobs) in the first chunk, the same numbers in all.
    streamed = {"tokens": [], "token_logprobs": [], "text": ""}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            streamed["text"] += c.text
            if c.logprobs is not None:
                streamed["tokens"] += c.logprobs.tokens
                streamed["token_logprobs"] += c.logprobs.token_logprobs
    assert streamed["tokens"] == lps.tokens and streamed["text"] == choice.text
    # The same numbers up to rounding: the adaptive policy may verify a different number of drafts
    # per step in the two runs, and a linear's kernel (oneDNN or MKL) is chosen by row count.
    assert streamed["token_logprobs"][0] is None
    assert all(abs(a - b) <= 1e-5 for a, b in zip(streamed["token_logprobs"][1:], lps.token_logprobs[1:], strict=True))


def test_http_echo_without_logprobs(oai):
    _, client = oai
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0)
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text and echo.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, echo=True, logprobs=21)
