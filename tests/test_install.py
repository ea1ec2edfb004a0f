"""`edgectl install` in its dry-run mode: every file the service needs written into a
temporary root (the commands listed, none run), the profile valid, and the installed
unit checked by `systemd-analyze verify`."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from edge import install as edge_install
from edge.config.loader import load_profile
from edge.install import SERVICE_PATHS, install
from tests.conftest import REPO, edgectl


def test_a_dry_run_writes_the_service_into_a_root_and_it_verifies(tmp_path: Path) -> None:
    root = tmp_path / "root"
    res = edgectl("install", "--root", str(root), "--device-id", "box-7")
    assert res.returncode == 0, res.stderr
    assert "would run: useradd --system --user-group" in res.stdout
    assert "would run: systemctl enable edged.service" in res.stdout
    assert f"dry run into {root}" in res.stdout
    etc = root / "etc" / "edge"
    state = root / "var" / "lib" / "edged"
    assert oct(etc.stat().st_mode & 0o777) == "0o750" and oct(state.stat().st_mode & 0o777) == "0o750"
    profile_path = etc / "profile.yaml"
    assert oct(profile_path.stat().st_mode & 0o777) == "0o640"
    profile = load_profile(profile_path)
    assert profile.device_id == "box-7"
    assert {k: str(getattr(profile.paths, k)) for k in SERVICE_PATHS} == SERVICE_PATHS
    unit = root / "etc" / "systemd" / "system" / "edged.service"
    text = unit.read_text()
    assert f"ExecStart={REPO}/.venv/bin/edgectl serve --profile /etc/edge/profile.yaml" in text
    assert "/opt/edge" not in text
    link = unit.parent / "multi-user.target.wants" / "edged.service"
    assert link.is_symlink() and os.readlink(link) == "../edged.service"
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    # Again: an existing profile (perhaps edited since) is kept, never replaced.
    profile_path.write_text(profile_path.read_text().replace("box-7", "box-8"))
    again = edgectl("install", "--root", str(root))
    assert again.returncode == 0 and f"kept {profile_path}" in again.stdout
    assert load_profile(profile_path).device_id == "box-8"


def test_a_template_that_does_not_validate_leaves_no_profile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    doc = yaml.safe_load((REPO / "profiles" / "cpu-dev.yaml").read_text())
    doc["queue"] = {"max_size": 0}
    bad.write_text(yaml.safe_dump(doc))
    res = edgectl("install", "--root", str(tmp_path / "root"), "--template", str(bad))
    assert res.returncode == 1 and "does not validate" in res.stderr and "queue.max_size" in res.stderr
    assert not (tmp_path / "root" / "etc" / "edge" / "profile.yaml").exists()


def test_installing_for_real_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        install(Path("/"))


def test_a_checkout_without_its_environment_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"scripts/setup\.sh"):
        install(tmp_path / "root", prefix=tmp_path)
    assert not (tmp_path / "root").exists()  # refused before anything was written


def test_a_dry_run_never_writes_through_a_link_out_of_its_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "etc").symlink_to(outside)  # /etc inside the root leads out of it
    res = edgectl("install", "--root", str(root))
    assert res.returncode == 1 and "leads out of" in res.stderr and "Traceback" not in res.stderr
    assert list(outside.iterdir()) == []  # nothing written where the link points


def _checkout(path: Path) -> Path:
    """A checkout at `path` as install sees one: its environment's edgectl, executable."""
    edgectl_bin = path / ".venv" / "bin" / "edgectl"
    edgectl_bin.parent.mkdir(parents=True)
    edgectl_bin.write_text("#!/bin/sh\n")
    edgectl_bin.chmod(0o755)
    return path


def test_a_checkout_path_with_a_space_is_quoted_in_the_unit_and_it_verifies(tmp_path: Path) -> None:
    prefix = _checkout(tmp_path / "edge checkout")
    report = install(tmp_path / "root", prefix=prefix)
    unit = next(p for p in report.written if p.name == "edged.service")
    text = unit.read_text()
    assert f'ExecStart="{prefix}/.venv/bin/edgectl" serve --profile /etc/edge/profile.yaml' in text
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr


def test_a_checkout_path_with_a_newline_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    prefix = _checkout(tmp_path / "edge\nExecStartPre=touch pwned")
    with pytest.raises(ValueError, match="control character"):
        install(tmp_path / "root", prefix=prefix)
    assert not (tmp_path / "root").exists()


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder every user may enter, as /opt is (pytest's own temporary folders are the
    owner's alone, which the check rightly names)."""
    path = Path(tempfile.mkdtemp(prefix="edge-install-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _venv_python(prefix: Path, target: Path) -> None:
    """The checkout's environment Python, a link to `target` (as venv makes it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("")
    (prefix / ".venv" / "bin" / "python").symlink_to(target)


def test_a_checkout_the_service_cannot_see_is_named_with_its_fix(
    open_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The unit's ProtectHome hides /home, /root and /run/user: here a folder of the test's
    # stands for /home (the same check, on a path this test may write).
    home = open_tmp / "home"
    monkeypatch.setattr("edge.install.PROTECTED", (str(home),))
    prefix = _checkout(home / "ana" / "edge")
    _venv_python(prefix, open_tmp / "usr" / "bin" / "python3")
    report = install(open_tmp / "root", prefix=prefix)
    assert len(report.unreadable) == 1
    assert f"the checkout {prefix} is under {home}" in report.unreadable[0]
    assert "clone it into /opt/edge" in report.unreadable[0]


def test_an_environment_made_with_a_python_under_home_is_named(open_tmp: Path) -> None:
    prefix = _checkout(open_tmp / "opt" / "edge")
    pyenv = open_tmp / "root" / ".pyenv" / "versions" / "3.11.7" / "bin" / "python3.11"
    _venv_python(prefix, pyenv)
    problems = edge_install.service_cannot_read(prefix, None, protected=(str(open_tmp / "root"),))
    assert problems and f"the environment's Python is {pyenv}" in problems[0]
    assert "PYTHON=/usr/bin/python3 scripts/setup.sh" in problems[0]


def test_a_folder_others_cannot_enter_is_named(open_tmp: Path) -> None:
    prefix = _checkout(open_tmp / "opt" / "edge")
    _venv_python(prefix, open_tmp / "usr" / "bin" / "python3")
    (open_tmp / "opt").chmod(0o700)
    try:
        problems = edge_install.service_cannot_read(prefix, None, protected=())
    finally:
        (open_tmp / "opt").chmod(0o755)
    assert problems == [
        f"{open_tmp / 'opt'} cannot be entered by other users (mode 700), so the service's user cannot reach "
        f"{prefix / '.venv' / 'bin' / 'edgectl'}: chmod o+x {open_tmp / 'opt'}"
    ]


def test_a_profile_path_the_service_cannot_see_is_named(open_tmp: Path) -> None:
    prefix = _checkout(open_tmp / "opt" / "edge")
    _venv_python(prefix, open_tmp / "usr" / "bin" / "python3")
    profile = open_tmp / "profile.yaml"
    profile.write_text("models:\n  qa:\n    engine: /home/ana/models/clinic-g32\n")
    problems = edge_install.service_cannot_read(prefix, profile, protected=("/home",))
    assert problems == [
        "the profile's models.qa.engine is /home/ana/models/clinic-g32, under /home, which the service cannot see: "
        "move it under /var/lib/edged (or /opt/edge) and set models.qa.engine to the new place"
    ]
    assert edge_install.service_cannot_read(prefix, None, protected=("/home",)) == []
