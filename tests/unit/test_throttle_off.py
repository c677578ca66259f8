"""Whether a project's workers run the throttle, as the tool reads the project
(:func:`.cli_options.throttle_off`): the add-on, or the middleware line, in the settings or the
spider's custom settings."""

from __future__ import annotations

from typing import Any

import pytest
from scrapy import Spider
from scrapy.settings import Settings

from scrapy_redis_throttle import Addon, RedisThrottleMiddleware
from scrapy_redis_throttle.cli_options import throttle_off

OFF = (
    "neither ADDONS has scrapy_redis_throttle.Addon nor DOWNLOADER_MIDDLEWARES its middleware "
    "(a line ADDONS = {} after the throttle's block undoes it)"
)


class OwnMiddleware(RedisThrottleMiddleware):
    """A project's subclass: the throttle still runs."""


class AddonSpider(Spider):
    name = "addon"
    custom_settings = {"ADDONS": {Addon: 500}}  # noqa: RUF012 (Scrapy reads it so)


@pytest.mark.parametrize(
    ("settings", "spider", "why"),
    [
        ({}, None, OFF),
        ({"ADDONS": {}}, None, OFF),
        ({"ADDONS": {"scrapy_redis_throttle.Addon": 500}}, None, None),
        ({"ADDONS": {"scrapy_redis_throttle.addon.Addon": 500}}, None, None),
        ({"DOWNLOADER_MIDDLEWARES": {OwnMiddleware: 950}}, None, None),
        ({"DOWNLOADER_MIDDLEWARES": {RedisThrottleMiddleware: None}}, None, OFF),
        ({"ADDONS": {"no_such_module.Addon": 1}}, None, OFF),
        ({}, AddonSpider, None),
        (
            {"ADDONS": {Addon: 500}, "REDIS_THROTTLE_ENABLED": False},
            None,
            "REDIS_THROTTLE_ENABLED is False",
        ),
    ],
)
def test_the_tool_tells_why_the_workers_do_not_throttle(
    settings: dict[str, Any], spider: type[Spider] | None, why: str | None
) -> None:
    assert throttle_off(Settings(settings), spider) == why
