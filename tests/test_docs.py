"""The reference pages of docs/ list what the package reads and counts, no more and no less.

* Settings: every string constant of scrapy_redis_throttle/ that is a whole ``REDIS_THROTTLE_*``
  name, against every ``.. setting:: NAME`` of docs/reference/settings.rst.
* Request meta keys: every string constant that is a whole ``redis_throttle_*`` name or
  ``dont_redis_throttle`` (but the spider attribute ``redis_throttle_rates``, documented with
  the settings), against every ``.. reqmeta:: name`` of docs/reference/meta.rst.
* Stats: every f-string that starts with ``{STATS_PREFIX}/`` (the module's own STATS_PREFIX, or
  stats.py's), a part computed at run time written ``<...>``, against every ````redis_throttle/...````
  entry of docs/reference/stats.rst.

Constants are read with ``ast``, so that comments do not count; docstrings do not either, as no
docstring is a whole setting name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from scrapy_redis_throttle.setting_names import SETTING_NAMES

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scrapy_redis_throttle"
REFERENCE = ROOT / "docs" / "reference"

SETTING = re.compile(r"REDIS_THROTTLE_[A-Z0-9_]+")
META_KEY = re.compile(r"redis_throttle_[a-z_]+|dont_redis_throttle")
SPIDER_ATTRIBUTE = "redis_throttle_rates"
# A part of a stat's name computed at run time: <Error>, <status>, <kind> in the docs.
PLACEHOLDER = re.compile(r"<[^<>/]*>")
ANY = "<>"


def _modules() -> dict[Path, ast.Module]:
    return {
        path: ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _string_constants() -> set[str]:
    return {
        node.value
        for tree in _modules().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def _documented(page: str, directive: str) -> set[str]:
    text = (REFERENCE / page).read_text(encoding="utf-8")
    return set(re.findall(rf"^\.\. {directive}:: *(\S+) *$", text, flags=re.MULTILINE))


def _differences(what: str, in_code: set[str], in_docs: set[str], page: str) -> list[str]:
    problems = []
    if in_code - in_docs:
        problems.append(
            f"{what} the package uses but docs/reference/{page} does not document: "
            f"{sorted(in_code - in_docs)}"
        )
    if in_docs - in_code:
        problems.append(
            f"{what} docs/reference/{page} documents but the package does not use: "
            f"{sorted(in_docs - in_code)}"
        )
    return problems


def test_every_setting_is_documented_and_every_documented_setting_exists() -> None:
    in_code = {text for text in _string_constants() if SETTING.fullmatch(text)}
    in_docs = _documented("settings.rst", "setting")
    assert len(in_code) > 20, f"found too few settings in the package: {sorted(in_code)}"
    problems = _differences("settings", in_code, in_docs, "settings.rst")
    assert not problems, "\n".join(problems)
    # The names a project may set: another one is refused at start-up.
    assert set(SETTING_NAMES) == in_code, sorted(set(SETTING_NAMES) ^ in_code)


def test_every_meta_key_is_documented_and_every_documented_key_exists() -> None:
    in_code = {text for text in _string_constants() if META_KEY.fullmatch(text)}
    in_code.discard(SPIDER_ATTRIBUTE)
    in_docs = _documented("meta.rst", "reqmeta")
    assert "dont_redis_throttle" in in_code, f"found no meta key in the package: {in_code}"
    problems = _differences("meta keys", in_code, in_docs, "meta.rst")
    assert not problems, "\n".join(problems)


def _stats_prefix(tree: ast.Module, default: str) -> str:
    """The module's own ``STATS_PREFIX = "..."``, else *default* (stats.py's, imported)."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(
                isinstance(target, ast.Name) and target.id == "STATS_PREFIX"
                for target in node.targets
            )
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    return default


def _is_stats_prefix(node: ast.expr) -> bool:
    if isinstance(node, ast.FormattedValue):
        node = node.value
    return (isinstance(node, ast.Name) and node.id == "STATS_PREFIX") or (
        isinstance(node, ast.Attribute) and node.attr == "STATS_PREFIX"
    )


def _stats_in_code() -> set[str]:
    """Stat names as the package builds them, ``<>`` for each part computed at run time."""
    modules = _modules()
    default = _stats_prefix(modules[PACKAGE / "stats.py"], "")
    assert default, "stats.py has no STATS_PREFIX"
    stats = set()
    for tree in modules.values():
        prefix = _stats_prefix(tree, default)
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.JoinedStr) and node.values and _is_stats_prefix(node.values[0])
            ):
                continue
            rest = "".join(
                part.value
                if isinstance(part, ast.Constant) and isinstance(part.value, str)
                else ANY
                for part in node.values[1:]
            )
            if rest.startswith("/"):
                stats.add(prefix + rest)
    return stats


def _template(name: str) -> re.Pattern[str]:
    return re.compile(
        "/".join(
            f"(?P<part{n}>[^/]+)" if part == ANY else re.escape(part)
            for n, part in enumerate(name.split("/"))
        )
    )


def test_every_stat_is_documented_and_every_documented_stat_exists() -> None:
    """A name the package builds whole (``redis_throttle/parked``) must be documented as it is;
    one with a part computed at run time (``redis_throttle/redis_errors/<>``) must be documented
    so, or as its instances (``redis_throttle/rejected/<>`` as ``redis_throttle/rejected/retry_after``
    and the others). A documented name must be one the package builds, or fit one with a part
    computed at run time that is a string constant of the package (``retry_after`` passed to the
    helper that counts the rejections, ``bad_messages`` to the one that counts once and logs)."""
    in_code = _stats_in_code()
    text = (REFERENCE / "stats.rst").read_text(encoding="utf-8")
    in_docs = {
        PLACEHOLDER.sub(ANY, name)
        for name in re.findall(r"^``(redis_throttle/[^`\s]+)``$", text, flags=re.MULTILINE)
    }
    assert len(in_code) > 30, f"found too few stats in the package: {sorted(in_code)}"
    constants = _string_constants()
    templates = {name: _template(name) for name in in_code if ANY in name}
    # A template with nothing fixed after the prefix (redis_throttle/<>, the helpers' own
    # f-strings) names no stat by itself.
    whole = {name for name in templates if name.count("/") == 1 and name.endswith(ANY)}

    undocumented = {
        name
        for name in in_code - whole
        if name not in in_docs
        and not (name in templates and any(templates[name].fullmatch(doc) for doc in in_docs))
    }

    def built(doc: str) -> bool:
        if doc in in_code:
            return True
        for pattern in templates.values():
            match = pattern.fullmatch(doc)
            if match and all(part in constants for part in match.groupdict().values()):
                return True
        return False

    unknown = {doc for doc in in_docs if not built(doc)}
    problems = []
    if undocumented:
        problems.append(
            f"stats the package counts but docs/reference/stats.rst does not document: "
            f"{sorted(undocumented)}"
        )
    if unknown:
        problems.append(
            f"stats docs/reference/stats.rst documents but the package does not count: "
            f"{sorted(unknown)}"
        )
    assert not problems, "\n".join(problems)
