"""Per-transfer checksum (issue 14, hole 6): a payload corrupted on the way is detected on the
decode side before admission; the request is re-prefilled or fails clearly, never a 200 with
wrong tokens."""
from __future__ import annotations

from conftest import random_prompts
from kv_harness import VOCAB, greedy, pd_pair
from pd_harness import generate_all, wait_blocks_free

from engine.config import KVTransferConfig
from kv_transfer import sender as sender_mod

NEW = 10
GREEDY = greedy(NEW)


def test_flipped_bit_in_a_payload_is_detected(checkpoints, references, tmp_path, monkeypatch):
    real = sender_mod.frames_checksum
    calls = {"n": 0}

    def checksum_then_flip(frames):
        """The checksum of the true bytes, then one bit flipped in a copy of the first frame (the
        cache on P stays intact): what a bad NIC, a bad cable or a buggy proxy would do."""
        digest = real(frames)
        if calls["n"] == 0:
            bad = bytearray(frames[0])
            bad[len(bad) // 2] ^= 0x04
            frames[0] = memoryview(bad)
        calls["n"] += 1
        return digest

    monkeypatch.setattr(sender_mod, "frames_checksum", checksum_then_flip)
    model = str(checkpoints["qwen2"])
    prompts = random_prompts(3, 20, 60, VOCAB, 144)
    # The whole-transfer path computes its checksum here (layer-wise: tests/test_kv_layerwise.py).
    with pd_pair(tmp_path, model, 256, prefill_kv=KVTransferConfig(checksum=True, mode="after-prefill")) as pd:
        run, client = pd.run, pd.client
        (first,) = run(generate_all(client, prompts[:1], GREEDY, timeout=30))
        stats = pd.decode.connector.receiver.stats
        assert stats.checksum_mismatches == 1
        if first["error"] is None:  # re-prefilled before t0 reached the client: must be exact
            assert references["qwen2"].assert_matches(prompts[0], first["tokens"], NEW)
        else:
            assert first["finish_reason"] == "error" and "checksum mismatch" in first["error"], first
        rest = run(generate_all(client, prompts[1:], GREEDY, timeout=30))  # later transfers are intact
        for p, r in zip(prompts[1:], rest):
            assert r["error"] is None, r
            references["qwen2"].assert_matches(p, r["tokens"], NEW)
        assert stats.checksum_mismatches == 1 and calls["n"] >= 3
        run(wait_blocks_free(client, timeout=5))
