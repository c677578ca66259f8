"""What is logged once (:class:`.Once`): each key of a kind once, and a bounded number of keys
of each kind."""

from __future__ import annotations

from scrapy_redis_throttle.rejections import LOGGED_DOMAINS, Once


def test_each_key_of_a_kind_is_logged_once() -> None:
    once = Once()
    assert once.first("retry_after", "a.example")
    assert not once.first("retry_after", "a.example")
    assert once.done("retry_after", "a.example")
    assert once.first("retry_after", "b.example"), "another domain"
    assert once.first("crawl_delay", "a.example"), "another kind"
    assert once.first("unparkable")
    assert not once.first("unparkable")


def test_a_kind_logs_at_most_so_many_keys() -> None:
    once = Once()
    assert all(once.first("retry_after", f"{n}.example") for n in range(LOGGED_DOMAINS))
    assert once.full("retry_after")
    assert not once.first("retry_after", "one-more.example")
    assert once.done("retry_after", "one-more.example")
    assert not once.full("crawl_delay")
    assert once.first("crawl_delay", "one-more.example"), "kinds are bounded apart"
