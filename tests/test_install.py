"""`edgectl install` in its dry-run mode: every file the service needs written into a
temporary root (the commands listed, none run), the profile valid, and the installed
unit checked by `systemd-analyze verify`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

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
