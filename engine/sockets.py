"""Options every pdserve ZMQ socket that may cross hosts gets: liveness and reconnects bounded in seconds.

Without them a TCP connection that lost its peer (a partition, a pulled cable, a host that
vanished) is noticed only by the kernel's retransmit backoff, which grows to tens of seconds, and
a reconnect that starts during a partition waits out the whole SYN backoff. So:

- ZMTP heartbeats (PING/PONG inside ZMQ): a connection silent for `HEARTBEAT_TIMEOUT_MS` is
  closed and reconnected, on both sides;
- TCP keepalive as a second line for the same, where ZMTP heartbeats cannot run (a half-open
  connection whose PINGs sit in a full send buffer);
- one connect attempt lasts at most `CONNECT_TIMEOUT_MS`, and attempts repeat at most every
  `RECONNECT_IVL_MAX_MS`: once a link comes back, the next attempt finds it within about a second.

The options are harmless on ipc:// sockets (one host), so every socket gets them.

And no receive high-water mark. With one, a socket whose reader is busy (a decode engine in a long
step while P streams it a prompt's KV) stops reading its connection once that many messages wait;
the peer's PINGs then wait unread too, the heartbeat timeout closes the healthy connection, and
libzmq aborts the process when the pipe drains (`Assertion failed: _input_stopped`, reproduced in
tests/test_sockets.py). What waits is bounded by each protocol instead: D pulls only the KV it
reserved blocks for, the front end sends an engine only the requests it admitted, an engine sends
the front end only its requests' outputs.
"""
from __future__ import annotations

import zmq

HEARTBEAT_IVL_MS = 500
HEARTBEAT_TIMEOUT_MS = 3000
CONNECT_TIMEOUT_MS = 1000
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000
TCP_KEEPALIVE_IDLE_S = 5
TCP_KEEPALIVE_INTVL_S = 1
TCP_KEEPALIVE_CNT = 3


def harden(sock: zmq.Socket) -> zmq.Socket:
    """Set the liveness and reconnect options above on `sock` (before it binds or connects)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock
