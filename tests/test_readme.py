"""README's Quick start, followed literally: ``scrapy startproject``, the settings block in
place of the template's ``ADDONS = {}`` (its ``DOWNLOAD_DELAY = 1``,
``CONCURRENT_REQUESTS_PER_DOMAIN = 1`` and ``ROBOTSTXT_OBEY = True`` stay), the spider as
written, the start URLs seeded and the workers started with README's command, against the
local site.

Only what points outside is changed: the example domains become the site's hosts (a port in the
seeded URLs), ``REDIS_URL`` the test's Redis (given with ``-s``, as on another machine), and
each worker stops once the frontier has been empty for a few seconds
(``MAX_IDLE_TIME_BEFORE_CLOSE``: a RedisSpider otherwise waits for more start URLs forever).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from demo_site import HOSTS, DemoSite
from fleet_runs import Domain, fetched, refusals, refused
from local_redis import RedisServer
from processes import tool
from redis_topologies import UNUSED_URL
from support import achieved_rate

README = Path(__file__).resolve().parent.parent / "README.md"
SHOP, BLOG = Domain(HOSTS[0], 5.0, 1), Domain(HOSTS[1], 2.0, 3)
NAMES = {"shop.example": SHOP, "blog.example": BLOG}
PAGES = {SHOP.host: 25, BLOG.host: 5}
# Measured: 1.00 of each budget with 2 and 3 workers; 0.72-0.78 of the shop's while a worker's
# requests back from the parking area missed their moments waiting for its robots.txt (see
# Handoff.lend).
UTILISATION = 0.95
IDLE_CLOSE = 1


def missed(logs: list[str], host: str) -> int:
    """The moments the workers were too busy to use for *host* (each asked anew, its turn
    lost for politeness: see waiting.MISSED_AFTER), from their DEBUG lines."""
    return sum(log.count(f"missed its moment for '{host}'") for log in logs)


# README's start command: each worker's crawl, then what its log says if it could not start.
START_COMMAND = re.compile(
    r"for n in 1 2 3; do \((scrapy crawl shop [^;]*); (grep -m 1 [^)]* worker-\$n\.log)\) & done"
)


def readme_block(first_line: str) -> str:
    """The fenced block of README.md whose first line starts with *first_line*."""
    blocks = re.findall(r"^```\w*\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    [block] = [block for block in blocks if block.startswith(first_line)]
    return str(block)


def start_project(tmp_path: Path, above: bool = False) -> Path:
    """README's project: ``scrapy startproject shop``, README's settings block in place of
    the template's ``ADDONS = {}`` (or pasted *above* it)."""
    subprocess.run(
        [sys.executable, "-m", "scrapy", "startproject", "shop"], cwd=tmp_path, check=True
    )
    project = tmp_path / "shop"
    settings = project / "shop" / "settings.py"
    template = settings.read_text(encoding="utf-8")
    assert template.count("\nADDONS = {}\n") == 1, "the template's line, to replace"
    block = readme_block("# shop/settings.py") + ("\nADDONS = {}\n" if above else "\n")
    settings.write_text(template.replace("\nADDONS = {}\n", "\n" + block), encoding="utf-8")
    return project


@pytest.mark.parametrize("above", [False, True])
def test_the_tool_says_when_the_project_s_workers_would_not_throttle(
    redis_server: RedisServer, tmp_path: Path, above: bool
) -> None:
    """README's block pasted above the template's ``ADDONS = {}``: the throttle is off, and
    the first check README names says why."""
    project = start_project(tmp_path, above)
    done = tool("--redis-url", redis_server.url, "status", cwd=project)
    assert done.returncode == 0, done.stderr
    said = (
        "scrapy-redis-throttle: this project's workers do not run the throttle: neither ADDONS "
        "has scrapy_redis_throttle.Addon nor DOWNLOADER_MIDDLEWARES its middleware (a line "
        "ADDONS = {} after the throttle's block undoes it)\n"
    )
    assert (said in done.stderr) is above, done.stderr


@pytest.mark.parametrize(
    ("line", "printed"),
    [
        (
            'REDIS_THROTTLE_RATE = "5/s"',
            "ERROR: Redis throttle: the worker stops: REDIS_THROTTLE_RATE is no setting of "
            "scrapy-redis-throttle: did you mean REDIS_THROTTLE_RATES?",
        ),
        (
            f'REDIS_URL = "{UNUSED_URL}"',
            "ERROR: Redis throttle: the worker stops: scrapy_redis.scheduler.Scheduler cannot "
            f"reach its Redis at {UNUSED_URL} (REDIS_URL): ConnectionError",
        ),
        (
            'REDIS_URL = "redis//localhost:6379/0"',  # read by scrapy-redis's spider, first
            "ValueError: Redis URL must specify one of the following schemes",
        ),
    ],
    ids=["unknown-setting", "redis-down", "malformed-redis-url"],
)
def test_a_worker_that_cannot_start_prints_why_with_the_readme_s_command(
    tmp_path: Path, line: str, printed: str
) -> None:
    """README's start command as written, one worker, run by a shell: the one line it prints."""
    project = start_project(tmp_path)
    settings = project / "shop" / "settings.py"
    settings.write_text(settings.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")
    (project / "shop" / "spiders" / "shop.py").write_text(
        readme_block("# shop/spiders/shop.py"), encoding="utf-8"
    )
    command = readme_block("redis-cli lpush shop:start_urls").splitlines()[1]
    assert START_COMMAND.fullmatch(command), command
    done = subprocess.run(
        ["bash", "-c", command.replace("1 2 3", "1") + "; wait"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    [shown] = done.stdout.splitlines()
    assert printed in shown, done.stdout
    assert done.stderr == "", done.stderr


@pytest.mark.parametrize("workers", [2, 3])
def test_the_readme_s_quick_start_crawls_politely_and_uses_the_budget(
    redis_server: RedisServer, tmp_path: Path, workers: int
) -> None:
    project = start_project(tmp_path)
    settings = project / "shop" / "settings.py"
    applied = settings.read_text(encoding="utf-8")
    for line in (
        "DOWNLOAD_DELAY = 1",
        "CONCURRENT_REQUESTS_PER_DOMAIN = 1",
        "ROBOTSTXT_OBEY = True",
    ):
        assert f"\n{line}\n" in applied, f"the template's {line} stays"
    spider = readme_block("# shop/spiders/shop.py")
    seed = readme_block("redis-cli lpush shop:start_urls").splitlines()
    for name, domain in NAMES.items():
        spider = spider.replace(f'"{name}"', f'"{domain.host}"')
    (project / "shop" / "spiders" / "shop.py").write_text(spider, encoding="utf-8")
    start_urls = [json.loads(seed_request)["url"] for seed_request in shlex.split(seed[0])[3:]]
    # Each worker's command, which prints the end of its log if it fails.
    command = START_COMMAND.fullmatch(seed[1])
    assert command, seed[1]

    overload = {domain.host: domain.overload() for domain in NAMES.values()}
    with DemoSite(HOSTS, pages=PAGES, overload=overload) as site:
        with redis.Redis.from_url(redis_server.url) as client:
            client.lpush(
                "shop:start_urls",
                *(
                    url.replace(f"https://{name}/", site.url(domain.host, "/"))
                    for url in start_urls
                    for name, domain in NAMES.items()
                    if name in url
                ),
            )
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    *command[1].replace("$n", str(n)).split(),
                    "-s",
                    f"REDIS_URL={redis_server.url}",
                    "-s",
                    f"MAX_IDLE_TIME_BEFORE_CLOSE={IDLE_CLOSE}",
                ],
                cwd=project,
            )
            for n in range(1, workers + 1)
        ]
        try:
            for process in processes:
                assert process.wait(timeout=60) == 0
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        arrivals = site.arrivals()
    logs = [(project / f"worker-{n}.log").read_text() for n in range(1, workers + 1)]

    for log in logs:
        assert "Traceback" not in log, log[-3000:]
        assert "through the download slot 'redis_throttle'" in log, (
            "the add-on lifts the template's"
        )
    assert refused(arrivals) == 0, refusals(arrivals)
    for domain in NAMES.values():
        mine = [a for a in arrivals if a.host == domain.host]
        pages = fetched(mine)
        assert len([p for p in pages if p.startswith("/page/")]) == PAGES[domain.host]
        assert [p for p, n in pages.items() if n > 1] == [], "each page once, fleet-wide"
        times = sorted(a.time for a in mine)
        utilisation = achieved_rate(times, domain.burst, missed(logs, domain.host)) / domain.rate
        print(
            f"{workers} workers, {domain.host} at {domain.rate:g}/s: utilisation {utilisation:.3f}"
        )
        # The blog's few pages are found one after the other at first (/, then /page/0).
        least = UTILISATION if domain is SHOP else 0.9
        assert utilisation >= least, f"{domain.host}: {utilisation:.2f} of its budget"
