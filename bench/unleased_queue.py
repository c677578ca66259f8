"""scrapy-redis's priority queue under another name: the throttle leases only the queue classes
of scrapy-redis it knows, so requests taken from this one are not leased (``bench/binding.py``
compares the calls of both)."""

from scrapy_redis.queue import PriorityQueue


class UnleasedPriorityQueue(PriorityQueue):  # type: ignore[misc]
    pass
