from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, ClassVar

from scrapy_redis.spiders import RedisSpider

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from scrapy.http import Response


class ShopSpider(RedisSpider):  # type: ignore[misc]
    """Follows every link of the demo site, from start URLs pushed to ``shop:start_urls``."""

    name = "shop"
    redis_key = "shop:start_urls"

    # What a budget is kept per: each host (the demo site's hosts are addresses). A site whose
    # hosts share one limit (www.shop.com, img.shop.com) takes "registrable_domain": one budget
    # for all of shop.com, as "shop.com" or "*.shop.com" below (docs: usage/rates, Scopes).
    # Several scopes at once: ["host", "proxy"] adds a budget per proxy (meta["proxy"]'s
    # host:port, e.g. "proxy.example:8080": "10/s" below), which must allow each request through
    # it too (in one call to one Redis; on a Redis Cluster, two calls per budget).
    redis_throttle_scope = "host"
    # One budget per domain for the whole fleet, however many workers run this spider.
    redis_throttle_rates: ClassVar[dict[str, Any]] = {
        "127.0.0.2": "4/s",
        # Several limits, all checked in one call: a bucket of 2/s (3 back to back), and a quota
        # of 15 in any 10 s (sliding_window, exact; or fixed_window, a counter per window). The
        # window is exact in Redis's clock: 0.1 s more keeps the site's clock within it too.
        "127.0.0.3": [
            {"rate": "2/s", "burst": 3},
            {"rate": "15/10.1s", "algorithm": "sliding_window"},
        ],
        "127.0.0.4": "1/2s",  # below one request per second
        # More than this site takes (3 a second): it answers 429 with Retry-After, and each 429
        # pauses it for the whole fleet and halves its rate (the adaptive rate, in settings.py).
        "127.0.0.5": "5/s",
    }

    async def parse(self, response: Response, **kwargs: Any) -> AsyncIterator[Any]:
        yield {"url": response.url}
        for link in response.css("a::attr(href)").getall():
            yield response.follow(link, callback=self.parse)
            # scrapy-redis's scheduler writes each request to Redis synchronously: let the
            # reactor send the requests the throttle releases meanwhile, or a page of many
            # links delays them all (docs, "Known limitations").
            await asyncio.sleep(0)
