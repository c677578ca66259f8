"""Strict readers of single Scrapy settings: each one returns a bounded value or raises
:exc:`.ThrottleConfigError` naming the setting and the value."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .errors import ThrottleConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from scrapy.settings import BaseSettings


def get_seconds(settings: BaseSettings, name: str, default: float, minimum: float) -> float:
    return get_number(
        settings,
        name,
        default,
        lambda seconds: math.isfinite(seconds) and seconds >= minimum,
        f"a number of seconds >= {minimum:g}",
    )


def get_number(
    settings: BaseSettings,
    name: str,
    default: float,
    valid: Callable[[float], bool],
    expected: str,
) -> float:
    """The setting as a float, when *valid* (NaN, from anything that is no number, is not)."""
    value = get_value(settings, name, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not valid(number):
        raise ThrottleConfigError(f"{name} must be {expected}, got {value!r}")
    return number


def get_status_codes(settings: BaseSettings, name: str, default: tuple[int, ...]) -> frozenset[int]:
    value = get_value(settings, name, default)
    try:
        codes = settings.getlist(name, list(default))
        statuses = frozenset(int(code) for code in codes)
    except (TypeError, ValueError):
        statuses = frozenset({0})
    if isinstance(value, (bool, int)) or not all(100 <= code <= 599 for code in statuses):
        raise ThrottleConfigError(
            f"{name} must be a list of HTTP status codes (100-599), got {value!r}"
        )
    return statuses


def get_flag(settings: BaseSettings, name: str, *, default: bool) -> bool:
    try:
        return settings.getbool(name, default)
    except ValueError as exc:  # Scrapy's message does not name the setting
        raise ThrottleConfigError(
            f"{name} must be True or False (or 1, 0, 'true', 'false'), got {settings[name]!r}"
        ) from exc


def get_value(settings: BaseSettings, name: str, default: object) -> Any:
    """The setting's value, *default* only when it is not set at all (``settings.get`` would also
    replace an explicit ``None``, which means "unlimited" for a rate)."""
    return settings[name] if settings.getpriority(name) is not None else default


def get_dict(settings: BaseSettings, name: str) -> Mapping[Any, Any]:
    try:
        return settings.getdict(name)
    except (ValueError, TypeError) as exc:  # not a dict, nor a JSON object string
        value = settings.get(name)
        # Connection parameters may hold a password: their type only.
        shown = f"a {type(value).__name__}" if name.endswith("PARAMS") else repr(value)
        raise ThrottleConfigError(f"{name} must be a dict, got {shown}") from exc


def get_addresses(settings: BaseSettings, name: str) -> list[tuple[str, int]]:
    """The setting's "host:port" entries (a list, or a string separated by commas)."""
    value = get_value(settings, name, [])
    try:
        entries = settings.getlist(name, [])
    except (TypeError, ValueError) as exc:
        raise ThrottleConfigError(f"{name} must be a list of 'host:port', got {value!r}") from exc
    addresses = []
    for entry in entries:
        host, _, port = str(entry).strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ThrottleConfigError(
                f"{name} must be a list of 'host:port', got {value!r} ({entry!r})"
            )
        addresses.append((host, int(port)))
    return addresses
