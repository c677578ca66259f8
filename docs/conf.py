"""Sphinx configuration of scrapy-redis-throttle's documentation.

Built by ``tox -e docs``: ``sphinx-build -W --keep-going -n -b html docs docs/_build/html``, with
the package installed, so that autodoc imports it.
"""

from __future__ import annotations

import dataclasses
import inspect
from importlib.metadata import version as installed_version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sphinx.application import Sphinx

project = "scrapy-redis-throttle"
author = "scrapy-redis-throttle developers"
project_copyright = "2026, scrapy-redis-throttle developers"
release = installed_version("scrapy-redis-throttle")
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    # CHANGELOG.md is included in changes.rst.
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

html_theme = "sphinx_rtd_theme"
html_title = f"scrapy-redis-throttle {release}"

# The docstrings' signatures without their annotations: the package imports its types only for
# type checkers (``from __future__ import annotations``), and a build without the network has no
# inventory of Scrapy's, Twisted's or redis-py's types to link them to.
autodoc_typehints = "none"
autodoc_member_order = "bysource"

# Every cross-reference must resolve (-n), except those the docstrings make to what these pages do
# not document: the package's internal modules and what is in them (named by their module, or
# relative to it, as ``:class:`.ServerClock```), and Scrapy's, Twisted's and redis-py's own. The
# pages name the public classes by the package's names (scrapy_redis_throttle.Limit), which stay
# checked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!scrapy_redis_throttle\b).*"),
    (r"py:mod", r"scrapy_redis_throttle\..+"),
    (r"py:.*", r"scrapy_redis_throttle\.[a-z_]+\..+"),
]

myst_heading_anchors = 3


def _dataclass_signature(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str, str | None] | None:
    """A dataclass without a docstring of its own (ThrottleConfig, AcquireResult) gets one from
    ``dataclasses``, its signature with the annotations as strings, which autodoc takes as the
    class's signature: show it without them, as the other signatures."""
    if (
        what != "class"
        or not dataclasses.is_dataclass(obj)
        or not signature
        or ":" not in signature
    ):
        return None
    parameters = [
        parameter.replace(annotation=inspect.Parameter.empty)
        for parameter in inspect.signature(obj).parameters.values()
    ]
    return str(inspect.Signature(parameters)), return_annotation


def setup(app: Sphinx) -> None:
    app.connect("autodoc-process-signature", _dataclass_signature)
    # As Scrapy's docs: ``.. setting:: NAME`` and :setting:`NAME`, ``.. reqmeta:: name`` and
    # :reqmeta:`name`, with an index entry each.
    app.add_crossref_type("setting", "setting", "pair: %s; setting")
    app.add_crossref_type("reqmeta", "reqmeta", "pair: %s; reqmeta")
