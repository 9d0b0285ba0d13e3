"""Usage details (issue 16 item 4) through the official `openai` client, colocated and PD, with
MTP speculation so that one engine step streams several tokens:
`stream_options.continuous_usage_stats` puts the usage so far on every chunk, and
`usage.prompt_tokens_details.cached_tokens` is the prefix-cache hit (on P under PD)."""
from __future__ import annotations

import asyncio

import openai
import pytest
from conftest import BUNDLED_MODEL
from http_harness import served
from local_client import LocalEngineClient

from engine.config import EngineConfig
from engine.types import SamplingParams

MODEL = "pdserve-tiny"
BLOCK = 16
PROMPT = ("import os\nimport sys\n\n\ndef main(argv=None):\n    \"\"\"Parse the arguments and run.\"\"\"\n"
          "    parser = argparse.ArgumentParser(description=__doc__)\n    parser.add_argument(")
BOTH = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module", params=["colocated", "pd"])
def server(request, tmp_path_factory, tokenizer):
    with served(tmp_path_factory.mktemp(request.param), request.param, tokenizer, MODEL, model=str(BUNDLED_MODEL),
                max_model_len=512, block_size=BLOCK, speculative_method="mtp", num_speculative_tokens=2,
                spec_policy="fixed") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield request.param, s, client


def check_continuous(stream, num_choices: int, max_tokens: int) -> None:
    """Every chunk but the last carries its choice's usage so far; the last the request's total."""
    streamed = dict.fromkeys(range(num_choices), 0)
    prompt_len, multi, final = None, False, None
    for chunk in stream:
        if not chunk.choices:
            final = chunk.usage
            continue
        choice = chunk.choices[0]
        if getattr(chunk, "prompt_token_ids", None) or getattr(choice, "prompt_token_ids", None):
            prompt_len = len(getattr(chunk, "prompt_token_ids", None) or choice.prompt_token_ids)
        got = len(getattr(choice, "token_ids", None) or [])
        streamed[choice.index] += got
        multi |= got > 1
        usage = chunk.usage
        assert usage is not None, "a chunk without usage"
        assert usage.completion_tokens == streamed[choice.index], "completion_tokens != tokens streamed so far"
        assert usage.prompt_tokens == prompt_len and usage.total_tokens == prompt_len + streamed[choice.index]
    assert streamed == dict.fromkeys(range(num_choices), max_tokens)
    assert multi, "no chunk carried several tokens: the speculative case was not exercised"
    assert final is not None and final.completion_tokens == num_choices * max_tokens
    assert final.prompt_tokens == prompt_len and final.prompt_tokens_details is not None


def test_continuous_usage_stats_completions(server):
    _, _, client = server
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, n=2, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    check_continuous(client.completions.create(**args, stream_options=BOTH), 2, 24)
    # Without include_usage nothing changes: no usage on chunks, no usage chunk (as in vLLM).
    chunks = list(client.completions.create(**args, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_continuous_usage_stats_chat(server):
    _, _, client = server
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What does os.path.join do?"}], max_tokens=20,
        temperature=0, stream=True, stream_options=BOTH, extra_body={"ignore_eos": True, "return_token_ids": True})
    check_continuous(stream, 1, 20)


def expected_hit(prompt_len: int) -> int:
    """Whole blocks only, and at least one token is always computed."""
    return (prompt_len - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_cached_tokens_on_a_repeated_prompt(server, route):
    mode, s, client = server
    prefill = "prefill-0" if mode == "pd" else "colocated-0"
    text = f"# {route} in {mode}\n" + PROMPT  # a first block no other test has sent

    def ask(**extra):
        if route == "completions":
            return client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0, **extra)
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                              max_tokens=4, temperature=0, **extra)

    hits = s.hit_blocks(prefill)
    first = ask()
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and s.hit_blocks(prefill) == hits
    second = ask()
    want = expected_hit(first.usage.prompt_tokens)
    assert want >= 2 * BLOCK
    assert second.usage.prompt_tokens_details.cached_tokens == want
    assert (s.hit_blocks(prefill) - hits) * BLOCK == want, "cached_tokens is not the hit the engine reports"
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    final = [c.usage for c in ask(stream=True, stream_options={"include_usage": True}) if c.usage is not None]
    assert len(final) == 1 and final[0].prompt_tokens_details.cached_tokens == want


def test_local_client_reports_cached_tokens():
    """The in-process engine client (`pdserve` tests and the offline server) carries the hit too."""
    client = LocalEngineClient(EngineConfig(model=str(BUNDLED_MODEL), max_model_len=256, block_size=BLOCK))
    prompt = list(range(5, 60))

    async def first_chunk(req_id: str):
        async for chunk in client.generate(req_id, prompt, SamplingParams(max_tokens=2, temperature=0)):
            return chunk

    async def run():
        await client.start()
        try:
            return [await first_chunk(f"r{i}") for i in range(2)]
        finally:
            await client.stop()

    a, b = asyncio.run(run())
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, expected_hit(len(prompt)))
