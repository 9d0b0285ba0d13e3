"""The bf16-weight linear (worker/csrc/bf16_linear.cpp) and the MTP drafter that uses it on CPUs
without native bf16 math: the kernel against its torch reference, the Linear's row threshold,
and exact greedy speculation with it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import bf16_drafter_with_draft_vocab, random_prompts

from engine import LLM, SamplingParams
from worker import model_loader
from worker.models.linear import BF16_MAX_ROWS, Linear, bf16_linear_available, gemm_weight, native_bf16_cpu

pytestmark = pytest.mark.skipif(not bf16_linear_available(), reason="no C++ compiler for the bf16 linear")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize("out_features,in_features", [(1, 8), (7, 100), (13, 256), (64, 704), (1408, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_reference(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g) if bias else None
    got = torch.ops.pdserve_bf16.linear_bf16w(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    # fp32 sums of in_features exact products, in another order than the double reference.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * in_features ** 0.5)


def test_kernel_rejects_bad_inputs():
    w = torch.randn(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.pdserve_bf16.linear_bf16w(torch.randn(2, 8).double(), w, None)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.pdserve_bf16.linear_bf16w(torch.randn(2, 9), w, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.pdserve_bf16.linear_bf16w(torch.randn(2, 8), w, torch.randn(3))


def test_linear_uses_the_bf16_weight_for_few_rows_only():
    lin = Linear(32, 24, bias=True)
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    lin.keep_bf16(lin.weight)
    rounded = lin.weight.detach().bfloat16().float()
    few, many = torch.randn(BF16_MAX_ROWS, 32), torch.randn(BF16_MAX_ROWS + 1, 32)
    with torch.inference_mode():
        torch.testing.assert_close(lin(few), F.linear(few, rounded, lin.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin(many), F.linear(many, lin.weight, lin.bias))  # the fp32 weight


def test_drafter_choice(monkeypatch):
    """A float32 target's drafter on a CPU keeps bf16 weights with fp32 arithmetic, whether or not
    the CPU has bf16 math (oneDNN's bf16 GEMM loses to the bf16-weight kernel at a few rows)."""
    for native in (False, True):
        monkeypatch.setattr(model_loader, "native_bf16_cpu", lambda native=native: native)
        assert model_loader.resolve_draft_dtype("auto", "float32", "cpu") == "bfloat16"
        assert model_loader.draft_weights_only("bfloat16", "float32", "cpu")
    assert not model_loader.draft_weights_only("float32", "float32", "cpu")
    assert not model_loader.draft_weights_only("bfloat16", "bfloat16", "cpu")
    assert not model_loader.draft_weights_only("bfloat16", "float32", "cuda")


@pytest.mark.parametrize("draft_vocab", ["full", "subset"])
def test_bf16_weight_drafter_is_exact(draft_vocab, mtp_checkpoints, references, tmp_path):
    """A float32 target with a bf16-weight MTP drafter (fused layer, bf16 draft head): greedy
    output is transformers', the draft head keeps lm_head's fp32 weight for big inputs."""
    import json

    vocab = "full"
    if draft_vocab == "subset":
        vocab = str(tmp_path / "draft_vocab.json")
        (tmp_path / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(0, 384, 2))}))
    llm = LLM(str(mtp_checkpoints["qwen2"]), max_model_len=320, max_num_seqs=2, block_size=4,
              max_num_batched_tokens=64, speculative_method="mtp", num_speculative_tokens=2, draft_dtype="bfloat16",
              spec_policy="fixed", draft_vocab=vocab)
    model = llm.engine.runner.model
    mtp_linears = [m for m in model.model.mtp_layers.modules() if isinstance(m, Linear)]
    assert mtp_linears and all(m.bf16 is not None for m in mtp_linears)
    assert model.model.mtp_layers[0].fused is not None
    assert model.draft_head.bf16 is not None and model.lm_head.bf16 is None
    assert model.model.mtp_layers[0].input_proj.weight.dtype == torch.float32  # fp32 arithmetic
    if draft_vocab == "full":
        assert model.draft_head.weight is model.lm_head.weight
        # Past the bf16 copy's rows it runs as lm_head does: our kernel's panels, then the packed weight.
        assert model.draft_head.panels is model.lm_head.panels
        assert (model.draft_head.kernel_to, model.draft_head.packed_from) == (model.lm_head.kernel_to,
                                                                              model.lm_head.packed_from)
    prompts = random_prompts(8, 1, 200, 384, 81)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    exact = sum(references["qwen2"].assert_matches(p, o.token_ids, 32, f"bf16 drafter/prompt {i}")
                for i, (p, o) in enumerate(zip(prompts, outs)))
    assert exact >= len(prompts) - 1
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("query_lens", [(3, 2), (5, 4, 6)])
def test_fused_mtp_layer_matches_the_torch_layer(arch, query_lens, mtp_checkpoints):
    """The MTP layer as one C++ op (mtp_layer) against the same layer op by op: the same hidden
    states and the same K/V written into the cache. The last row starts at position 0 (its token
    embedding zeroed); (3, 2) runs the bf16 weights, (5, 4, 6) -- more than BF16_MAX_ROWS tokens --
    the GEMM ones: fp32, or on a CPU with native bf16 math bf16 with the inputs rounded to bf16 (to
    within that rounding). Qwen3 has q/k norms, Llama llama3 RoPE scaling, Qwen2 q/k/v biases.
    Writing only the K/V (mtp_write_kv) writes the same ones."""
    import numpy as np

    from worker.attention import AttentionContext, CacheWriter
    from worker.input_batch import StepLayout

    llm = LLM(str(mtp_checkpoints[arch]), max_model_len=128, max_num_seqs=3, block_size=4,
              speculative_method="mtp", num_speculative_tokens=2, draft_dtype="bfloat16")
    runner = llm.engine.runner
    model, layer = runner.model, runner.model.model.mtp_layers[0]
    assert layer.fused is not None
    rows = len(query_lens)
    tables = np.arange(1, 1 + 4 * rows, dtype=np.int32).reshape(rows, 4)
    layout = StepLayout(tables, np.array([5] * (rows - 1) + [0], np.int32), np.array(query_lens, np.int32))
    tokens = sum(query_lens)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(tokens, model.config.hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=g, dtype=torch.int32)
    runner.kv_cache.normal_(generator=g)
    before = runner.kv_cache.clone()
    results = []
    with torch.inference_mode():
        for fused in (layer.fused, None):
            runner.kv_cache.copy_(before)
            layer.fused = fused
            ctx = AttentionContext(runner.kv_views, layout, 4, runner.device)
            out = model.mtp_forward(0, hidden, ids, ctx.positions, ctx, has_position0=True)
            results.append((out, runner.kv_cache[-1].clone()))
    (fused_out, fused_kv), (torch_out, torch_kv) = results
    rounded = sum(query_lens) > BF16_MAX_ROWS and native_bf16_cpu()  # bf16 inputs: ~3 significant digits
    tol = {"rtol": 2e-2, "atol": 2e-2} if rounded else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(fused_out, torch_out, **tol)
    torch.testing.assert_close(fused_kv, torch_kv, **(tol if rounded else {"rtol": 1e-5, "atol": 1e-5}))
    assert not torch.equal(fused_kv, before[-1])  # the step's K/V were written
    # The layer's K/V alone (positions no draft starts from): what the whole layer writes.
    runner.kv_cache.copy_(before)
    with torch.inference_mode():
        writer = CacheWriter(runner.kv_views, layout, 4, runner.device)
        model.mtp_write_kv(0, hidden, ids, writer.positions, writer, has_position0=True)
    assert torch.equal(runner.kv_cache[-1], torch_kv)
    assert torch.equal(runner.kv_cache[:-1], before[:-1])


def race_log_scores(drafter, h: torch.Tensor, meta) -> torch.Tensor:
    """The log scores of the exponential race (worker/sample/sampler.py, keyed rows) by which the Python path
    draws these rows' drafts: log p - log E, E the Exp(1) draws of each row's own generator."""
    probs = drafter.sampler.compute_probs(drafter.model.compute_draft_logits(h).float(), meta)
    noise = torch.stack([torch.empty(probs.shape[1]).uniform_(generator=gen) for gen in meta.generators])
    return probs.log() - (-(-noise).log1p()).clamp_min(torch.finfo(torch.float32).tiny).log()


def assert_race_tie(scores: torch.Tensor, ours: int, theirs: int, label: str) -> None:
    """Two paths drew different tokens from one race: a float-noise tie, its top two log scores those
    tokens, within the conftest logit-gap tolerance."""
    top2 = scores.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    assert set(top2.indices.tolist()) == {ours, theirs} and gap < 1e-4, (
        f"{label}: drafts {ours} and {theirs} differ; the race's top two are {top2.indices.tolist()} {gap:.3g} "
        "apart, not a float-noise tie")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_fused_drafts_are_the_layer_by_layer_drafts(arch, temperature, mtp_checkpoints, monkeypatch):
    """Drafting as one C++ op (mtp_draft: a steady step's MTP pass and draft chain, or the chain
    alone) against mtp_layer calls and draft heads from Python: the same drafts, step by step --
    greedy: the same arithmetic; seeded T=1: the same coupled draws, the race computed in another
    form (log-space), so a row's drafts may part only at a near-tie of the Python path's race
    (and differ from there on, each chain on its own); rows of a batch at different positions,
    prefill chunks, a draft vocabulary on qwen2. Output does not depend on the drafts."""
    import json
    import tempfile
    from pathlib import Path

    from worker.models.llama import CausalLM
    from worker.spec_decode.mtp import MTPDrafter

    prompts = random_prompts(6, 3, 90, 384, 91)
    vocab = "full"
    if arch == "qwen2":
        vocab = str(Path(tempfile.mkdtemp()) / "draft_vocab.json")
        Path(vocab).write_text(json.dumps({"token_ids": list(range(0, 384, 2))}))
    propose, chain, pick = MTPDrafter.propose, CausalLM.fused_drafts, MTPDrafter._pick
    passes = []  # per fused call: whether it ran the MTP pass too
    races: list[dict] = []  # Python path, per propose call: (slot, draft j) -> the race's log scores

    def recording_pick(self, h, slots, j, draft_meta, walk=None):
        meta = draft_meta(slots, j)
        if meta is not None and races:
            races[-1].update({(slot, j): row for slot, row in zip(slots.tolist(), race_log_scores(self, h, meta))})
        return pick(self, h, slots, j, draft_meta, walk)

    def counting(self, *args, **kwargs):
        passes.append(kwargs.get("pass_ids") is not None)
        return chain(self, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "fused_drafts", counting)
    runs = []
    for fused in (True, False):
        seen: list[list[list[int]]] = []

        def recording(self, batch, *args, seen=seen, fused=fused):
            if not fused:
                races.append({"slots": batch.slots.tolist()})
            drafts = propose(self, batch, *args)
            seen.append(drafts.token_ids)
            return drafts

        monkeypatch.setattr(MTPDrafter, "propose", recording)
        monkeypatch.setattr(MTPDrafter, "_pick", recording_pick)
        llm = LLM(str(mtp_checkpoints[arch]), max_model_len=160, max_num_seqs=4, block_size=4,
                  max_num_batched_tokens=48, speculative_method="mtp", num_speculative_tokens=3,
                  spec_policy="fixed", draft_dtype="bfloat16", draft_vocab=vocab)
        llm.engine.runner.drafter.fused_chain = fused
        params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=7)
        outs = llm.generate(prompts, params)
        runs.append(([o.token_ids for o in outs], seen, llm.engine.scheduler.spec_stats.num_accepted_tokens))
    (fused_out, fused_drafts, accepted), (torch_out, torch_drafts, _) = runs
    assert fused_out == torch_out
    assert passes.count(True) > 10 and passes.count(False) > 2, passes  # both forms of the op ran
    assert any(sum(map(bool, step)) > 1 for step in fused_drafts)  # batched rows
    if temperature == 0.0:
        assert fused_drafts == torch_drafts
    else:
        assert len(fused_drafts) == len(torch_drafts) == len(races)
        compared = 0
        for step, (x_rows, y_rows, race) in enumerate(zip(fused_drafts, torch_drafts, races)):
            for slot, x, y in zip(race["slots"], x_rows, y_rows):
                assert len(x) == len(y), (step, slot)
                parted = next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
                compared += len(x) if parted is None else parted + 1
                # The recorded race is the one the Python path drew by: its winners are y's drafts.
                assert [int(race[slot, j].argmax()) for j in range(len(y))] == y, (step, slot)
                if parted is not None:
                    assert_race_tie(race[slot, parted], x[parted], y[parted], f"step {step} slot {slot} draft {parted}")
        assert compared > 100
        assert accepted > 0  # coupled draws: drafts equal to the verifier's samples


def test_independent_fused_drafts_are_drawn_from_q(mtp_checkpoints, tmp_path):
    """DraftMode.INDEPENDENT in the C++ chain (mtp_draft with draft_probs): q is the softmax of the
    draft head's logits at the row's temperature over the draft vocabulary, and the drafts are
    distributed as q (many rows sharing one hidden state, fresh noise each)."""

    import numpy as np
    from scipy.stats import chisquare

    llm = bf16_drafter_with_draft_vocab(mtp_checkpoints["qwen2"], tmp_path)
    runner = llm.engine.runner
    model, (k_cache, v_cache) = runner.model, runner.kv_views[-1]
    vocab_ids = model.draft_vocab
    rows, temperature = 20000, 0.7
    g = torch.Generator().manual_seed(5)
    h = (3 * torch.randn(1, model.config.hidden_size, generator=g)).expand(rows, -1).contiguous()
    probs = torch.empty(rows, 1, len(vocab_ids))
    with torch.inference_mode():
        drafts = model.fused_drafts(h, torch.full((rows,), 7, dtype=torch.long), 1, k_cache, v_cache,
                                    torch.zeros(rows, 4, dtype=torch.int32), 4, None,
                                    noise=torch.rand(rows, 1, 1, generator=g),
                                    inv_temp=torch.full((rows,), 1 / temperature), draft_probs=probs)
        # (Both over more than BF16_MAX_ROWS rows: the head's GEMM weight, as the op uses for this many --
        # bf16, with the input rounded to bf16, on a CPU with native bf16 math.)
        head = gemm_weight(model.draft_head)
        logits = F.linear(h[: 2 * BF16_MAX_ROWS].to(head.dtype), head)[0].float()
        reference = torch.softmax(logits / temperature, dim=-1)
    torch.testing.assert_close(probs[:, 0], reference.expand(rows, -1), rtol=1e-3, atol=1e-6)
    assert set(drafts.flatten().tolist()) <= set(vocab_ids.tolist())
    index = {int(t): i for i, t in enumerate(vocab_ids.tolist())}
    counts = np.bincount([index[t] for t in drafts.flatten().tolist()], minlength=len(vocab_ids))
    expected = reference.double().numpy() * rows
    common = expected >= 5  # chi-square cells with enough mass; the rest pooled
    observed = np.append(counts[common], counts[~common].sum())
    expected = np.append(expected[common], expected[~common].sum())
    assert common.sum() > 5
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3
