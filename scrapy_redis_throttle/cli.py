"""``scrapy-redis-throttle``: Change, inspect and pause the limits of a running fleet.

Run inside a Scrapy project, it reads the project's settings (``REDIS_THROTTLE_URL`` or
``REDIS_URL``, ``REDIS_THROTTLE_KEY_PREFIX``, the limits; ``--spider`` adds a spider's
``redis_throttle_rates``); elsewhere, give ``--redis-url``. Exit codes: 0 done, 1 Redis failed,
2 bad input.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import RedisClusterException

from . import cli_options, status_view
from .config import ThrottleConfig, needs_extra
from .connection import connect_sync
from .control import LiveControl
from .errors import ThrottleConfigError
from .metrics_endpoint import MetricsEndpoint
from .status_view import UNREADABLE_NOTE, as_json

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    from .control import Change
    from .live_limits import LiveLimit

WORKERS_OWN_LIMIT = "the workers' own limit"
EXIT_REDIS_FAILED = 1
EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli_options.parser()
    args = parser.parse_args(argv)
    try:
        config = cli_options.project_config(args)
        if hasattr(args, "domain"):
            args.domain = cli_options.domain(args.domain, config)
        if args.command == "set":
            live = cli_options.live_limit(args.limits, args.burst)
        if args.command == "exporter":
            needs_extra("exporter", "prometheus_client", "metrics")
    except ThrottleConfigError as exc:
        parser.error(str(exc))
    if args.throttle_off:
        print(
            f"scrapy-redis-throttle: this project's workers do not run the throttle: "
            f"{args.throttle_off}",
            file=sys.stderr,
        )
    try:
        client = connect_sync(config)  # a cluster client finds the cluster's nodes here
    except (redis.RedisError, RedisClusterException) as exc:
        return _redis_failed(config, exc)
    try:
        control = LiveControl(client, config.key_prefix)
        if args.command == "set":
            _print_change(args.domain, control.set(args.domain, *live))
        elif args.command in ("delete", "pause", "resume"):
            _print_change(args.domain, getattr(control, args.command)(args.domain))
        elif args.command == "get":
            rows = status_view.domain_rows(
                [control.state(args.domain)], config, args.in_project, control.activity()
            )
            print(as_json({"domains": rows}) if args.json else status_view.render_table(rows))
        elif args.command == "list":
            limits = control.live_limits()
            if args.json:
                print(as_json({"live": {domain: _live(limit) for domain, limit in limits.items()}}))
            else:
                print(
                    "\n".join(f"{domain}: {limit}" for domain, limit in limits.items())
                    or "No domain has a limit set live."
                )
        elif args.command == "exporter":
            _export(control, args)
        else:
            status_view.show(control, config, args)
        if args.spider_unknown and args.command in ("get", "status"):
            print(
                "scrapy-redis-throttle: the project has several spiders: their "
                "redis_throttle_rates are not shown (give --spider NAME)",
                file=sys.stderr,
            )
        for problem in control.problems:
            print(f"scrapy-redis-throttle: {UNREADABLE_NOTE}{problem}", file=sys.stderr)
    except (redis.RedisError, RedisClusterException) as exc:
        return _redis_failed(config, exc)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return 0


def _redis_failed(config: ThrottleConfig, exc: Exception) -> int:
    print(
        f"scrapy-redis-throttle: Redis at {config.redis_location} failed: "
        f"{type(exc).__name__}: {exc}",
        file=sys.stderr,
    )
    return EXIT_REDIS_FAILED


def _print_change(domain: str, change: Change) -> None:
    print(f"{domain}: {change.live or WORKERS_OWN_LIMIT}")
    if change.void:
        print(
            f"  the requests already given a turn in the next {change.void:.1f} s ask again, "
            "under this limit"
        )


def _export(control: LiveControl, args: argparse.Namespace) -> None:
    """Serve the fleet's state (see :class:`.fleet_exporter.FleetCollector`) until Ctrl-C."""
    from .fleet_exporter import FleetCollector

    endpoint = MetricsEndpoint.start(
        FleetCollector(control, args.top, _unreadable), args.host, (args.port, args.port)
    )
    print(
        f"serving the fleet's metrics at http://{endpoint.host}:{endpoint.port}/metrics", flush=True
    )
    try:
        threading.Event().wait()
    finally:
        endpoint.close()


def _unreadable(problem: str) -> None:
    print(f"scrapy-redis-throttle: {UNREADABLE_NOTE}{problem}", file=sys.stderr, flush=True)


def _live(limit: LiveLimit) -> dict[str, Any]:
    """A limit set live, as ``list --json`` prints it (None: the workers' own)."""
    return {
        "limit": str(limit),
        "rate": limit.rate,
        "burst": limit.burst,
        "paused": limit.paused,
    }


if __name__ == "__main__":
    sys.exit(main())
