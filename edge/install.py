"""`edgectl install`: the daemon as a system service on this box.

Steps, each said as it runs:
1. the system user and group `edge` (useradd), in the video and render groups where the
   box has them (the GPU's device nodes);
2. /etc/edge (0750, root:edge) and the state directory /var/lib/edged (0750, edge:edge;
   systemd's StateDirectory would make it too, but the profile written next names it);
3. /etc/edge/profile.yaml from a shipped profile (jetson-orin.yaml on a Jetson, else
   cpu-dev.yaml) with the service's paths put in; an existing profile is never replaced;
4. /etc/systemd/system/edged.service from systemd/edged.service, with the checkout's
   own path in place of /opt/edge;
5. `systemctl daemon-reload` and `systemctl enable edged`.

`root` other than "/" writes every file under that directory instead and runs no
command (a dry run: the commands are listed, and `enable`'s symlink is made in the tree
as systemctl would make it), which is how it is tested.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import yaml

from edge.config.loader import ProfileError, load_profile

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
UNIT_SOURCE = REPO / "systemd" / "edged.service"
SHIPPED_PREFIX = "/opt/edge"
USER = "edge"
SERVICE_PATHS = {
    "state_dir": "/var/lib/edged",
    "runtime_dir": "/run/edged",
    "engine_dir": "/var/lib/edged/engines",
    "media_dir": "/var/lib/edged/media",
}


# What the unit's ProtectHome=yes hides from the service: a checkout, an environment's
# Python or a model under these cannot be read once it runs as a service.
PROTECTED = ("/home", "/root", "/run/user")


@dataclass
class InstallReport:
    root: Path
    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)  # run, or (a dry run) listed
    # Why the service could not start from this checkout (a dry run says it; a real
    # install refuses before it writes anything).
    unreadable: list[str] = field(default_factory=list)

    @property
    def dry_run(self) -> bool:
        return self.root != Path("/")


def default_template() -> Path:
    jetson = Path("/etc/nv_tegra_release").exists()
    return REPO / "profiles" / ("jetson-orin.yaml" if jetson else "cpu-dev.yaml")


def _under(root: Path, path: str) -> Path:
    """`path` inside `root`. In a dry run everything is written under root: a link in the
    tree that leads out of it is refused, not followed."""
    target = root / path.lstrip("/")
    if root != Path("/"):
        inside = root.resolve()
        if not target.resolve().is_relative_to(inside):
            raise RuntimeError(f"{target} leads out of {root} (through a link): nothing is written outside it")
    return target


def unit_path(path: Path) -> str:
    """`path` as one word of a unit file's command line: quoted where it has a space or a
    quote, refused where systemd could not take it (a newline or another control
    character would end the line or start another directive)."""
    text = str(path)
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise ValueError(f"{text!r} has a control character: a unit file cannot name it")
    if any(c in text for c in " \t\"'\\$%;"):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
        return f'"{escaped}"'
    return text


def _hidden(path: Path, protected: tuple[str, ...]) -> str | None:
    for top in protected:
        if path == Path(top) or path.is_relative_to(top):
            return top
    return None


def _others_can(path: Path, bits: int) -> bool:
    """Whether a user that is neither the owner nor in the group (the service's `edge`
    user, before install makes it) has `bits` (stat's S_IXOTH and S_IROTH) on `path`."""
    try:
        return bool(os.stat(path).st_mode & bits)
    except OSError:
        return False


def service_cannot_read(prefix: Path, profile: Path | None, protected: tuple[str, ...] | None = None) -> list[str]:
    """What in this checkout (and the profile the service will read) the service, as
    the unit runs it, could not reach: each with how to fix it."""
    protected = PROTECTED if protected is None else protected
    problems = []
    where = _hidden(prefix.resolve(), protected)
    if where:
        problems.append(
            f"the checkout {prefix} is under {where}, which the service cannot see (ProtectHome=yes in the unit): "
            "clone it into /opt/edge (sudo git clone <repository> /opt/edge), run scripts/setup.sh there and install "
            "from there"
        )
    python = (prefix / ".venv" / "bin" / "python").resolve()
    where = _hidden(python, protected)
    if where and not problems:
        problems.append(
            f"the environment's Python is {python}, under {where}, which the service cannot see: make the environment "
            "with the system's Python (rm -rf .venv; PYTHON=/usr/bin/python3 scripts/setup.sh)"
        )
    edgectl = prefix / ".venv" / "bin" / "edgectl"
    for part in [*reversed(edgectl.parent.resolve().parents), edgectl.parent.resolve()]:
        if not _others_can(part, stat.S_IXOTH):
            problems.append(
                f"{part} cannot be entered by other users (mode {stat.S_IMODE(os.stat(part).st_mode):o}), so the "
                f"service's user cannot reach {edgectl}: chmod o+x {part}"
            )
            break
    else:
        if not (_others_can(edgectl, stat.S_IROTH) and _others_can(edgectl, stat.S_IXOTH)):
            problems.append(f"{edgectl} is not readable and executable by other users: chmod o+rx {edgectl}")
    if profile is not None and profile.exists():
        for name, value in _profile_paths(profile):
            where = _hidden(Path(value), protected)
            if where:
                problems.append(
                    f"the profile's {name} is {value}, under {where}, which the service cannot see: move it under "
                    f"{SERVICE_PATHS['state_dir']} (or /opt/edge) and set {name} to the new place"
                )
    return problems


def _profile_paths(profile: Path) -> list[tuple[str, str]]:
    """Every absolute path a profile names (dotted field, value)."""
    found: list[tuple[str, str]] = []

    def walk(value: object, name: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{name}.{key}" if name else str(key))
        elif isinstance(value, list):
            for i, inner in enumerate(value):
                walk(inner, f"{name}[{i}]")
        elif isinstance(value, str) and value.startswith("/"):
            found.append((name, value))

    walk(yaml.safe_load(profile.read_text(encoding="utf-8")), "")
    return found


def _run(report: InstallReport, cmd: list[str]) -> None:
    report.commands.append(cmd)
    print(("would run: " if report.dry_run else "running: ") + " ".join(cmd))
    if not report.dry_run:
        subprocess.run(cmd, check=True)


def _user(report: InstallReport) -> None:
    try:
        pwd.getpwnam(USER)
        exists = True
    except KeyError:
        exists = False
    if not exists or report.dry_run:
        _run(report, ["useradd", "--system", "--user-group", "--home-dir", SERVICE_PATHS["state_dir"],
                      "--shell", "/usr/sbin/nologin", USER])  # fmt: skip
    groups = []
    for name in ("video", "render"):
        try:
            grp.getgrnam(name)
            groups.append(name)
        except KeyError:
            continue
    if groups:
        _run(report, ["usermod", "--append", "--groups", ",".join(groups), USER])


def _directory(report: InstallReport, path: Path, mode: int, group_only: bool) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    if not report.dry_run:
        shutil.chown(path, "root" if group_only else USER, USER)
    print(f"directory {path} ({mode:o})")


def write_service_profile(target: Path, template: Path, device_id: str | None = None) -> None:
    """`template` with the service's paths (and `device_id`) at `target`, checked as the
    daemon will read it: a profile that does not validate is not left there. What
    `install` writes, and what the container image carries (docker/jetson/Dockerfile)."""
    doc = yaml.safe_load(template.read_text(encoding="utf-8"))
    doc["paths"] = dict(SERVICE_PATHS)
    if device_id is not None:
        doc["device_id"] = device_id
    header = (
        f"# Written by `edgectl install` from {template.name}; every field is described in\n"
        "# edge/config/profile.py and its sections. `systemctl reload edged` applies the run-time fields.\n"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(header + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    os.chmod(target, 0o640)
    try:
        load_profile(target)  # what the daemon will read: refuse to leave a bad one
    except ProfileError as err:
        target.unlink()
        raise RuntimeError(f"the profile made from {template} does not validate: {err}") from err


def _profile(report: InstallReport, template: Path, device_id: str | None) -> None:
    target = _under(report.root, "/etc/edge/profile.yaml")
    if target.exists():
        report.kept.append(target)
        print(f"kept {target} (an existing profile is never replaced)")
        return
    write_service_profile(target, template, device_id)
    if not report.dry_run:
        shutil.chown(target, "root", USER)
    report.written.append(target)
    print(f"wrote {target}")


def _unit(report: InstallReport, prefix: Path) -> None:
    source = UNIT_SOURCE.read_text(encoding="utf-8")
    # The command line's word quoted as systemd reads it; the documentation URL as a URL.
    executable = f"{SHIPPED_PREFIX}/.venv/bin/edgectl"
    text = source.replace(executable, unit_path(prefix / ".venv" / "bin" / "edgectl"))
    # A unit file reads % as a specifier: the URL's escapes are written %%.
    text = text.replace(f"file://{SHIPPED_PREFIX}/", f"file://{quote(str(prefix)).replace('%', '%%')}/")
    if SHIPPED_PREFIX in text:
        raise RuntimeError(f"{UNIT_SOURCE} names {SHIPPED_PREFIX} where install does not expect it")
    target = _under(report.root, "/etc/systemd/system/edged.service")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    os.chmod(target, 0o644)
    report.written.append(target)
    print(f"wrote {target}")
    _run(report, ["systemctl", "daemon-reload"])
    _run(report, ["systemctl", "enable", "edged.service"])
    if report.dry_run:  # what `enable` makes, from the unit's [Install] WantedBy
        wants = _under(report.root, "/etc/systemd/system/multi-user.target.wants")
        wants.mkdir(parents=True, exist_ok=True)
        link = wants / "edged.service"
        if not link.is_symlink():
            link.symlink_to("../edged.service")


def install(
    root: Path = Path("/"), template: Path | None = None, prefix: Path = REPO, device_id: str | None = None
) -> InstallReport:
    """Install the service (a dry run into `root` where it is not "/")."""
    report = InstallReport(root)
    if not report.dry_run and os.geteuid() != 0:
        raise PermissionError("installing the service needs root (or --root DIR for a dry run)")
    unit_path(prefix)  # a checkout a unit file cannot name is refused before anything is written
    if not (prefix / ".venv" / "bin" / "edgectl").exists():
        raise FileNotFoundError(f"{prefix}/.venv/bin/edgectl is missing: run scripts/setup.sh in {prefix} first")
    existing = _under(root, "/etc/edge/profile.yaml")
    report.unreadable = service_cannot_read(prefix, existing if existing.exists() else template or default_template())
    for problem in report.unreadable:
        print(("the service could not start: " if report.dry_run else "refused: ") + problem)
    if report.unreadable and not report.dry_run:
        raise PermissionError("; ".join(report.unreadable))
    _user(report)
    _directory(report, _under(root, "/etc/edge"), 0o750, group_only=True)
    _directory(report, _under(root, SERVICE_PATHS["state_dir"]), 0o750, group_only=False)
    _profile(report, template or default_template(), device_id)
    _unit(report, prefix)
    return report
