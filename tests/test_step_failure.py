"""An exception inside one step's execute_model fails the requests of that step, and only them:
the loop goes on, the invariants hold (PDSERVE_DEBUG_INVARIANTS=1), and later requests are
served exactly (issue 45: no request may crash or freeze an engine)."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import random_prompts

from engine import LLM, SamplingParams
from engine.core import EngineCore
from engine.types import FinishReason
from scheduler.scheduler import RequestUpdate

VOCAB = 384
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(mtp_checkpoints):
    # MTP: the failed step leaves drafts, stashed hidden states and the policy's state behind too.
    llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=128, block_size=4, max_num_seqs=2,
              speculative_method="mtp", num_speculative_tokens=2)
    yield llm
    llm.shutdown()


def run(core: EngineCore) -> dict[str, list[RequestUpdate]]:
    out: dict[str, list[RequestUpdate]] = {}
    while core.has_unfinished():
        for u in core.step():
            out.setdefault(u.req_id, []).append(u)
    core.step()  # frees the last slots
    return out


def tokens(updates: list[RequestUpdate]) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]


@pytest.mark.parametrize("where", ["verifier.sample", "_write_back", "drafter.propose"])
def test_a_failing_step_fails_only_its_requests(llm, monkeypatch, where):
    """Steps 1-2 run A and B (max_num_seqs=2: C waits); step 3 raises `where` in the runner, after
    the forward (and, for _write_back / drafter.propose, after the runner changed its own state).
    A and B end with a not-retryable error; C, never in that step, and D, added afterwards, give
    exactly what they give alone."""
    core = llm.engine
    a, b, c, d = random_prompts(4, 9, 20, VOCAB, 3)
    alone = {name: llm.generate([p], GREEDY)[0].token_ids for name, p in zip("cd", (c, d))}
    for name, prompt in zip("abc", (a, b, c)):
        core.add_request(prompt, GREEDY, req_id=name)
    seen = [u for _ in range(2) for u in core.step()]
    assert {u.req_id for u in seen} == {"a", "b"}

    part, _, name = where.rpartition(".")
    owner = getattr(core.runner, part) if part else core.runner
    original = getattr(owner, name)

    def boom(*args, **kwargs):
        original(*args, **kwargs)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(owner, name, boom)
    failed = core.step()
    monkeypatch.undo()
    assert sorted(u.req_id for u in failed) == ["a", "b"]
    for u in failed:
        assert u.finish_reason == FinishReason.ERROR and not u.retryable and "injected fault" in u.error
    assert core.step_times.failed_steps >= 1

    core.add_request(d, GREEDY, req_id="d")
    out = run(core)
    assert set(out) == {"c", "d"}
    assert tokens(out["c"]) == alone["c"] and tokens(out["d"]) == alone["d"]
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert not core.runner.states.req_id_to_slot


def test_an_out_of_vocabulary_token_fails_the_step(llm, monkeypatch):
    """A sampled id outside [0, vocab) -- what NaN probabilities used to yield -- is never streamed
    nor fed back as input: the step's requests fail and the engine goes on."""
    core = llm.engine
    prompt = random_prompts(1, 10, 10, VOCAB, 5)[0]
    original = core.runner.verifier.sample

    def bad_token(batch, hidden):
        tokens = original(batch, hidden)
        return dataclasses.replace(tokens, accepted=[[VOCAB] for _ in tokens.accepted])

    core.add_request(prompt, GREEDY, req_id="bad")
    monkeypatch.setattr(core.runner.verifier, "sample", bad_token)
    failed = core.step()
    monkeypatch.undo()
    assert [(u.req_id, u.finish_reason, u.new_token_ids) for u in failed] == [("bad", FinishReason.ERROR, [])]
    assert "outside the vocabulary" in failed[0].error
    assert llm.generate([prompt], GREEDY)[0].token_ids == llm.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize("mode,instance", [("colocated", "colocated-0"), ("pd", "prefill-0"), ("pd", "decode-0")])
def test_a_failing_step_over_http(tmp_path, mode, instance):
    """One step of `instance` raises: its request gets an error answer, nobody is declared dead,
    and the next request is served exactly as before."""
    import httpx
    from conftest import BUNDLED_MODEL
    from http_harness import served

    body = {"prompt": [5, 17, 300, 42, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with served(tmp_path, mode, None, "m", model=str(BUNDLED_MODEL), max_model_len=128, block_size=16,
                speculative_method="mtp", num_speculative_tokens=2) as s, \
            httpx.Client(base_url=s.url, timeout=60) as http:
        before = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        runner = s.engines[instance].core.runner
        original, calls = runner.verifier.sample, []

        def fails_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected fault")
            return original(*args, **kwargs)

        runner.verifier.sample = fails_once
        try:
            r = http.post("/v1/completions", json=body)
        finally:
            runner.verifier.sample = original
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"], r.text
        assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == before
        assert http.get("/health").status_code == 200
        assert all(not e.stopping for e in s.engines.values())
