"""Seals on what a worker parks in scrapy-redis's Redis: a parked request's ticket says when it
may go and which moment it reserved, and whoever may write into that Redis could otherwise
forge one to skip the throttle, or to give a bucket back moments other workers hold. A ticket
counts only with its seal, an HMAC made with the fleet's secret, which lives in the throttle's
Redis (see :meth:`.TokenBucket.load_secret`).

The secret also tells whether that Redis kept the throttle's state: a Redis that restarted empty
lost it with the buckets, and the next worker to read it makes a new one. A moment reserved
before is then no longer known to its bucket, which may give it to another request: a worker
that reads a new secret takes every moment reserved before as lost (see
:meth:`.ResilientBucket.read_state`), and a ticket sealed with the secret before is one of
them, not a forgery."""

from __future__ import annotations

import hashlib
import hmac
import re

# Hex digits of a seal: 128 bits.
SEAL_DIGITS = 32
_SEAL = re.compile(rf"[0-9a-f]{{{SEAL_DIGITS}}}")


class Seals:
    """Seals and checks messages with the fleet's secret, once it is known."""

    def __init__(self) -> None:
        self._secret: bytes | None = None
        # The one known before it: what it sealed holds moments Redis lost.
        self._previous: bytes | None = None

    @property
    def known(self) -> bool:
        return self._secret is not None

    def know(self, secret: bytes) -> bool:
        """Seal with *secret* from now on; whether it replaces another one (Redis lost the
        throttle's state since that one was read)."""
        if secret == self._secret:
            return False
        replaced = self._secret is not None
        self._previous, self._secret = self._secret, secret
        return replaced

    def seal(self, message: bytes) -> str | None:
        """*message*'s seal (None: no secret known, nothing is sealed)."""
        return None if self._secret is None else _seal(self._secret, message)

    def check(self, message: bytes, seal: object) -> bool:
        """Whether *seal* (read back from Redis: anything) is *message*'s."""
        return _matches(self._secret, message, seal)

    def sealed_before(self, message: bytes, seal: object) -> bool:
        """Whether *seal* is *message*'s by the secret known before the current one: sealed
        before Redis lost the throttle's state."""
        return _matches(self._previous, message, seal)


def _seal(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:SEAL_DIGITS]


def _matches(secret: bytes | None, message: bytes, seal: object) -> bool:
    if secret is None or not isinstance(seal, str) or not _SEAL.fullmatch(seal):
        return False
    return hmac.compare_digest(_seal(secret, message).encode(), seal.encode())
