"""The Lua scripts live in the top-level lua/ folder and must ship inside the wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_installed_wheel_finds_the_lua_scripts(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "dist"), "--quiet"],
        check=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("scrapy_redis_throttle-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    scripts = sorted(path.name for path in (ROOT / "lua").glob("*.lua"))
    assert "slow_down.lua" in scripts
    assert [name for name in scripts if f"scrapy_redis_throttle/lua/{name}" not in names] == []
    assert "scrapy_redis_throttle/py.typed" in names

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", str(wheel), "--no-deps", "--target", str(target),
         "--quiet"],
        check=True,
    )  # fmt: skip
    probe = (
        "import scrapy_redis_throttle, sys\n"
        "from scrapy_redis_throttle.scripts import load_script, read_lua\n"
        "print(scrapy_redis_throttle.__file__)\n"
        "assert 'local function server_now()' in load_script('token_bucket.lua')\n"
        "sys.stdout.write(read_lua('token_bucket.lua'))\n"
    )
    # Run away from the checkout, with the installed copy first on the path.
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    location, script = result.stdout.split("\n", 1)
    assert Path(location).is_relative_to(target)
    assert script == (ROOT / "lua" / "token_bucket.lua").read_text(encoding="utf-8")
    assert not (target / "scrapy_redis_throttle" / "lua" / "token_bucket.lua").is_symlink()
