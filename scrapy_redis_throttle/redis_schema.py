"""What the throttle keeps in Redis: the names of its keys and channel, the epoch of the scripts'
clock, and how limits are written for the scripts. Python builds every key here and passes it to
the Lua scripts in ``KEYS``; the scripts get the epoch from :func:`.scripts.load_script`.

Under the prefix (``REDIS_THROTTLE_KEY_PREFIX``), in the throttle's Redis:

- ``<prefix>:{<tag>}``: a domain's bucket (``lua/token_bucket.lua``), with the domain's other
  keys beside it, its name and a suffix: ``:penalty``, ``:rate``, ``:quota``, ``:log``,
  ``:void``, ``:probe``. The braces are a Redis Cluster hash tag: one domain, one slot.
- ``<prefix>:penalties``: the channel pauses are published on.
- ``<prefix>:live``: the domains with a limit set live (``scrapy-redis-throttle set``).
- ``<prefix>:worker:<id>``: a worker's report; ``<prefix>:fleet``: the live workers;
  ``<prefix>:parked``: the fleet's parked requests per domain.

In scrapy-redis's Redis, beside its queue: ``<queue key>:parked`` and ``<queue key>:parked:moments``
(the parking area, ``lua/park.lua``).
"""

from __future__ import annotations

import hashlib
import re

# The scripts count Redis's time in µs from this epoch (2024-01-01), to keep the numbers small
# enough for sub-µs precision in doubles.
EPOCH = 1704067200
# No moment the scripts reserve is further from the epoch than this (µs, ~31 years: they reserve
# at most lua/prelude.lua's MAX_AHEAD ahead).
MAX_MOMENT_US = 10**15


def server_micros(seconds: float, micros: float) -> float:
    """Redis's ``TIME`` (*seconds*, *micros*) as the scripts count it: µs since :data:`EPOCH`."""
    return (seconds - EPOCH) * 1_000_000 + micros


# How token_bucket.lua and set_limit.lua name each algorithm of a limit.
ALGORITHM_CODES = {"token_bucket": "t", "fixed_window": "f", "sliding_window": "s"}

# Host names and simple groups appear as they are in Redis keys (readable in redis-cli).
_PLAIN_DOMAIN = re.compile(r"[a-z0-9._:-]{1,200}")


def key_tag(domain: str) -> str:
    """The part of a Redis key that names *domain*.

    Host names and groups come from crawled URLs and code, so they are untrusted: anything but a
    plain name of at most 200 characters (lowercase letters, digits, ``.``, ``_``, ``:``, ``-``)
    is replaced by ``#`` and its SHA-256. No two domains share a tag (``#`` is not in the plain
    alphabet), the tag cannot end the hash tag early (no braces), and its length is bounded.
    """
    if _PLAIN_DOMAIN.fullmatch(domain):
        return domain
    return "#" + hashlib.sha256(domain.encode("utf-8", "surrogatepass")).hexdigest()


def tagged_key(prefix: str, tag: str) -> str:
    """The bucket key of the domain whose :func:`key_tag` is *tag*."""
    # No suffix: every byte of a key name is paid once per domain (a ":bucket" suffix cost 16
    # bytes of Redis memory per domain, 165 instead of 149 at 100,000: bench/scale.py). The
    # domain's other keys add one (":penalty", ":rate"): the bucket's alone ends with its tag.
    return f"{prefix}:{{{tag}}}"


def bucket_key(prefix: str, domain: str) -> str:
    """The domain's bucket key. The braces are a Redis Cluster hash tag, so all the keys of one
    domain land in one slot."""
    return tagged_key(prefix, key_tag(domain))


# The probe's own bucket: "#" and something other than a SHA-256 is no domain's tag.
PROBE_KEY_TAG = "#probe"

# The domain's other keys: its bucket key with a suffix, in the same Cluster slot.
PENALTY_SUFFIX = ":penalty"
RATE_SUFFIX = ":rate"
QUOTA_SUFFIX = ":quota"
LOG_SUFFIX = ":log"
PROBE_SUFFIX = ":probe"
VOID_SUFFIX = ":void"
UNRESERVED_SUFFIX = ":unreserved"


def penalty_key(prefix: str, domain: str) -> str:
    """The domain's penalty state (see ``lua/penalty.lua``)."""
    return bucket_key(prefix, domain) + PENALTY_SUFFIX


def rate_key(prefix: str, domain: str) -> str:
    """The domain's adaptive rate (see ``lua/slow_down.lua``)."""
    return bucket_key(prefix, domain) + RATE_SUFFIX


def void_key(prefix: str, domain: str) -> str:
    """When the domain's reserved moments were last voided (see ``lua/voided.lua``)."""
    return bucket_key(prefix, domain) + VOID_SUFFIX


def secret_key(prefix: str) -> str:
    """The fleet's secret, which seals the tickets of parked requests (see :mod:`.seals`)."""
    return f"{prefix}:secret"


def penalty_channel(prefix: str) -> str:
    """Where pauses are published, for every worker of the fleet."""
    return f"{prefix}:penalties"


def live_key(prefix: str) -> str:
    """The set of the domains with a limit set live (see ``lua/set_limit.lua``)."""
    return f"{prefix}:live"


def report_key(prefix: str, worker: str) -> str:
    """A worker's report of its requests per domain."""
    return f"{prefix}:worker:{worker}"


def report_pattern(prefix: str) -> str:
    """Matches the key of every worker's report (for SCAN)."""
    return report_key(prefix, "*")


def fleet_key(prefix: str) -> str:
    """The sorted set of the fleet's live workers."""
    return f"{prefix}:fleet"


def parked_counts_key(prefix: str) -> str:
    """The hash of the fleet's parked requests per domain."""
    return f"{prefix}:parked"


def parking_key(queue_key: str) -> str:
    """Where the requests parked beside scrapy-redis's queue *queue_key* wait."""
    return f"{queue_key}:parked"


def moments_key(parking: str) -> str:
    """The index of the reserved moments of the requests parked in *parking* (see park.lua)."""
    return f"{parking}:moments"


def leases_key(queue_key: str, worker: str) -> str:
    """The requests *worker* took from beside scrapy-redis's queue *queue_key* and has not
    finished with (see ``lua/lease_pop.lua``)."""
    return f"{queue_key}:leases:{worker}"


def lessees_key(queue_key: str) -> str:
    """The workers holding leases on the requests of *queue_key*, and until when."""
    return f"{queue_key}:lessees"
