"""The errors scrapy-redis-throttle raises for what users give it."""


class ThrottleConfigError(ValueError):
    """A setting or spider attribute of scrapy-redis-throttle is invalid."""


class InvalidThrottleMeta(ValueError):
    """A request's ``redis_throttle_*`` meta value is invalid; that request fails."""


class InvalidThrottleDomain(ValueError):
    """The function of ``REDIS_THROTTLE_SCOPE`` failed for a request, or gave it no domain; that
    request fails."""
