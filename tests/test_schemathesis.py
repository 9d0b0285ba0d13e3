"""Schemathesis over /openapi.json (issue 45, build 7): no request it makes, valid or not, gets a
5xx from a live colocated server on the bundled model, and the app counted no internal error.

The schemathesis CLI runs in a subprocess against the served document as any user would run it,
with a fixed seed and a bounded number of examples per operation. The context is short (64
tokens) so that the valid requests it finds (n up to 64) finish quickly on a CPU.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
from conftest import BUNDLED_MODEL
from http_harness import served

MODEL = "pdserve-tiny"
EXAMPLES_PER_OPERATION = 25
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


def test_schemathesis_finds_no_server_error(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))
    report = tmp_path / "report.ndjson"
    (tmp_path / "engines").mkdir()
    with served(tmp_path / "engines", "colocated", tokenizer, MODEL, model=str(BUNDLED_MODEL), max_model_len=64,
                block_size=16) as s:
        doc = httpx.get(f"{s.url}/openapi.json", timeout=30).json()
        assert "CompletionRequest" in doc["components"]["schemas"]
        run = subprocess.run(
            [str(SCHEMATHESIS), "run", f"{s.url}/openapi.json", "--checks", "not_a_server_error",
             "--max-examples", str(EXAMPLES_PER_OPERATION), "--seed", "45", "--workers", "1",
             "--generation-database", "none", "--request-timeout", "60", "--no-color",
             "--report", "ndjson", "--report-ndjson-path", str(report)],
            capture_output=True, text=True, timeout=420, cwd=tmp_path)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        assert s.server.app.state.internal_errors == 0
    cases = _cases(report)
    assert cases >= 4 * EXAMPLES_PER_OPERATION, (cases, out[-3000:])  # it really ran the POST routes


def _cases(report: Path) -> int:
    """Test cases schemathesis reported as run (from its ndjson events)."""
    total = 0
    for line in report.read_text().splitlines():
        event = json.loads(line)
        for value in event.values():
            if isinstance(value, dict) and "recorder" in value:
                total += len(value["recorder"].get("cases", {}))
    return total
