"""`pdserve serve` on the bundled model in the configurations the structured-output and tool-call
tests share: started once per session (all at once, so their start-ups overlap), stopped by PID."""
from __future__ import annotations

import re

import openai
from conftest import BUNDLED_MODEL
from test_pd_http import Served

# `make serve`'s defaults (PD, one prefill + one decode, MTP from the checkpoint, adaptive drafts),
# and the other two modes the issue names.
CONFIGS = {
    # Drafts on every step: the adaptive policy may judge that drafting does not pay at these batch
    # sizes, and then nothing here would test speculation under a grammar.
    "pd_mtp": ["--mode", "pd", "--spec-policy", "fixed"],
    "pd": ["--mode", "pd", "--speculative-method", "none"],
    "colocated": ["--mode", "colocated", "--speculative-method", "none"],
}
MODEL = BUNDLED_MODEL.name


class Servers:
    def __init__(self) -> None:
        self.served: dict[str, Served] = {}

    def start(self) -> None:
        for name, flags in CONFIGS.items():
            self.served[name] = Served(str(BUNDLED_MODEL), "--max-num-seqs", "16", *flags)
        for s in self.served.values():
            s.wait_healthy(timeout=180)

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.served[name].url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metric_sum(self, name: str, metric: str) -> float:
        """A counter summed over the instances of one server."""
        text = self.served[name].metrics()
        return sum(float(v) for v in re.findall(rf"^pdserve:{metric}{{[^}}]*}} (\S+)$", text, re.M))

    def stop(self) -> None:
        for s in self.served.values():
            s.stop()


def start_servers():
    """Generator body of conftest's session fixture `servers` (one definition, so one start-up for
    every module that uses it)."""
    group = Servers()
    try:
        group.start()
        yield group
    finally:
        group.stop()
