"""The shared token bucket: one atomic Lua call in Redis per attempt."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from .config import Limit


def load_script(name: str) -> str:
    """Return the source of ``lua/<name>``.

    Installed wheels carry the scripts inside the package; a source checkout has them in the
    top-level ``lua/`` folder.
    """
    packaged = resources.files(__package__).joinpath("lua", name)
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / "lua" / name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class AcquireResult:
    allowed: bool
    """The request may go now."""
    reserved: bool
    """The request's tokens are taken for later: it must go in ``retry_after`` seconds."""
    tokens_left: float
    retry_after: float
    """Seconds until this request may go (0 when allowed)."""
    reset_after: float
    """Seconds until the bucket is full again."""


def bucket_key(prefix: str, domain: str) -> str:
    """The domain's bucket key. The braces are a Redis Cluster hash tag, so all the keys of one
    domain land in one slot."""
    return f"{prefix}:{{{domain}}}:bucket"


def script_args(limit: Limit, cost: float, reserve: float = 0) -> list[str | int]:
    """ARGV of ``token_bucket.lua``; ``repr`` keeps every digit of the floats."""
    return [repr(limit.interval_us), limit.burst, repr(float(cost)), repr(reserve * 1e6)]


class TokenBucket:
    """Per-domain token buckets stored in one Redis, shared by every process that uses it."""

    def __init__(self, redis: Redis, key_prefix: str) -> None:
        self._key_prefix = key_prefix
        # redis-py's Script runs EVALSHA and reloads the script when Redis lost it.
        self._script = redis.register_script(load_script("token_bucket.lua"))

    async def acquire(
        self, domain: str, limit: Limit, cost: float = 1, reserve: float = 0
    ) -> AcquireResult:
        """Take *cost* tokens from *domain*'s bucket if it has them, or reserve them if they will
        be there within *reserve* seconds (atomically, in one call)."""
        reply: list[Any] = await self._script(
            keys=[bucket_key(self._key_prefix, domain)], args=script_args(limit, cost, reserve)
        )
        status, tokens_left, retry_after_ms, reset_after_ms = reply
        return AcquireResult(
            allowed=int(status) == 1,
            reserved=int(status) == 2,
            tokens_left=float(tokens_left),
            retry_after=float(retry_after_ms) / 1000,
            reset_after=float(reset_after_ms) / 1000,
        )
