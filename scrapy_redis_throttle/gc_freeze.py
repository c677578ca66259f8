"""Keeps Python's full garbage collections from stalling a worker past its requests' moments.

A Scrapy worker keeps some 90,000 objects from its start-up (modules, classes, functions, the
crawler's components). Python's cyclic collector walks them all at each full (generation 2)
collection, with the event loop stopped: 50-250 ms every few seconds of crawling, measured in
this project's fleets. A request that left the throttle at its moment reached the site that
much late, against the next one sent on time by another worker, and requests still waiting
missed their moments. Frozen (:func:`gc.freeze`), the start-up objects are left out of every
collection: a full collection walks only what the crawl made since.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect, then freeze what survives out of the cyclic collector, in a process where
    nothing is frozen yet and the collector runs; return how many objects this froze (0:
    none). Once a process: a later crawler's start would stall the crawls running beside it
    (collecting first) and freeze their objects for good, garbage to be included."""
    if gc.get_freeze_count() or not gc.isenabled():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
