"""Engine counters reach /metrics under vLLM's names, with the per-position label (issue: MTP)."""
from __future__ import annotations

from server.metrics import ServerMetrics
from server.protocol import InstanceInfo


def test_spec_decode_counters_exported_with_position_label():
    counters = {"spec_decode_num_drafts_total": 10, "spec_decode_num_draft_tokens_total": 20,
                "spec_decode_num_accepted_tokens_total": 13,
                "kv_transfer_bytes_received": 1234}
    per_position = {"spec_decode_num_accepted_tokens_per_pos_total": [8, 5]}
    info = InstanceInfo("decode-0", "decode", True, 10, 10, 0, 0, counters, per_position)
    text = ServerMetrics(lambda: [info]).render().decode()
    assert 'pdserve:spec_decode_num_drafts_total{instance="decode-0",role="decode"} 10.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_total{instance="decode-0",role="decode"} 13.0' in text
    assert ('pdserve:spec_decode_num_accepted_tokens_per_pos_total{instance="decode-0",position="1",role="decode"} 5.0'
            in text)
    assert 'pdserve:kv_transfer_bytes_received_total{instance="decode-0",role="decode"} 1234.0' in text
