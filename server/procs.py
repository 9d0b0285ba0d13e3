"""Child processes that do not outlive their parent, and stopping a `pdserve serve` process tree.

An engine waits for a lost front end without limit, by design: a front end across hosts may come
back. That is right for an engine started on its own (`pdserve prefill|decode`) and wrong for one a
local `pdserve serve` (or a test) started: when its parent dies, even by SIGKILL, nothing else will
ever stop it. `start_tied` asks the kernel (PR_SET_PDEATHSIG) to SIGKILL the child when its parent
dies."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
# Looked up here, in the parent: a child between fork and exec should do as little as it can.
_prctl: Callable[..., int] | None = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only


def _die_with(parent: int) -> None:
    """In the child, before exec (the setting survives exec): SIGKILL when the parent dies. If the
    parent died before this ran, the child already has another parent and nothing would fire: die now."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def start_tied(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen(argv, **popen_kwargs)` whose process is SIGKILLed when this process dies,
    however it dies. The kernel's "parent" is the calling thread: call it from a thread that lives as
    long as the child should (the main thread, or one that stops its children before it ends). A
    child that starts children of its own must tie them too (`pdserve serve` ties its engines)."""
    parent = os.getpid()
    return subprocess.Popen(argv, preexec_fn=lambda: _die_with(parent), **popen_kwargs)


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
