"""How a parked request travels through Redis: as JSON, never pickled.

Whoever may write into the parking set would run code in every worker that unpickles what it
reads there (scrapy-redis's own queue does, with its default ``SCHEDULER_SERIALIZER``; the
parking set adds no second such door). A request is written as the JSON of Scrapy's
:meth:`~scrapy.Request.to_dict` (its body in base64, its headers in Latin-1) and read back by a
strict parser: a field of the wrong type, a request class this process has not imported, a
callback that is not a method of the spider, a URL with no host (``file:``, which would read
this machine's files) is refused; nothing is imported, nothing called.

A request whose meta, ``cb_kwargs`` or cookies hold anything JSON would not give back as it was
(an Item, a tuple, bytes, a float that is not finite) cannot be parked: :class:`Unparkable`.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import json
import math
import sys
from typing import TYPE_CHECKING, Any

from scrapy import Request
from scrapy.utils.httpobj import urlparse_cached

if TYPE_CHECKING:
    from scrapy import Spider

# Nesting deeper than this in meta or cb_kwargs is refused (and never read back): a bound on the
# work of a hostile entry, far above what a spider nests.
MAX_DEPTH = 32
MAX_PRIORITY = 2**53
# The fields of Request.to_dict() besides the request class's attributes.
_FIELDS = ("url", "callback", "errback", "headers")


class Unparkable(ValueError):
    """A request the parking set cannot hold, and why."""


def encode_request(request: Request, spider: Spider) -> bytes:
    """*request* as the parking set holds it; :class:`Unparkable` says why it cannot be."""
    if not urlparse_cached(request).netloc:
        raise Unparkable("its URL has no host")
    try:
        fields = request.to_dict(spider=spider)
    except ValueError as error:  # a callback that is not a method of the spider
        raise Unparkable(str(error)) from None
    wire: dict[str, Any] = {}
    for name, value in fields.items():
        if name == "body":
            wire[name] = base64.b64encode(value).decode("ascii")
        elif name == "headers":
            # Scrapy's Headers hold bytes: Latin-1 maps each byte to one character and back.
            wire[name] = [
                [key.decode("latin-1"), [item.decode("latin-1") for item in values]]
                for key, values in value.items()
            ]
        else:
            _check_plain(value, name, 0)
            wire[name] = value
    return json.dumps(wire, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _check_plain(value: object, where: str, depth: int) -> None:
    """Refuse what JSON would not give back as it is (exact types: a str or int subclass comes
    back as the base class, a tuple as a list)."""
    if depth > MAX_DEPTH:
        raise Unparkable(f"{where} is nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind in (str, int, bool):
        return
    if isinstance(value, float) and kind is float:
        if not math.isfinite(value):
            raise Unparkable(f"{where} is {value!r}, which JSON does not hold")
    elif isinstance(value, list) and kind is list:
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]", depth + 1)
    elif isinstance(value, dict) and kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise Unparkable(f"{where} has a key {key!r} that is not a str")
            _check_plain(item, f"{where}[{key!r}]", depth + 1)
    else:
        raise Unparkable(f"{where} is a {kind.__name__}, which JSON does not hold")


def decode_request(data: bytes, spider: Spider) -> Request:
    """The request *data* holds (see :func:`encode_request`); ValueError for anything that is
    not such a request."""
    try:
        fields = json.loads(data)
    except (ValueError, RecursionError) as error:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"not JSON ({type(error).__name__})") from None
    if type(fields) is not dict:
        raise ValueError(f"a JSON {type(fields).__name__}, not an object")
    request_class = _request_class(fields.pop("_class", None))
    unknown = set(fields) - {*_FIELDS, *request_class.attributes}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)!r}")
    kwargs: dict[str, Any] = {}
    for name, value in fields.items():
        kwargs[name] = _FIELD_PARSERS.get(name, _plain)(name, value, spider)
    if "url" not in kwargs:
        raise ValueError("no url")
    try:
        request = request_class(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"not a request: {error}") from None
    if not urlparse_cached(request).netloc:
        raise ValueError(f"url {request.url[:100]!r} has no host")
    return request


def _request_class(name: object) -> type[Request]:
    """The request class *name* names, only if this process has imported it already: reading
    an entry never imports a module (an import runs the module's code)."""
    if name is None:
        return Request
    if type(name) is not str:
        raise ValueError(f"_class is a {type(name).__name__}")
    module_name, _, attribute = name.rpartition(".")
    found = getattr(sys.modules.get(module_name), attribute, None) if module_name else None
    if not (isinstance(found, type) and issubclass(found, Request)):
        raise ValueError(f"_class {name[:100]!r} is no request class this worker imported")
    return found


def _typed(kind: type) -> Any:
    def parse(name: str, value: object, spider: Spider) -> object:
        if type(value) is not kind:
            raise ValueError(f"{name} is a {type(value).__name__}, not a {kind.__name__}")
        return value

    return parse


def _plain(name: str, value: object, spider: Spider) -> object:
    """Any JSON value (as json.loads gives it), nested at most MAX_DEPTH deep."""
    try:
        _check_plain(value, name, 0)
    except Unparkable as error:
        raise ValueError(str(error)) from None
    return value


def _method(name: str, value: object, spider: Spider) -> object:
    """A callback or errback: None, or the name of a method of the spider (never another
    attribute, which the request would call with its response)."""
    if value is None:
        return None
    if type(value) is not str:
        raise ValueError(f"{name} is a {type(value).__name__}, not a method name")
    # A function of its class, not a special one: the request calls it with its response.
    method = inspect.getattr_static(spider, value, None)
    if not inspect.isfunction(method) or (value.startswith("__") and value.endswith("__")):
        raise ValueError(f"{name} {value[:100]!r} is no method of the spider")
    return getattr(spider, value)


def _headers(name: str, value: object, spider: Spider) -> object:
    if type(value) is not list or not all(
        type(pair) is list
        and len(pair) == 2
        and type(pair[0]) is str
        and type(pair[1]) is list
        and all(type(item) is str for item in pair[1])
        for pair in value
    ):
        raise ValueError("headers are not a list of [name, [values]] strings")
    try:
        return {
            key.encode("latin-1"): [item.encode("latin-1") for item in values]
            for key, values in value
        }
    except UnicodeEncodeError:
        raise ValueError("headers hold a character that is no byte") from None


def _body(name: str, value: object, spider: Spider) -> object:
    if type(value) is not str:
        raise ValueError(f"body is a {type(value).__name__}, not base64")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("body is not base64") from None


def _flags(name: str, value: object, spider: Spider) -> object:
    if type(value) is not list or not all(type(flag) is str for flag in value):
        raise ValueError("flags are not a list of strings")
    return value


def _mapping(name: str, value: object, spider: Spider) -> object:
    if type(value) is not dict:
        raise ValueError(f"{name} is a {type(value).__name__}, not an object")
    return _plain(name, value, spider)


def _cookies(name: str, value: object, spider: Spider) -> object:
    if type(value) not in (dict, list):
        raise ValueError(f"cookies are a {type(value).__name__}")
    return _plain(name, value, spider)


def _priority(name: str, value: object, spider: Spider) -> object:
    # Bounded, as scrapy-redis's queue scores requests by it (a float).
    if type(value) is not int or abs(value) > MAX_PRIORITY:
        raise ValueError(f"priority is not an integer within ±{MAX_PRIORITY}")
    return value


_FIELD_PARSERS = {
    "url": _typed(str),
    "method": _typed(str),
    "encoding": _typed(str),
    "priority": _priority,
    "dont_filter": _typed(bool),
    "callback": _method,
    "errback": _method,
    "headers": _headers,
    "body": _body,
    "flags": _flags,
    "meta": _mapping,
    "cb_kwargs": _mapping,
    "cookies": _cookies,
}
