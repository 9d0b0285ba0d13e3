"""A hardened socket (engine/sockets.py) whose reader is busy past the heartbeat timeout while
more messages arrive than a default high-water mark holds -- a decode engine in a long step while
P streams it a prompt's KV -- keeps its connection and gets every message. With a receive
high-water mark, libzmq stops reading the connection, the peer's PINGs go unread, the heartbeat
timeout closes the healthy connection and libzmq then aborts the process (`Assertion failed:
_input_stopped`). The scenario runs in a child process so that such an abort fails this test
instead of killing the test run."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import REPO

CHILD = textwrap.dedent("""
    import json, sys, time
    import zmq
    from zmq.utils.monitor import recv_monitor_message
    from engine.sockets import HEARTBEAT_TIMEOUT_MS, harden

    address = sys.argv[1]
    ctx = zmq.Context()
    sender = harden(ctx.socket(zmq.ROUTER))  # as P's KV sender
    sender.setsockopt(zmq.SNDHWM, 0)
    sender.bind(address)
    reader = harden(ctx.socket(zmq.DEALER))  # as D's KV receiver
    reader.setsockopt(zmq.LINGER, 0)
    monitor = reader.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    reader.connect(address)
    reader.send(b"hello")
    assert sender.poll(10000), "no hello"
    peer, _ = sender.recv_multipart()
    for _ in range(1500):  # more than the default high-water mark of 1000 messages
        sender.send_multipart([peer, b"x" * 65536])
    time.sleep(HEARTBEAT_TIMEOUT_MS / 1000 + 2)  # the reader is busy
    disconnects = 0
    while monitor.poll(0):
        recv_monitor_message(monitor)
        disconnects += 1
    received = 0
    while reader.poll(2000):
        reader.recv()
        received += 1
    print(json.dumps({"disconnects": disconnects, "received": received}))
""")


def test_a_busy_reader_keeps_its_connection_and_every_message(tmp_path):
    run = subprocess.run([sys.executable, "-c", CHILD, f"ipc://{tmp_path}/kv"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, f"the child died ({run.returncode}): {run.stderr[-2000:]}"
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"disconnects": 0, "received": 1500}
