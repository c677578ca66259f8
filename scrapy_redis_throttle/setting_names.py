"""Every setting of the throttle, by name: another ``REDIS_THROTTLE_*`` name in a project is a
mistake (a typo, or a setting of another version), refused at start-up with the closest one
(see :meth:`.ThrottleConfig.from_settings`)."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from .errors import ThrottleConfigError

if TYPE_CHECKING:
    from scrapy.settings import BaseSettings

SETTING_PREFIX = "REDIS_THROTTLE_"
SETTING_NAMES = frozenset(
    (
        "REDIS_THROTTLE_ADAPTIVE_DECREASE",
        "REDIS_THROTTLE_ADAPTIVE_ENABLED",
        "REDIS_THROTTLE_ADAPTIVE_MIN_RATE",
        "REDIS_THROTTLE_ADAPTIVE_RECOVERY",
        "REDIS_THROTTLE_CLUSTER_NODES",
        "REDIS_THROTTLE_CRAWL_DELAY_ENABLED",
        "REDIS_THROTTLE_DEFAULT_BURST",
        "REDIS_THROTTLE_DEFAULT_RATE",
        "REDIS_THROTTLE_DOWNLOAD_SLOT",
        "REDIS_THROTTLE_ENABLED",
        "REDIS_THROTTLE_FALLBACK_AFTER",
        "REDIS_THROTTLE_FALLBACK_WORKERS",
        "REDIS_THROTTLE_GC_FREEZE",
        "REDIS_THROTTLE_KEY_PREFIX",
        "REDIS_THROTTLE_LEASE_TTL",
        "REDIS_THROTTLE_LOG_INTERVAL",
        "REDIS_THROTTLE_MAX_CRAWL_DELAY",
        "REDIS_THROTTLE_MAX_HOLD",
        "REDIS_THROTTLE_MAX_PAUSE",
        "REDIS_THROTTLE_MAX_RESERVE",
        "REDIS_THROTTLE_METRICS_HOST",
        "REDIS_THROTTLE_METRICS_MAX_DOMAINS",
        "REDIS_THROTTLE_METRICS_OTEL",
        "REDIS_THROTTLE_METRICS_PORT",
        "REDIS_THROTTLE_ON_REDIS_ERROR",
        "REDIS_THROTTLE_PARAMS",
        "REDIS_THROTTLE_PENALTY_BACKOFF",
        "REDIS_THROTTLE_PENALTY_DECAY",
        "REDIS_THROTTLE_PENALTY_HTTP_CODES",
        "REDIS_THROTTLE_PROBE_INTERVAL",
        "REDIS_THROTTLE_RATES",
        "REDIS_THROTTLE_REPORT_INTERVAL",
        "REDIS_THROTTLE_SCHEDULER",
        "REDIS_THROTTLE_SCOPE",
        "REDIS_THROTTLE_SENTINELS",
        "REDIS_THROTTLE_SENTINEL_PARAMS",
        "REDIS_THROTTLE_SENTINEL_SERVICE",
        "REDIS_THROTTLE_URL",
    )
)


def refuse_unknown_settings(settings: BaseSettings) -> None:
    """ThrottleConfigError for a ``REDIS_THROTTLE_*`` name that is no setting of the throttle,
    with the closest one."""
    for name in settings:
        if isinstance(name, str) and name.startswith(SETTING_PREFIX) and name not in SETTING_NAMES:
            # Compared without the prefix, which every name shares.
            suffixes = [known.removeprefix(SETTING_PREFIX) for known in SETTING_NAMES]
            closest = difflib.get_close_matches(name.removeprefix(SETTING_PREFIX), suffixes, n=1)
            hint = f": did you mean {SETTING_PREFIX}{closest[0]}?" if closest else ""
            raise ThrottleConfigError(
                f"{name:.200} is no setting of scrapy-redis-throttle{hint} (every setting: "
                f"docs/reference/settings.rst)"
            )
