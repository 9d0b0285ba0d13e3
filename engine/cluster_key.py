"""The cluster key: CURVE authentication and encryption of every engine and KV socket, and the
rule that a socket without one listens only where no one else can reach it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import settings

CLUSTER_KEY_ENV = settings.CLUSTER_KEY.name
CLUSTER_KEY_FILE_ENV = settings.CLUSTER_KEY_FILE.name
ALLOW_INSECURE_ENV = settings.ALLOW_INSECURE.name


@dataclass(frozen=True)
class ClusterKey:
    """One CURVE key pair for the whole cluster. Every socket that binds (the front end's engine
    socket, a prefill's KV port) is a CURVE server with it, and accepts only clients that prove
    they hold the same secret (its ZAP handler admits the cluster's public key alone); every socket
    that connects is a CURVE client with it. A process without the secret cannot complete a
    handshake, so it can neither register as an engine nor pull KV, and all traffic is encrypted."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> ClusterKey:
        import zmq

        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_secret(cls, secret: str | bytes) -> ClusterKey:
        import zmq

        raw = secret.strip().encode() if isinstance(secret, str) else secret.strip()
        if len(raw) != 40:
            raise ValueError(f"{CLUSTER_KEY_ENV}: a CURVE secret key is 40 z85 characters, got {len(raw)} "
                             "(make one with `pdserve keygen FILE`)")
        return cls(zmq.curve_public(raw), raw)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClusterKey | None:
        key_file = settings.CLUSTER_KEY_FILE.get(environ)
        if key_file:
            return cls.from_secret(Path(key_file).read_text())
        secret = settings.CLUSTER_KEY.get(environ)
        return cls.from_secret(secret) if secret else None

    def secure_server(self, sock: Any) -> None:
        """Before bind: a CURVE server holding the cluster key."""
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = self.secret, self.public, True

    def secure_client(self, sock: Any) -> None:
        """Before connect: a CURVE client that proves it holds the cluster key and checks the server does."""
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.public, self.public, self.secret

    def authenticator(self, ctx: Any, on_refused: Callable[[str, str], None] | None = None) -> Any:
        """Start the ZAP handler of `ctx` (threaded, or asyncio for a zmq.asyncio context): CURVE
        clients with any key but the cluster's are refused, and `on_refused(peer address, why)` is
        told of each. Call its stop() before closing `ctx`."""
        import zmq.asyncio
        from zmq.auth.asyncio import AsyncioAuthenticator
        from zmq.auth.thread import ThreadAuthenticator

        public = self.public

        class _OnlyTheClusterKey:
            peer = ""  # the address of the request being decided (ZAP requests are handled one at a time)

            def callback(self, domain: str, key: bytes) -> bool:
                if key != public and on_refused is not None:
                    on_refused(self.peer, "its cluster key is not this cluster's")
                return key == public

        provider = _OnlyTheClusterKey()
        auth = (AsyncioAuthenticator if isinstance(ctx, zmq.asyncio.Context) else ThreadAuthenticator)(ctx)
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=provider)
        handler = auth.thread.authenticator if isinstance(auth, ThreadAuthenticator) else auth
        decide = handler.handle_zap_message

        async def note_peer(message: list[bytes]) -> None:  # a ZAP request: [version, id, domain, address, ...]
            provider.peer = message[3].decode(errors="replace") if len(message) > 3 else ""
            await decide(message)

        handler.handle_zap_message = note_peer
        return auth


def check_bind(addr: str, key: ClusterKey | None, what: str) -> None:
    """Without a cluster key a socket may listen only on loopback or ipc: anyone who reaches it could
    act as an engine (or a decode instance). Raises ValueError saying so, unless explicitly allowed."""
    if key is not None or not addr.startswith("tcp://"):
        return
    host = addr[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1") or settings.ALLOW_INSECURE.get():
        return
    raise ValueError(f"{what}: refusing to bind {addr} without a cluster key: anyone who reaches it could pose as "
                     f"an engine. Set {CLUSTER_KEY_FILE_ENV} (or {CLUSTER_KEY_ENV}; make one with `pdserve keygen "
                     f"FILE`), bind 127.0.0.1 or ipc://, or set {ALLOW_INSECURE_ENV}=1 on a trusted network")
