"""Strict, total readers of the values the throttle reads back from Redis, which anyone with
access may have written: each returns a bounded value or raises ValueError saying why."""

from __future__ import annotations

import math


def finite(value: bytes | str | float) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{number!r} is not finite")
    return number


def positive(value: bytes | str) -> float:
    number = finite(value)
    if number <= 0:
        raise ValueError(f"{number!r} is not positive")
    return number


def whole(value: object, least: int = 1) -> int:
    """An integer of at least *least* (and at most 2**53: a float holds it), from Redis's text
    or JSON (not a bool, not a float)."""
    if isinstance(value, bytes):
        value = value.decode("ascii")
    if isinstance(value, str):
        value = int(value) if value.isascii() else None  # int() takes "٣" too
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= 2**53:
        raise ValueError(f"{value!r:.60} is not an integer of at least {least}")
    return value


def text(value: bytes | str) -> str:
    """A reply as text, whether the client decodes replies or not (an invalid byte shown as
    such, rather than failing)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
