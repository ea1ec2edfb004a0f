"""Write the byte code of everything the daemon and edgectl import, once, at setup.

Python runs a module from its cached byte code (`__pycache__/*.pyc`) where one exists and
compiles the source on every import where none does. It writes that cache on a module's
first import, except where PYTHONDONTWRITEBYTECODE is set (container images often set it)
or the directory is read-only: the systemd unit's ProtectSystem=strict makes the whole
checkout so. On such a box every daemon start and every edgectl command compiled torch
again: `import torch` takes 4.6 s of CPU from source against 1.4 s from byte code on an
x86_64 core, and the daemon's imports 5.6 s against 2.0 s. Reading a cache needs neither
the variable unset nor a writable directory, so setup writes it here.

Every module of edge and engines is imported (which brings what they import at the top),
then the packages they import only inside functions. A module that cannot be imported on
this box (Triton where it is absent, TensorRT off a Jetson) is skipped: the same module
is skipped by the daemon too.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

# Imported inside functions of edge and engines (grep for indented imports): on first use
# by a job or a build, so walking edge's modules does not reach them.
LAZY = (
    "bitsandbytes",
    "cv2",
    "faiss",
    "gguf",
    "llguidance",
    "lz4.frame",
    "onnx",
    "onnxconverter_common",
    "onnxruntime",
    "opentelemetry.sdk.trace",
    "pynvml",
    "pypdf",
    "safetensors.torch",
    "tokenizers",
    "transformers",
    "triton",
)


def _modules(package: str) -> list[str]:
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if not info.name.endswith("__main__"):  # importing one would run the command
            names.append(info.name)
    return names


def write(packages: tuple[str, ...] = ("edge", "engines"), lazy: tuple[str, ...] = LAZY) -> tuple[int, int]:
    """Import every module of `packages` and each of `lazy`, writing their byte code and
    that of all they import; (imported, skipped)."""
    was = sys.dont_write_bytecode
    sys.dont_write_bytecode = False  # whatever the environment says: this is the one writer
    imported = skipped = 0
    try:
        for name in [*(m for p in packages for m in _modules(p)), *lazy]:
            try:
                importlib.import_module(name)
                imported += 1
            except Exception:  # absent on this box: skipped here as by the daemon
                skipped += 1
    finally:
        sys.dont_write_bytecode = was
    return imported, skipped


def main() -> int:
    started = time.perf_counter()
    imported, skipped = write()
    print(
        f"setup: byte code written for {imported} modules ({skipped} not on this box) "
        f"in {time.perf_counter() - started:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
