"""A loopback TCP relay between a client and a listening target, for tests that must see or break
the bytes on the wire: it records every byte it forwards (a packet capture, tests/test_kv_curve.py),
can hold back what the target sends past a byte budget, and can sever every connection at once (a
link that broke mid-transfer, tests/test_kv_progress.py)."""
from __future__ import annotations

import contextlib
import selectors
import socket
import threading

# Under a budget the target's bytes are read in small pieces, so that the relay stops close to it.
BUDGET_READ = 4096
READ = 1 << 16


class TcpRelay:
    """Connections to 127.0.0.1:`self.port` are relayed to 127.0.0.1:`target_port`, both ways.
    `captured`: every byte forwarded, both ways. `budget`: how many bytes the target may send, over
    all connections, before the rest is left in its sockets (None: no limit) until `sever()`.
    `target` may be set after the relay starts (a target bound to port 0): until then a client's
    connection is closed at once, as if nothing listened, and the client dials again."""

    def __init__(self, target_port: int, budget: int | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target, self.budget = target_port, budget
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []  # (client side, target side)
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"tcp-relay-{self.port}")
        self.thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        while not self.stopping:
            for key, _ in sel.select(0.02):
                if key.fileobj is self.listener:
                    self._accept(sel)
                else:
                    self._forward(sel, key.fileobj, key.data)
        self.listener.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        client, _ = self.listener.accept()
        try:
            target = socket.create_connection(("127.0.0.1", self.target))
        except OSError:  # the target is not listening yet: the client will reconnect
            client.close()
            return
        with self.lock:
            self.pairs.append((client, target))
        sel.register(client, selectors.EVENT_READ, target)
        sel.register(target, selectors.EVENT_READ, client)

    def _forward(self, sel: selectors.BaseSelector, src: socket.socket, dst: socket.socket) -> None:
        from_target = any(src is target for _, target in self.pairs)
        limited = from_target and self.budget is not None
        if limited and self.budget <= 0:  # over the budget: leave it in the target's socket for now
            sel.unregister(src)
            return
        try:
            data = src.recv(min(BUDGET_READ, self.budget) if limited else READ)
            if data:
                dst.sendall(data)
                self.captured += data
                if limited:
                    self.budget -= len(data)
                return
        except OSError:
            pass
        with self.lock:  # one side closed or broke: close the other
            self.pairs = [pair for pair in self.pairs if src not in pair]
        for s in (src, dst):
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(s)
            s.close()

    def sever(self) -> None:
        """Break every connection so far (both ends see it break); later ones have no budget."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        self.budget = None
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(5)
        with self.lock:
            pairs = list(self.pairs)
        self.sever()
        for pair in pairs:
            for s in pair:
                s.close()
