"""Per-transfer checksum (issue 14, hole 6): a payload corrupted on the way is detected on the
decode side before admission; the request is re-prefilled or fails clearly, never a 200 with
wrong tokens."""
from __future__ import annotations

from conftest import random_prompts
from pd_harness import ThreadedEngines, client_for, generate_all, running_client, wait_blocks_free, wait_ready

from engine.config import EngineConfig
from engine.types import SamplingParams
from kv_transfer import sender as sender_mod

VOCAB = 384
NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


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
    engines = ThreadedEngines(tmp_path)
    # The whole-transfer path computes its checksum here (layer-wise: tests/test_kv_layerwise.py).
    engines.add("prefill", "prefill-0", EngineConfig(model=model, max_model_len=256, num_threads=1), kv_checksum=True,
                kv_mode="after-prefill")
    decode = engines.add("decode", "decode-0", EngineConfig(model=model, max_model_len=256, num_threads=1))
    engines.start()
    client = client_for(engines.server_addr, model, "pd", 256)
    prompts = random_prompts(3, 20, 60, VOCAB, 144)
    try:
        with running_client(client) as run:
            run(wait_ready(client))
            (first,) = run(generate_all(client, prompts[:1], GREEDY, timeout=30))
            stats = decode.connector.receiver.stats
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
    finally:
        engines.stop()
