"""Scrapy's and scrapy-redis's own scheduler tests, unedited, with parking's methods bound on
their schedulers: ``tox -e peers``.

It fetches the released sdists of the installed Scrapy and scrapy-redis from the package index,
starts a redis-server of its own on a free port (scrapy-redis's tests clear their keys in it),
runs each peer's scheduler test modules twice (with its classes, then with parking bound on
them by the ``bind_ours`` plugin) and fails when a test that passes with theirs does not pass
with ours, or when ours were never made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ElementTree
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent / "example_project"))

from local_redis import RedisServer  # noqa: E402

# Each peer's distribution and its test modules that run a scheduler.
PEERS = {
    "scrapy": ["tests/test_scheduler.py", "tests/test_scheduler_base.py",
               "tests/test_engine_close_spider.py"],
    "scrapy-redis": ["tests/test_scrapy_redis.py"],
}  # fmt: skip


def fetch(name: str, into: Path) -> Path:
    """The released sdist of the installed *name*, unpacked into *into*."""
    release = f"{name}=={version(name)}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
         ":all:", "--dest", str(into), release],
        check=True,
    )  # fmt: skip
    [sdist] = into.glob(f"{name.replace('-', '_')}-*.tar.gz") or into.glob(f"{name}-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    [unpacked] = (path for path in into.iterdir() if path.is_dir())
    return unpacked


def outcomes(junit: Path) -> dict[str, str]:
    """Each test's outcome in a JUnit XML report: passed, failed, error or skipped."""
    results = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        results[test] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return results


def run_tests(
    source: Path, modules: list[str], env: dict[str, str], ours: bool
) -> tuple[dict[str, str], int]:
    """Each test's outcome, and how many schedulers of ours the tests made."""
    junit, report = source / f"{ours}.xml", source / "made.json"
    plugin = ["-p", "bind_ours"] if ours else []
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
         f"--junitxml={junit}", *modules],
        cwd=source, env={**env, "BIND_OURS_REPORT": str(report)}, check=False,
    )  # fmt: skip
    made = sum(json.loads(report.read_text()).values()) if ours else 0
    return outcomes(junit), made


def main() -> int:
    failed = False
    with tempfile.TemporaryDirectory(prefix="peers-") as work, RedisServer() as redis_server:
        port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "REDIS_HOST": "127.0.0.1",
            "REDIS_PORT": port,
        }
        summary = []
        for name, modules in PEERS.items():
            source = fetch(name, Path(work) / name)
            # (test_engine_close_spider.py came with Scrapy 2.15.)
            modules = [module for module in modules if (source / module).exists()]
            theirs, _ = run_tests(source, modules, env, ours=False)
            ours, made = run_tests(source, modules, env, ours=True)
            lost = sorted(t for t, o in theirs.items() if o == "passed" and ours.get(t) != "passed")
            passed = sum(o == "passed" for o in theirs.values())
            summary.append(
                f"{name} {version(name)}, {' '.join(modules)}: {len(theirs)} tests; {passed} pass "
                f"with theirs, "
                f"{sum(o == 'passed' for o in ours.values())} with ours; "
                f"{len(lost)} pass with theirs only; {made} schedulers of ours made"
            )
            for test in lost:
                summary.append(f"  passes with theirs only: {test} ({ours.get(test, 'not run')})")
            failed = failed or bool(lost) or not made
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
