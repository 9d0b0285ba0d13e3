"""Handshake (issue 14, holes 4 and 5): a refused handshake is tried again with a backoff, and the
compatibility hash covers config.json and every tensor, with a refusal that names what differs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import zmq
from conftest import make_checkpoint
from kv_harness import FakeClock, kv_shape, pump
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, ModelConfig
from kv_transfer import receiver as receiver_mod
from kv_transfer.handshake import compat_description, compat_hash, describe_difference
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender

SHAPE = kv_shape()


def test_prefill_restarted_with_the_right_key_is_used_again(tmp_path: Path):
    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/p-kv"
    src, dst = torch.randn(SHAPE), torch.zeros(SHAPE)
    clock = FakeClock()  # the receiver's backoff after a refusal runs on it
    receiver = KVReceiver(ctx, dst, "h", "{}", "decode-0", key="right", clock=clock)
    wrong = KVSender(ctx, addr, src, "h", "{}", "prefill-0", lambda *_: None, key="wrong")
    try:
        wrong.hold("r1", [0, 1], 8, 3, "t1")
        receiver.start("r1", addr, [0, 1], "t1", 8)
        done, failed = pump(wrong, receiver)
        assert not done and "key mismatch" in failed[0].reason
        wrong.close()  # the operator fixes the key and restarts P at the same address
        right = KVSender(ctx, addr, src, "h", "{}", "prefill-0", lambda *_: None, key="right")
        try:
            receiver.start("r2", addr, [2, 3], "t2", 8)  # within the backoff: refused at once, no hang
            done, failed = pump(right, receiver)
            assert not done and "refused the handshake" in failed[0].reason
            clock.advance(receiver_mod.REJECT_BACKOFF_S + 0.01)
            right.hold("r3", [4, 5], 8, 3, "t3")
            receiver.start("r3", addr, [4, 5], "t3", 8)
            done, failed = pump(right, receiver)
            assert [d.req_id for d in done] == ["r3"] and not failed, failed
            assert torch.equal(dst[:, :, 4:6], src[:, :, 4:6])
            assert receiver.peers[addr].state == "ready" and receiver.stats.handshakes_rejected == 1
        finally:
            right.close()
    finally:
        receiver.close()
        ctx.term()


def describe(model: Path) -> dict:
    return compat_description(EngineConfig(model=str(model)), ModelConfig.from_dir(model), 2)


def refusal(model_p: Path, model_d: Path, tmp_path: Path) -> str:
    """The reason D gets when handshaking with P (empty if accepted)."""
    ctx = zmq.Context()
    desc_p, desc_d = describe(model_p), describe(model_d)
    sender = KVSender(ctx, f"ipc://{tmp_path}/p-{model_d.name}", torch.zeros(SHAPE), compat_hash(desc_p),
                      json.dumps(desc_p), "prefill-0", lambda *_: None,
                      compare=lambda theirs: describe_difference(desc_p, theirs))
    receiver = KVReceiver(ctx, torch.zeros(SHAPE), compat_hash(desc_d), json.dumps(desc_d), "decode-0")
    try:
        sender.hold("r", [0], 4, 1, "t")
        receiver.start("r", sender.address, [0], "t", 4)
        done, failed = pump(sender, receiver)
        return failed[0].reason if failed else ""
    finally:
        sender.close()
        receiver.close()
        ctx.term()


def test_checkpoints_differing_in_one_late_tensor_are_refused_naming_it(tmp_path: Path):
    base = make_checkpoint("qwen2", tmp_path / "base")
    tuned = tmp_path / "tuned"
    shutil.copytree(base, tuned)
    weights = load_file(tuned / "model.safetensors")
    late = "model.layers.1.mlp.down_proj.weight"  # the last layer; the embedding is untouched
    weights[late] = weights[late] + 0.01 * torch.randn_like(weights[late])
    save_file(weights, tuned / "model.safetensors", metadata={"format": "pt"})
    assert (base / "model.safetensors").stat().st_size == (tuned / "model.safetensors").stat().st_size
    assert compat_hash(describe(base)) != compat_hash(describe(tuned))
    reason = refusal(base, tuned, tmp_path)
    assert "incompatible KV layout" in reason and f"weights of tensor {late}" in reason, reason
    assert reason.count("weights of tensor") == 1  # only the tensor that differs is named
    assert refusal(base, base, tmp_path) == ""  # the same checkpoint is accepted


def test_checkpoints_differing_in_one_rope_field_are_refused_naming_it(tmp_path: Path):
    base = make_checkpoint("qwen2", tmp_path / "base")
    other = tmp_path / "rope"
    shutil.copytree(base, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0
    (other / "config.json").write_text(json.dumps(config))
    reason = refusal(base, other, tmp_path)
    assert "config.rope_parameters" in reason and "500000.0" in reason, reason
    assert "weights" not in reason


def test_fingerprint_samples_the_whole_tensor(tmp_path: Path):
    """A change at the very end of a large tensor changes its fingerprint (the old hash read only
    the first MiB of each file)."""
    path = tmp_path / "big"
    path.mkdir()
    big = torch.zeros(1024, 1024)  # 4 MiB
    save_file({"a.weight": big}, path / "model.safetensors")
    from kv_transfer.handshake import tensor_fingerprints

    before = tensor_fingerprints(path)
    big[-1, -8:] = 1.0
    save_file({"a.weight": big}, path / "model.safetensors")
    assert tensor_fingerprints(path) != before


def test_an_int8_prefill_and_an_fp32_decode_are_refused_naming_the_quantization(tmp_path: Path):
    """The same checkpoint run with --quantization int8 on one side only is a different model."""
    base = make_checkpoint("qwen2", tmp_path / "base")
    fp32 = compat_description(EngineConfig(model=str(base)), ModelConfig.from_dir(base), 2)
    int8 = compat_description(EngineConfig(model=str(base), quantization="int8"), ModelConfig.from_dir(base), 2)
    assert compat_hash(fp32) != compat_hash(int8)
    difference = describe_difference(fp32, json.dumps(int8))
    assert "quantization" in difference, difference
