"""Seals on what a worker parks in scrapy-redis's Redis: a parked request's ticket says when it
may go and which moment it reserved, and whoever may write into that Redis could otherwise
forge one to skip the throttle, or to give a bucket back moments other workers hold. A ticket
counts only with its seal, an HMAC made with the fleet's secret, which lives in the throttle's
Redis (see :meth:`.TokenBucket.load_secret`)."""

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

    @property
    def known(self) -> bool:
        return self._secret is not None

    def know(self, secret: bytes) -> None:
        self._secret = secret

    def seal(self, message: bytes) -> str | None:
        """*message*'s seal (None: no secret known, nothing is sealed)."""
        if self._secret is None:
            return None
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:SEAL_DIGITS]

    def check(self, message: bytes, seal: object) -> bool:
        """Whether *seal* (read back from Redis: anything) is *message*'s."""
        expected = self.seal(message)
        if expected is None or not isinstance(seal, str) or not _SEAL.fullmatch(seal):
            return False
        return hmac.compare_digest(expected.encode(), seal.encode())
