"""A scrapy-redis fleet whose workers share one polite budget per domain."""

import os

BOT_NAME = "shop"
SPIDER_MODULES = ["shop.spiders"]
# With ROBOTSTXT_OBEY = True, a robots.txt Crawl-delay becomes its host's shared limit when it is
# stricter than the configured one (REDIS_THROTTLE_CRAWL_DELAY_ENABLED, on by default, and
# REDIS_THROTTLE_MAX_CRAWL_DELAY, 30 s). The demo site has no robots.txt: the demo leaves it off.
ROBOTSTXT_OBEY = False

# scrapy-redis: every worker pulls from, and adds to, one shared frontier in Redis. The throttle
# keeps the requests that must wait long for their domain's budget beside its queue, in Redis
# (shop:requests:parked), so that they do not hold download slots meanwhile.
SCHEDULER = "scrapy_redis.scheduler.Scheduler"
DUPEFILTER_CLASS = "scrapy_redis.dupefilter.RFPDupeFilter"
# Keep the frontier when one worker stops, or it would be cleared for all the others.
SCHEDULER_PERSIST = True
REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379/0")

# scrapy-redis-throttle: one shared token bucket per domain, in the same Redis (REDIS_URL).
ADDONS = {"scrapy_redis_throttle.Addon": 500}
# The buckets may live elsewhere: in another Redis (REDIS_THROTTLE_URL), a Sentinel-managed
# primary or a Redis Cluster (tests/test_fleet.py runs this project on each), e.g.
#   REDIS_THROTTLE_SENTINELS = ["10.0.0.1:26379"]; REDIS_THROTTLE_SENTINEL_SERVICE = "throttle"
#   REDIS_THROTTLE_CLUSTER_NODES = ["10.0.0.1:6379", "10.0.0.2:6379"]
# Domains the spider does not list get this shared limit ("unlimited" or None: no limit).
REDIS_THROTTLE_DEFAULT_RATE = "1/s"
# A 429 or 503 pauses its domain for the whole fleet (REDIS_THROTTLE_PENALTY_HTTP_CODES); with the
# adaptive rate, each such pause, and each download timeout, also halves the domain's rate for
# the fleet, which then climbs back to the configured rate (from the floor, 1/m, in 60 s here).
REDIS_THROTTLE_ADAPTIVE_ENABLED = True
REDIS_THROTTLE_ADAPTIVE_RECOVERY = 60
# While the fleet runs, an operator changes or pauses a domain's limit for every worker with
# `scrapy-redis-throttle` (run in this folder, it reads these settings), e.g.
# `scrapy-redis-throttle set 127.0.0.2 2/s` or `scrapy-redis-throttle --spider shop status`.
# If Redis fails, each worker paces each domain itself at 1/N of its rate, N being the number of
# workers it saw live in Redis just before (REDIS_THROTTLE_ON_REDIS_ERROR = "local", the
# default; REDIS_THROTTLE_FALLBACK_WORKERS would fix N), until Redis is back. Not before Redis
# has failed for it for REDIS_THROTTLE_FALLBACK_AFTER: the outage may be that worker's alone.
REDIS_THROTTLE_FALLBACK_AFTER = 5.0
# Each worker serves its metrics to Prometheus at http://127.0.0.1:<port>/metrics, on the first
# free port of this range (its log names it); `scrapy-redis-throttle exporter --port 9409` serves
# the fleet's state in Redis. See docs/reference/metrics.rst, and docs/grafana/ for a dashboard.
REDIS_THROTTLE_METRICS_PORT = [9410, 9499]
# Every REDIS_THROTTLE_LOG_INTERVAL seconds (60 by default; 0: never), each worker logs one INFO
# line on its busiest domains: the limit each went under, a pause under way, the requests sent
# over the last minute, those waiting and the longest wait. The demo's crawls are short.
REDIS_THROTTLE_LOG_INTERVAL = 10
# Each worker freezes its start-up's objects out of Python's garbage collector when the spider
# opens (REDIS_THROTTLE_GC_FREEZE, on by default), so that full collections do not stall it
# for 50-250 ms while its requests are on their way; False leaves the collector alone.

# Per-process politeness is left to the shared budget: no per-worker delay (the start-up log
# warns about a DOWNLOAD_DELAY, AutoThrottle or a per-domain concurrency below a burst).
DOWNLOAD_DELAY = 0
TELNETCONSOLE_ENABLED = False
