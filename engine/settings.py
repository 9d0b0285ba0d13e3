"""Every PDSERVE_* environment variable pdserve reads, declared once: its name, type, default and
purpose. No other product module reads a PDSERVE_* variable (tests/test_layout.py checks it).

Two kinds:
- `FLAG_ENV_PREFIX` + a command-line flag (`--max-num-seqs` -> PDSERVE_MAX_NUM_SEQS): every flag of
  `pdserve serve`, `prefill`, `decode`, `colocated` may come from the environment, as a container
  sets it; the flag wins. server/flags.py reads them through `flag_env`.
- The switches below, which have no flag: where the bundled model is, deployment secrets, the
  kernels a process uses, and debug and fault-injection knobs for tests and drills.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

FLAG_ENV_PREFIX = "PDSERVE_"


def truthy(raw: str) -> bool:
    """Anything but 0 / false / no / off (any case) is on."""
    return raw.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    purpose: str

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """Its value from `environ` (default: the process environment); unset or empty: the default."""
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return bool((os.environ if environ is None else environ).get(self.name, "").strip())


def flag_env(flag: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The environment's value for a command-line flag (`--max-num-seqs` -> PDSERVE_MAX_NUM_SEQS), or None."""
    return (os.environ if environ is None else environ).get(flag_env_name(flag))


def flag_env_name(flag: str) -> str:
    return FLAG_ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


MODEL = Setting("PDSERVE_MODEL", str, "", "the model directory when none is given (default: the bundled model)")
ENFORCE_EAGER = Setting("PDSERVE_ENFORCE_EAGER", truthy, None,
                        "run the model eagerly (on) or compiled (off); unset: eager on CPU, compiled on CUDA")
CLUSTER_KEY = Setting("PDSERVE_CLUSTER_KEY", str, "", "the cluster's CURVE secret key (z85, 40 characters)")
CLUSTER_KEY_FILE = Setting("PDSERVE_CLUSTER_KEY_FILE", str, "", "a file holding the cluster key (a mounted secret)")
ALLOW_INSECURE = Setting("PDSERVE_ALLOW_INSECURE", truthy, False,
                         "bind beyond loopback without a cluster key (a trusted network only)")
MALLOC = Setting("PDSERVE_MALLOC", str, "auto",
                 "auto: engine processes run under tcmalloc where it is installed; system: glibc's malloc")
LOG_LEVEL = Setting("PDSERVE_LOG_LEVEL", str, "INFO", "the logging level of every pdserve process")
LINEAR_TUNING = Setting("PDSERVE_LINEAR_TUNING", str, "",
                        "where linear tuning choices are kept (a path, or off; default ~/.cache/pdserve)")
ATTENTION = Setting("PDSERVE_ATTENTION", str, "auto", "the CPU attention kernel: auto, cpp or torch")
USE_TRITON = Setting("PDSERVE_USE_TRITON", truthy, None,
                     "force the Triton bookkeeping kernels on (1) or off (0); unset: on CUDA only")
FUSED_OPS = Setting("PDSERVE_FUSED_OPS", truthy, True, "the C++ fused sampling ops on CPU (off: torch reference)")
DEBUG_INVARIANTS = Setting("PDSERVE_DEBUG_INVARIANTS", truthy, False,
                           "check the request-state invariants every step (the tests set it)")
DEBUG_STEP_DELAY = Setting("PDSERVE_DEBUG_STEP_DELAY", float, 0.0,
                           "seconds added to every engine step (fault injection: a slow engine)")
FAULT_EXIT_ON_PROMPT = Setting("PDSERVE_FAULT_EXIT_ON_PROMPT", str, "",
                               "comma-separated token ids: an engine exits when a prompt holds them (fault drills)")

SWITCHES = (MODEL, ENFORCE_EAGER, CLUSTER_KEY, CLUSTER_KEY_FILE, ALLOW_INSECURE, MALLOC, LOG_LEVEL, LINEAR_TUNING,
            ATTENTION, USE_TRITON, FUSED_OPS, DEBUG_INVARIANTS, DEBUG_STEP_DELAY, FAULT_EXIT_ON_PROMPT)
