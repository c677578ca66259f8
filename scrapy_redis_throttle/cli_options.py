"""The command line of ``scrapy-redis-throttle``: its commands and options, each value read
strictly (a bad one is refused, naming the option), and the project's configuration under
them."""

from __future__ import annotations

import argparse
import math
from importlib.metadata import version
from typing import TYPE_CHECKING

from scrapy.utils.conf import closest_scrapy_cfg
from scrapy.utils.misc import load_object
from scrapy.utils.project import get_project_settings

from .addon import Addon
from .config import SCOPE_ATTRIBUTE, SPIDER_ATTRIBUTE, ThrottleConfig
from .errors import ThrottleConfigError
from .middleware import RedisThrottleMiddleware
from .rates import (
    HOST_PORT,
    TOKEN_BUCKET,
    Quota,
    normalize_domain,
    parse_burst,
    parse_limit,
    refuse_port,
)
from .redis_schema import ALGORITHM_CODES
from .scopes import PROXY, proxy_budget

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.settings import Settings

DESCRIPTION = "Change, inspect and pause the limits of a running fleet."


def parser() -> argparse.ArgumentParser:
    """The tool's commands and options."""
    parser = argparse.ArgumentParser(prog="scrapy-redis-throttle", description=DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version('scrapy-redis-throttle')}"
    )
    _global_options(parser, None)
    # The same options after the command too (each command's copy sets only what it is given).
    after = argparse.ArgumentParser(add_help=False)
    _global_options(after, argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    set_command = commands.add_parser(
        "set", help="set a domain's limit for every worker, at its next request", parents=[after]
    )
    set_command.add_argument("domain", metavar="DOMAIN")
    set_command.add_argument(
        "limits",
        metavar="LIMIT",
        nargs="+",
        help="a rate (5/s, 100/m, 1/10s, or a number), or ALGORITHM:RATE with ALGORITHM one of "
        f"{', '.join(ALGORITHM_CODES)} (e.g. sliding_window:10/2s); with several, every one "
        "applies (they replace the workers' own)",
    )
    set_command.add_argument(
        "--burst", help="the first token bucket's burst (default: the workers' own)"
    )
    for name, text in (
        ("get", "show a domain's limit and state"),
        ("delete", "back to the workers' own limit (ends a pause set live)"),
        ("pause", "stop every request to a domain until it is resumed"),
        ("resume", "end a pause set live"),
    ):
        command = commands.add_parser(name, help=text, parents=[after])
        command.add_argument("domain", metavar="DOMAIN")
        if name == "get":
            _json_option(command)
    _json_option(
        commands.add_parser("list", help="the domains with a limit set live", parents=[after])
    )
    status = commands.add_parser(
        "status", help="the live workers and a table of the active domains", parents=[after]
    )
    _json_option(status)
    status.add_argument(
        "--watch", type=_interval, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C"
    )
    status.add_argument(
        "--top", type=_positive_int, default=50, help="show at most this many (default 50)"
    )
    exporter = commands.add_parser(
        "exporter",
        help="serve the fleet's state in Redis to Prometheus, at /metrics, until Ctrl-C",
        parents=[after],
    )
    exporter.add_argument(
        "--port",
        type=_port,
        required=True,
        help="the port to listen on (0: any free one)",
    )
    exporter.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)"
    )
    exporter.add_argument(
        "--top",
        type=_positive_int,
        default=100,
        help="the domains with the most requests in the last minute that keep their own "
        "domain label (default 100)",
    )
    return parser


def _global_options(parser: argparse.ArgumentParser, default: object) -> None:
    """The options of every command, with *default* when not given."""
    for name, options in (
        ("--redis-url", {"help": "the fleet's Redis (default: the project's settings)"}),
        ("--key-prefix", {"help": "REDIS_THROTTLE_KEY_PREFIX (default: the project's)"}),
        (
            "--sentinels",
            {
                "metavar": "HOST:PORT,...",
                "help": "REDIS_THROTTLE_SENTINELS: ask these sentinels for the primary "
                "(with --service)",
            },
        ),
        ("--service", {"help": "REDIS_THROTTLE_SENTINEL_SERVICE, with --sentinels"}),
        (
            "--cluster-nodes",
            {
                "metavar": "HOST:PORT,...",
                "help": "REDIS_THROTTLE_CLUSTER_NODES: the fleet's Redis is the cluster of "
                "these nodes",
            },
        ),
        (
            "--spider",
            {"help": f"also read this spider's {SPIDER_ATTRIBUTE} and {SCOPE_ATTRIBUTE}"},
        ),
    ):
        parser.add_argument(name, default=default, **options)  # type: ignore[arg-type]


def _interval(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0.1 <= seconds <= 86400:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds from 0.1 to 86400, got {text!r}"
        )
    return seconds


def _port(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port, 0 to 65535, got {text!r}")
    return int(text)


def _positive_int(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return int(text)


def _json_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--json", action="store_true", help="print JSON (one object per refresh with --watch)"
    )


def domain(text: str, config: ThrottleConfig) -> str:
    """DOMAIN as the workers' budgets are named (see :func:`.rates.normalize_domain`, and
    :func:`.scopes.proxy_budget` for a proxy's ``host:port``, in a project whose scopes count
    proxies); a URL, or a port no worker's budget holds, is refused."""
    text = text.strip()
    proxies = PROXY in {scope.name for scope in (config.scope, *config.other_scopes)}
    refuse_port(text, proxies=proxies, source="DOMAIN")
    try:
        if "/" in text or not text:
            raise ValueError
        if HOST_PORT.fullmatch(text):
            return proxy_budget(text)
        return normalize_domain(text)
    except ValueError:  # IDNA's own errors say less than this
        raise ThrottleConfigError(
            f"DOMAIN: expected a host name (or a redis_throttle_key, or a proxy's host:port), "
            f"{'not a URL' if '/' in text else 'got'}: {text!r:.200}"
        ) from None


def project_config(args: argparse.Namespace) -> ThrottleConfig:
    """The project's configuration (with the options over it)."""
    args.in_project = bool(closest_scrapy_cfg())
    settings = get_project_settings()
    if args.redis_url:
        settings.set("REDIS_THROTTLE_URL", args.redis_url, priority="cmdline")
    if args.key_prefix:
        settings.set("REDIS_THROTTLE_KEY_PREFIX", args.key_prefix, priority="cmdline")
    if args.sentinels:
        settings.set("REDIS_THROTTLE_SENTINELS", args.sentinels, priority="cmdline")
    if args.service:
        settings.set("REDIS_THROTTLE_SENTINEL_SERVICE", args.service, priority="cmdline")
    if args.cluster_nodes:
        settings.set("REDIS_THROTTLE_CLUSTER_NODES", args.cluster_nodes, priority="cmdline")
    spider = None
    args.spider_unknown = False
    if args.spider:
        from scrapy.spiderloader import get_spider_loader

        try:
            spider = get_spider_loader(settings).load(args.spider)
        except KeyError as exc:
            raise ThrottleConfigError(f"--spider: no spider named {args.spider!r}") from exc
    elif args.in_project:
        from scrapy.spiderloader import get_spider_loader

        # The project's one spider gives the limits the workers have: without it, its
        # redis_throttle_rates would be unknown, and each domain shown at the default.
        loader = get_spider_loader(settings)
        names = loader.list()
        if len(names) == 1:
            spider = loader.load(names[0])
        args.spider_unknown = len(names) > 1
    args.throttle_off = throttle_off(settings, spider) if args.in_project else None
    # The tool works on the fleet's Redis even where these settings turn the throttle off.
    settings.set("REDIS_THROTTLE_ENABLED", True, priority="cmdline")
    return ThrottleConfig.from_settings(
        settings,
        spider_rates=getattr(spider, SPIDER_ATTRIBUTE, None),
        spider_scope=getattr(spider, SCOPE_ATTRIBUTE, None),
    )


def throttle_off(settings: Settings, spider: type[Spider] | None) -> str | None:
    """Why the project's workers, by *settings* and the *spider*'s custom settings, do not run
    the throttle (None: they do)."""
    settings = settings.copy()
    if spider is not None:
        spider.update_settings(settings)
    if not settings.getbool("REDIS_THROTTLE_ENABLED", True):
        return "REDIS_THROTTLE_ENABLED is False"
    for name, component in (("ADDONS", Addon), ("DOWNLOADER_MIDDLEWARES", RedisThrottleMiddleware)):
        if any(
            priority is not None and _is(key, component)
            for key, priority in settings.getdict(name).items()
        ):
            return None
    return (
        "neither ADDONS has scrapy_redis_throttle.Addon nor DOWNLOADER_MIDDLEWARES its "
        "middleware (a line ADDONS = {} after the throttle's block undoes it)"
    )


def _is(key: object, component: type) -> bool:
    """Whether *key* of a components' dict (a class, or its import path) is *component*, or
    a subclass of it."""
    if isinstance(key, str):
        try:
            key = load_object(key)
        except Exception:  # a component the tool cannot import is not the throttle's
            return False
    return isinstance(key, type) and issubclass(key, component)


def live_limit(
    texts: list[str], burst_text: str | None
) -> tuple[float, int | None, tuple[Quota, ...]]:
    """The rate, burst (None: the workers' own) and quotas that ``set`` LIMIT... gives."""
    items: list[dict[str, object]] = []
    for text in texts:
        algorithm, _, rate = text.rpartition(":")
        items.append({"rate": rate, "algorithm": algorithm or TOKEN_BUCKET})
    buckets = [item for item in items if item["algorithm"] == TOKEN_BUCKET]
    burst = None if burst_text is None else parse_burst(burst_text, source="--burst")
    if burst is not None:
        if not buckets:
            raise ThrottleConfigError("--burst: only a token bucket has a burst")
        buckets[0]["burst"] = burst
    limit = parse_limit(items, default_burst=1, source="LIMIT")
    assert limit is not None  # a list of rates
    # The workers' burst applies to a first token bucket given without one.
    workers_burst = burst is None and bool(buckets) and buckets[0] is items[0]
    return limit.rate, None if workers_burst else limit.burst, limit.quotas
