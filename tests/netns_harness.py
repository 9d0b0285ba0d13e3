"""Hosts for multi-host tests: Linux network namespaces on bridges, real TCP between them.

    net = Netns()                                   # needs root (skip otherwise: netns_skip_reason)
    net.bridge("front"); net.bridge("kv")
    net.node("p0", {"front": "10.213.1.10", "kv": "10.213.2.10"})
    proc = net.popen("p0", [sys.executable, "-m", "server.cli", "prefill", ...], log_path)
    with net.cut("d0", "kv"): ...                   # a partition of one node's link, both ways
    net.shape("p0", "kv", "2mbit")                  # a slow link out of p0
    net.http("fe", fn)                              # run fn in a thread inside fe's namespace
    net.close()                                     # kills what it started (by PID), deletes namespaces

Everything lives in namespaces this harness creates (the bridges too, in a "hub" namespace of
their own), so the host's own network is never touched and the private addresses used are
visible nowhere else. Every command and every wait is bounded.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from server.procs import start_tied

CLONE_NEWNET = 0x40000000
CMD_TIMEOUT_S = 15


def netns_skip_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def enter_netns(ns: str) -> None:
    """Move the calling thread (only) into network namespace `ns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


PREFIX = "pdt-"


def reap_stale_namespaces() -> None:
    """Delete what an earlier run of this harness left behind when it was killed before its
    cleanup: namespaces named after a process that no longer exists, and what runs inside them."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=CMD_TIMEOUT_S).stdout
    for ns in (line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)):
        owner = ns.split("-")[1]
        if not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=CMD_TIMEOUT_S)


class Netns:
    def __init__(self) -> None:
        reap_stale_namespaces()
        self.tag = f"{os.getpid()}-{uuid.uuid4().hex[:4]}"  # the pid: reap_stale_namespaces tells stale ones
        self.hub = self._ns("hub")
        self.namespaces: list[str] = []
        self.bridges: dict[str, str] = {}
        self.ifaces: dict[tuple[str, str], str] = {}  # (node, bridge) -> its interface in the node
        self.procs: list[subprocess.Popen] = []
        self._veths = 0
        self._add_ns(self.hub)

    def _ns(self, node: str) -> str:
        return f"{PREFIX}{self.tag}-{node}"

    def sh(self, *argv: str) -> str:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
        return r.stdout

    def _add_ns(self, ns: str) -> None:
        self.sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        self.sh("ip", "-n", ns, "link", "set", "lo", "up")

    def bridge(self, name: str) -> None:
        br = f"br{len(self.bridges)}"
        self.sh("ip", "-n", self.hub, "link", "add", br, "type", "bridge")
        self.sh("ip", "-n", self.hub, "link", "set", br, "up")
        self.bridges[name] = br

    def node(self, node: str, addresses: dict[str, str]) -> None:
        """A host on the named bridges, with one /24 address on each."""
        ns = self._ns(node)
        self._add_ns(ns)
        for i, (bridge, ip) in enumerate(addresses.items()):
            hub_end, iface = f"v{self._veths}", f"eth{i}"
            self._veths += 1
            self.sh("ip", "-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", iface, "netns", ns)
            self.sh("ip", "-n", self.hub, "link", "set", hub_end, "master", self.bridges[bridge], "up")
            self.sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", iface)
            self.sh("ip", "-n", ns, "link", "set", iface, "up")
            self.ifaces[(node, bridge)] = iface

    def popen(self, node: str, argv: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
        """Start `argv` inside `node` (its own process group, so that it is killed whole)."""
        with open(log, "ab") as out:
            proc = start_tied(["ip", "netns", "exec", self._ns(node), *argv], cwd=cwd, env=env, stdout=out,
                              stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def iptables(self, node: str, *rule: str) -> None:
        self.sh("ip", "netns", "exec", self._ns(node), "iptables", "-w", "5", *rule)

    @contextlib.contextmanager
    def cut(self, node: str, bridge: str) -> Iterator[None]:
        """Drop every packet in and out of `node`'s interface on `bridge` (a silent partition: no
        resets, no unreachable errors) until the block exits. Other links of the node stay up."""
        iface = self.ifaces[(node, bridge)]
        rules = [("INPUT", "-i", iface), ("OUTPUT", "-o", iface)]
        for chain, flag, name in rules:
            self.iptables(node, "-A", chain, flag, name, "-j", "DROP")
        try:
            yield
        finally:
            for chain, flag, name in rules:
                self.iptables(node, "-D", chain, flag, name, "-j", "DROP")

    def shape(self, node: str, bridge: str, rate: str) -> None:
        """Limit what `node` sends on `bridge` to `rate` (a token bucket on its side of the link)."""
        self.sh("ip", "netns", "exec", self._ns(node), "tc", "qdisc", "add", "dev", self.ifaces[(node, bridge)],
                "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms")

    def pool(self, node: str, workers: int) -> ThreadPoolExecutor:
        """Threads that live in `node`'s namespace: sockets they open reach its network."""
        return ThreadPoolExecutor(workers, initializer=enter_netns, initargs=(self._ns(node),))

    def http(self, node: str, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        with self.pool(node, 1) as pool:
            return pool.submit(fn).result(timeout)

    def kill(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def close(self) -> None:
        threads = [threading.Thread(target=self.kill, args=(p,)) for p in self.procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        for ns in reversed(self.namespaces):  # the hub last: the veths go with their namespaces
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.sh("ip", "netns", "del", ns)
