"""Every process a test starts dies with the test, however the test dies (issue 47: a pytest killed
by `timeout` left engines running for hours, since an engine waits for a lost front end without
limit). The test harnesses start their processes with `server.procs.start_tied`, and `pdserve serve`
ties its engines to itself: SIGKILL the process that started a cluster and every process of the
cluster goes."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from pd_harness import wait_until

from server.procs import start_tied, stop_process_group

# A test process in miniature: a harness cluster (two engines started on their own), a local
# `pdserve serve` (a front end and the two engines it starts) and a shell with a child of its own,
# like `make serve`; it prints their PIDs and waits.
CHILD = """
import json, subprocess, tempfile, time
from pathlib import Path
from conftest import BUNDLED_MODEL
from pd_harness import ProcessGroup, guard_group
from test_pd_http import Served
from server.procs import start_tied

group = ProcessGroup(Path(tempfile.mkdtemp(prefix="pdserve-tied-")))
group.add("prefill", "prefill-0", str(BUNDLED_MODEL))
group.add("decode", "decode-0", str(BUNDLED_MODEL))
served = Served(str(BUNDLED_MODEL), "--mode", "pd")
# As `make serve`: a tied leader whose own child is not tied, so its group has a guard.
shell = start_tied(["sh", "-c", "sleep 3600 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True)
guard = guard_group(shell.pid)
print(json.dumps({"engines": [p.pid for p in group.procs.values()], "serve": served.proc.pid,
                  "untied": [shell.pid, int(shell.stdout.readline()), guard.pid]}), flush=True)
time.sleep(3600)
"""


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the child printed nothing in {timeout} s"
    return proc.stdout.readline().decode()


def alive(pid: int) -> bool:
    """Running, or stopped; not gone and not a zombie (dead, waiting for whoever adopted it to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def engines_of(parent: int) -> list[int]:
    """PIDs of the engine processes `parent` started (their command line names an instance)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"--name" in argv:
            found.append(int(entry.name))
    return found


def test_killing_the_process_that_started_a_cluster_kills_every_process_of_it():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    child = start_tied([sys.executable, "-c", CHILD], cwd=REPO, env=env, stdout=subprocess.PIPE,
                       start_new_session=True)
    cluster: list[int] = []
    try:
        pids = json.loads(read_line(child, timeout=120))
        serve_engines: list[int] = []

        def serve_started_its_engines() -> bool:
            serve_engines[:] = engines_of(pids["serve"])
            return len(serve_engines) == 2

        wait_until(serve_started_its_engines, 120, "pdserve serve to start its prefill and decode engines")
        cluster = [*pids["engines"], pids["serve"], *serve_engines, *pids["untied"]]
        assert all(alive(pid) for pid in cluster)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        try:
            wait_until(lambda: not any(alive(pid) for pid in cluster), 60, "the cluster to die with the child")
        except TimeoutError:
            raise AssertionError(f"outlived their starter: {[p for p in cluster if alive(p)]}") from None
    finally:
        stop_process_group(child, grace_s=1)
        for pid in filter(alive, cluster):  # what a failure above left behind
            os.kill(pid, signal.SIGKILL)
