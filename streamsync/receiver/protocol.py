"""The receiver process's wire protocol: JSON lines over TCP, opened by an HMAC challenge-response."""

from __future__ import annotations

import hashlib
import hmac
import secrets

#: Environment variable through which a parent hands a receiver process its secret (never argv: any local
#: user can read another process's command line, only its owner its environment).
SECRET_ENV = "STREAMSYNC_RECEIVER_SECRET"

#: Longest request line after authentication. A 1 GiB MoE chunk's layout is ~100 KB of JSON.
MAX_LINE = 8 << 20

HELLO_LINE = 4096  # the handshake's lines, and every line before authentication

REPLY_LINE = 64 << 20  # replies an authenticated receiver sends (per-tensor checksums of a large model)


def new_secret() -> str:
    """A receiver secret: 256 random bits, hex."""
    return secrets.token_hex(32)


def proof(secret: str, side: str, challenge: str, nonce: str) -> str:
    """HMAC-SHA256 that `side` ("client" or "server") holds `secret`, bound to this connection's server
    challenge and client nonce (so a recorded proof is useless on another connection)."""
    msg = f"streamsync-receiver/1:{side}:{challenge}:{nonce}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def same_secret(a: object, b: str) -> bool:
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())  # constant time
