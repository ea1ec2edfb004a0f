"""The kernel's sensor files under sysfs, read as the sensors module and the Jetson's
(`tegra`) read them. A file that is absent, unreadable (debugfs is root's) or not what it
should be reads as nothing, never an error: that sensor is left out of that scrape.

- Thermal zones: class/thermal/thermal_zone*/{type,temp} (temp in millidegrees).
- INA3221 power monitors through hwmon (the kernel's hwmon/ina3221 documentation):
  in[123]_label, in[123]_input (bus voltage, mV), curr[123]_input (mA); a channel's
  power is their product. in7 ("sum of shunt voltage") has no curr7_input and reads as
  nothing; channels a board leaves unconnected are labelled NC.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def read(path: Path) -> str | None:
    try:
        # Device-tree properties (of_node/name) end in a NUL.
        return path.read_text(encoding="ascii").strip("\x00 \t\r\n")
    except (OSError, UnicodeDecodeError):
        return None


def number(path: Path) -> float | None:
    text = read(path)
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def thermal_zones(root: Path) -> Iterator[tuple[str, float]]:
    """(type, degrees Celsius) of each zone that answers, in the kernel's order."""
    zones = (root / "class" / "thermal").glob("thermal_zone*")
    for zone in sorted(zones, key=lambda p: (len(p.name), p.name)):  # zone10 after zone9
        temp = number(zone / "temp")
        if temp is not None:
            yield read(zone / "type") or zone.name, temp / 1000.0


def ina3221_rails(root: Path) -> Iterator[tuple[str, float]]:
    """(rail label, watts) of each connected INA3221 channel that answers."""
    for hwmon in sorted((root / "class" / "hwmon").glob("hwmon*")):
        if not (read(hwmon / "name") or "").startswith("ina3221"):
            continue
        for label_file in sorted(hwmon.glob("in*_label")):
            channel = label_file.name[2 : -len("_label")]
            mv = number(hwmon / f"in{channel}_input")
            ma = number(hwmon / f"curr{channel}_input")
            rail = read(label_file)
            if mv is None or ma is None or not rail or rail.startswith("NC"):
                continue
            yield rail, mv * ma / 1e6
