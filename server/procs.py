"""Stopping a `pdserve serve` process tree (the front end and the engines it started), for the
tests and benchmarks that launch one with `start_new_session=True`."""
from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the process group `proc` leads (a front end and the engines it started, launched with
    start_new_session=True); SIGKILL it after `grace_s`, and in any case make sure nothing in the
    group outlives the leader."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
