"""What machine a benchmark ran on, for the line printed above its table."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else the platform string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
