"""A per-domain rate limit in Redis, shared by every Scrapy / scrapy-redis worker that uses it."""

from .addon import Addon
from .bucket import TokenBucket
from .config import ThrottleConfig
from .errors import InvalidThrottleDomain, InvalidThrottleMeta, ThrottleConfigError
from .middleware import RedisThrottleMiddleware
from .parking_scheduler import ParkingScheduler
from .rates import Limit
from .replies import AcquireResult
from .scheduler import RedisThrottleScheduler, ThrottleScheduler

__all__ = [
    "AcquireResult",
    "Addon",
    "InvalidThrottleDomain",
    "InvalidThrottleMeta",
    "Limit",
    "ParkingScheduler",
    "RedisThrottleMiddleware",
    "RedisThrottleScheduler",
    "ThrottleConfig",
    "ThrottleConfigError",
    "ThrottleScheduler",
    "TokenBucket",
]
