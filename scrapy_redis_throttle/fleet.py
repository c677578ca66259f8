"""What the throttle's parts read of the fleet: its size, as this worker last saw it
(:attr:`.Activity.fleet_size`)."""

from __future__ import annotations

from typing import Protocol


class Fleet(Protocol):
    """Where the fleet's size is read (:class:`.Activity`)."""

    @property
    def fleet_size(self) -> int | None: ...
