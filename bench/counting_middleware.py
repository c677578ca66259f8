"""The throttle's middleware, counting the Redis calls each request needed (for bench/binding.py:
``bench/redis_calls_per_request/<calls>`` in the stats, once per downloaded request)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from scrapy import Request

from scrapy_redis_throttle import RedisThrottleMiddleware

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.http import Response

    from scrapy_redis_throttle.fallback import Grant

CALLS_META = "bench_redis_calls"
# The calls of the request whose process_request is running (each runs in its own context).
_calls: ContextVar[list[int]] = ContextVar("calls")


class CountingThrottleMiddleware(RedisThrottleMiddleware):
    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)
        acquire = self.throttle.bucket.acquire

        async def counted(*args: Any, **kwargs: Any) -> Grant:
            _calls.get()[0] += 1
            return await acquire(*args, **kwargs)

        self.throttle.bucket.acquire = counted  # type: ignore[method-assign]

    async def process_request(self, request: Request) -> Request | None:
        calls = [0]
        token = _calls.set(calls)
        try:
            result = await super().process_request(request)
        finally:
            _calls.reset(token)
        # A parked request comes back as a new Request, with the meta it had then.
        counted = result if isinstance(result, Request) else request
        counted.meta[CALLS_META] = request.meta.get(CALLS_META, 0) + calls[0]
        return result

    async def process_response(self, request: Request, response: Response) -> Response:
        calls = request.meta.get(CALLS_META, 0)
        self.throttle.stats.inc_value(f"bench/redis_calls_per_request/{calls}")
        return await super().process_response(request, response)
