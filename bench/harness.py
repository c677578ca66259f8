"""What every benchmark of bench/ does around its measurements: the reactor, the table's header
and legend, and the final JSON line."""

from __future__ import annotations

import json
import warnings
from typing import TYPE_CHECKING, Any

from scrapy.exceptions import ScrapyDeprecationWarning
from scrapy.utils.defer import deferred_from_coro
from scrapy.utils.reactor import install_reactor
from twisted.internet.task import react

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine


def run_benchmark(
    name: str,
    header: str,
    measure: Callable[[], Coroutine[Any, Any, list[dict[str, Any]]]],
    legend: str,
) -> None:
    """Print *header*, run *measure* (which prints a row per measurement and returns them all)
    on the asyncio reactor, then print *legend* and one JSON line of the rows."""

    async def report() -> None:
        print(header)
        print("-" * len(header))
        rows = await measure()
        print(f"\n{legend}")
        print(json.dumps({"benchmark": name, "rows": rows}))

    # scrapy-redis 0.9.1 passes spider= to the stats collector, which current Scrapy deprecates.
    warnings.filterwarnings("ignore", category=ScrapyDeprecationWarning, module="scrapy_redis")
    install_reactor("twisted.internet.asyncioreactor.AsyncioSelectorReactor")
    react(lambda _reactor: deferred_from_coro(report()))
