"""How a parked request travels through Redis: as JSON, never pickled.

Whoever may write into the parking set would run code in every worker that unpickles what it
reads there (scrapy-redis's own queue does, with its default ``SCHEDULER_SERIALIZER``; the
parking set adds no second such door). A request is written as the JSON of Scrapy's
:meth:`~scrapy.Request.to_dict` (its body in base64, its headers in Latin-1) and read back by a
strict parser: a field of the wrong type, a request class this process has not imported, a
callback that is not a method of the spider's class, a URL that is not http or https (``file:``
would read this machine's files) is refused; nothing is imported (but Python's own codecs, for
the request's encoding), nothing called.

A request that would not come back as it was cannot be parked (:class:`Unparkable`): its meta,
``cb_kwargs`` or cookies hold a value JSON does not (an Item, a tuple, bytes, ``inf``), or any
field the parser refuses.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import inspect
import json
import math
import sys
from types import MethodType
from typing import Any

from scrapy import Request, Spider
from scrapy.utils.httpobj import urlparse_cached

# Bounds on the work of reading an entry, far above what a request needs: its size (a request
# that would take more is not parked), and how deep its meta or cb_kwargs nest.
MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_PRIORITY = 2**53
# Scrapy drops longer URLs by default (URLLENGTH_LIMIT, 2083).
MAX_URL_LENGTH = 8192
# A parked request comes back only to be downloaded from a host: never file: (this machine's
# files) nor data: (nothing to throttle).
SCHEMES = ("http", "https")
# The fields of Request.to_dict() besides the request class's attributes.
_FIELDS = ("url", "callback", "errback", "headers")


class Unparkable(ValueError):
    """A request the parking set cannot hold, and why."""


def encode_request(request: Request, spider: Spider) -> bytes:
    """*request* as the parking set holds it; :class:`Unparkable` says why it cannot be, which
    includes any request :func:`decode_request` would not give back as it was."""
    wire = _wire(request, spider)
    try:
        data = json.dumps(wire, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except ValueError as error:  # an int of more digits than Python turns into text
        raise Unparkable(f"not JSON: {error}") from None
    if len(data) > MAX_BYTES:
        raise Unparkable(f"{len(data):,} bytes as JSON, more than {MAX_BYTES:,}")
    try:
        back = decode_request(data, spider)
    except ValueError as error:  # a priority past MAX_PRIORITY, flags that are no strings...
        raise Unparkable(f"it would not be read back: {error}") from None
    if _wire(back, spider) != wire:
        raise Unparkable("it would not come back as it is")
    return data


def _wire(request: Request, spider: Spider) -> dict[str, Any]:
    """Request.to_dict(), as JSON holds it; built here, for to_dict(spider=...) reads every
    attribute of the spider (properties, __getattr__) to name a callback."""
    try:
        return _fields(request, spider)
    except Unparkable:
        raise
    except Exception as error:  # a request class or a value of the project's that misbehaves
        raise Unparkable(f"{type(error).__name__}: {error!s:.200}") from None


def _fields(request: Request, spider: Spider) -> dict[str, Any]:
    if urlparse_cached(request).scheme not in SCHEMES:
        raise Unparkable("its URL is not http or https")
    wire: dict[str, Any] = {
        "url": request.url,
        "callback": _method_name(spider, request.callback, "callback"),
        "errback": _method_name(spider, request.errback, "errback"),
        # Scrapy's Headers hold bytes: Latin-1 maps each byte to one character and back.
        "headers": [
            [key.decode("latin-1"), [item.decode("latin-1") for item in values]]
            for key, values in request.headers.items()
        ],
    }
    for name in request.attributes:
        if name in wire:
            continue
        value = getattr(request, name)
        if name == "body":
            wire[name] = base64.b64encode(value).decode("ascii")
        else:
            _check_plain(value, (name,), 0)
            wire[name] = value
    if type(request) is not Request:
        wire["_class"] = f"{type(request).__module__}.{type(request).__name__}"
    return wire


def _method_name(spider: Spider, method: Any, field: str) -> str | None:
    """The name under which :func:`_method` finds *method* (None: no callback): its own, or
    another its spider's class holds it under (a name the instance holds it under, an alias,
    is not one)."""
    if method is None:
        return None
    function = getattr(method, "__func__", None)
    if function is None or getattr(method, "__self__", None) is not spider:
        raise Unparkable(f"its {field} is no method of the spider")
    names = [getattr(function, "__name__", None)]
    names += [name for cls in type(spider).__mro__ for name in vars(cls)]
    for name in names:
        if isinstance(name, str) and _class_function(type(spider), name) is function:
            return name
    raise Unparkable(f"its {field} is no method of the spider's class")


def _class_function(cls: type, name: str) -> Any:
    """The plain function *name* is in *cls* or its bases (not its metaclass), if it may be a
    request's callback: not one of Scrapy's Spider (its internals, such as _set_crawler) but
    parse, nor a special method; else None."""
    if name != "parse" and (name in vars(Spider) or name.startswith("__")):
        return None
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            return value if inspect.isfunction(value) else None
    return None


def _check_plain(value: object, path: tuple[object, ...], depth: int) -> None:
    """Refuse what JSON would not give back as it is (exact types: an int subclass comes back
    as an int, a tuple as a list). *path* says where *value* is: formatted only
    for the message (building it for every item cost time quadratic in the nesting)."""
    if depth > MAX_DEPTH:
        raise Unparkable(f"{_where(path)} is nested deeper than {MAX_DEPTH}")
    kind = type(value)
    # A str subclass (lxml's link text, in CrawlSpider's rule requests) comes back as a str.
    if value is None or kind in (int, bool) or isinstance(value, str):
        return
    if isinstance(value, float) and kind is float:
        if not math.isfinite(value):
            raise Unparkable(f"{_where(path)} is {value!r}, which JSON does not hold")
    elif isinstance(value, list) and kind is list:
        for index, item in enumerate(value):
            _check_plain(item, (*path, index), depth + 1)
    elif isinstance(value, dict) and kind is dict:
        for key, item in value.items():
            if not isinstance(key, str):
                raise Unparkable(f"{_where(path)} has a key {key!r:.50} that is not a str")
            _check_plain(item, (*path, key), depth + 1)
    else:
        raise Unparkable(f"{_where(path)} is a {kind.__name__}, which JSON does not hold")


def _where(path: tuple[object, ...]) -> str:
    return f"{path[0]}" + "".join(f"[{part!r:.50}]" for part in path[1:])


def decode_request(data: bytes, spider: Spider) -> Request:
    """The request *data* holds (see :func:`encode_request`); ValueError for anything that is
    not such a request."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{len(data):,} bytes, more than {MAX_BYTES:,}")
    try:
        fields = json.loads(data)
    except (ValueError, RecursionError) as error:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"not JSON ({type(error).__name__})") from None
    if type(fields) is not dict:
        raise ValueError(f"a JSON {type(fields).__name__}, not an object")
    request_class = _request_class(fields.pop("_class", None))
    unknown = set(fields) - {*_FIELDS, *request_class.attributes}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)!r:.200}")
    kwargs: dict[str, Any] = {}
    for name, value in fields.items():
        kwargs[name] = _FIELD_PARSERS.get(name, _plain)(name, value, spider)
    url = kwargs.get("url")
    if type(url) is not str or not url.startswith(tuple(f"{scheme}://" for scheme in SCHEMES)):
        raise ValueError("no http or https url")
    if len(url) > MAX_URL_LENGTH:  # (IDNA takes ~1 ms per KB of a host)
        raise ValueError(f"a url of {len(url):,} characters, more than {MAX_URL_LENGTH:,}")
    try:
        request = request_class(**kwargs)
    except Exception as error:  # a request class's constructor may raise anything
        raise ValueError(f"not a request: {type(error).__name__}: {error!s:.200}") from None
    if urlparse_cached(request).scheme not in SCHEMES or not urlparse_cached(request).netloc:
        raise ValueError(f"url {request.url[:100]!r} is not an http or https URL with a host")
    return request


def _request_class(name: object) -> type[Request]:
    """The request class *name* names, only if this process has imported it already: reading
    an entry never imports a module (an import runs the module's code; so does a module's
    __getattr__, which vars() passes by)."""
    if name is None:
        return Request
    if type(name) is not str:
        raise ValueError(f"_class is a {type(name).__name__}")
    module_name, _, attribute = name.rpartition(".")
    module = sys.modules.get(module_name) if module_name else None
    found = vars(module).get(attribute) if module is not None else None
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
        _check_plain(value, (name,), 0)
    except Unparkable as error:
        raise ValueError(str(error)) from None
    return value


def _method(name: str, value: object, spider: Spider) -> object:
    """A callback or errback: None, or the name of a method of the spider's class (never
    another attribute, nor one of Scrapy's Spider but parse: the request calls it with its
    response), bound to the spider."""
    if value is None:
        return None
    if type(value) is not str:
        raise ValueError(f"{name} is a {type(value).__name__}, not a method name")
    function = _class_function(type(spider), value)
    if function is None:
        raise ValueError(f"{name} {value[:100]!r} is no method of the spider")
    return MethodType(function, spider)


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


def _encoding(name: str, value: object, spider: Spider) -> object:
    """A text encoding Python knows (not a bytes-to-bytes codec such as base64)."""
    if type(value) is not str or len(value) > 40:
        raise ValueError("encoding is not a short string")
    try:
        known = codecs.lookup(value)._is_text_encoding
    except LookupError:
        known = False
    if not known:
        raise ValueError(f"encoding {value!r} is no text encoding")
    return value


def _priority(name: str, value: object, spider: Spider) -> object:
    # Bounded, as scrapy-redis's queue scores requests by it (a float).
    if type(value) is not int or abs(value) > MAX_PRIORITY:
        raise ValueError(f"priority is not an integer within ±{MAX_PRIORITY}")
    return value


_FIELD_PARSERS = {
    "url": _typed(str),
    "method": _typed(str),
    "encoding": _encoding,
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
