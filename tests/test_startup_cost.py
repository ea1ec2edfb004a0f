"""What a start costs before any model loads: `edgectl status` (run by monitoring every
few seconds) imports no profile schema and no torch, and setup's byte-code step writes the
cache that every later start reads, even where the environment says not to write one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_edgectl_status_imports_neither_the_profile_schema_nor_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from edge import cli\n"
        f"code = cli.main(['status', '--socket', {str(tmp_path / 'none.sock')!r}, '--json'])\n"
        "heavy = sorted(m for m in ('pydantic', 'torch', 'yaml', 'edge.config.profile') if m in sys.modules)\n"
        "print(code, heavy)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "3 []", res.stdout


def test_setup_writes_byte_code_where_the_environment_says_not_to(tmp_path: Path) -> None:
    package = tmp_path / "pkgx"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "mod.py").write_text("VALUE = 1\n")
    (tmp_path / "lazyx.py").write_text("import json\n")
    (package / "__main__.py").write_text("raise SystemExit('a command, never imported')\n")
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from scripts.bytecode import write\n"
        "print(write(('pkgx',), ('lazyx', 'not_on_this_box')), sys.dont_write_bytecode)\n"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    # pkgx, pkgx.inner, pkgx.inner.mod and lazyx; the absent one skipped; the flag restored.
    assert res.stdout.split() == ["(4,", "1)", "True"], res.stdout
    cached = {p.name.split(".")[0] for p in tmp_path.rglob("__pycache__/*.pyc")}
    assert cached == {"__init__", "mod", "lazyx"}, cached
