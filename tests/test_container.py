"""The Jetson container (docker/jetson/): its Dockerfile passes hadolint, and it stays in
step with the box's setup and the unit. It cannot be built here (the L4T base image and
JetPack's torch are arm64 and NVIDIA's): what is checked is what can be read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from edge.install import SERVICE_PATHS

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "jetson" / "Dockerfile"
COMPOSE = REPO / "docker" / "jetson" / "compose.yaml"
UNIT = REPO / "systemd" / "edged.service"

# Each hardening or run line of the unit, and what carries it in compose.yaml.
UNIT_TO_COMPOSE = {
    "NoNewPrivileges=yes": lambda s: "no-new-privileges:true" in s["security_opt"],
    "ProtectSystem=strict": lambda s: s["read_only"] is True,
    "PrivateTmp=yes": lambda s: "/tmp" in s["tmpfs"],
    "CapabilityBoundingSet=": lambda s: s["cap_drop"] == ["ALL"],
    "LimitNOFILE=16384": lambda s: s["ulimits"]["nofile"] == 16384,
    "Restart=on-failure": lambda s: s["restart"] == "on-failure",
    "TimeoutStopSec=45": lambda s: s["stop_grace_period"] == "45s",
    "StateDirectory=edged": lambda s: any(v.endswith(":/var/lib/edged") for v in s["volumes"]),
    "RuntimeDirectory=edged": lambda s: any(t.startswith("/run/edged:") for t in s["tmpfs"]),
    "SupplementaryGroups=video render": lambda s: "video" in s["group_add"],
}


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_hardening_line_of_the_unit_is_carried_into_compose() -> None:
    unit = UNIT.read_text(encoding="utf-8").splitlines()
    service = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]["edged"]
    for line, carried in UNIT_TO_COMPOSE.items():
        assert line in unit, f"the unit no longer says {line!r}: update compose.yaml and this table"
        assert carried(service), f"compose.yaml does not carry {line}"
    # The runtime directory belongs to the image's service user.
    uid = re.search(r"ARG EDGE_UID=(\d+)", DOCKERFILE.read_text(encoding="utf-8"))
    assert uid and service["user"] == f"{uid.group(1)}:{uid.group(1)}"
    assert f"/run/edged:mode=0750,uid={uid.group(1)}" in service["tmpfs"]


def test_the_image_sets_up_as_the_box_does_and_runs_what_the_unit_runs() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    unit = UNIT.read_text(encoding="utf-8")
    assert "EDGE_IMAGE_BUILD=1 ./scripts/setup.sh" in text  # the same steps, not a copy of them
    # The unit's environment, as the image's.
    for var in re.findall(r"^Environment=(\w+)=(\S+)$", unit, re.M):
        assert f"{var[0]}={var[1]}" in text, var
    command = re.search(r"^ExecStart=/opt/edge/(.+)$", unit, re.M)
    assert command and f"exec /opt/edge/{command.group(1)}" in text
    assert "umask 0027" in text and "UMask=0027" in unit
    # The profile is the service's: written by the function edgectl install uses.
    assert "write_service_profile(Path('/etc/edge/profile.yaml'), Path('profiles/jetson-orin.yaml'))" in text
    assert SERVICE_PATHS["state_dir"] == "/var/lib/edged"


def test_setup_in_image_mode_needs_a_cuda_build_of_torch_not_a_visible_gpu() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text(encoding="utf-8")
    assert "scripts/jetson_check.py ${EDGE_IMAGE_BUILD:+--image}" in setup
