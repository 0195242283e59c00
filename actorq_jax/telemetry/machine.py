"""What every benchmark report says about the machine it ran on."""

import os
import platform
from typing import Any, Dict


def _first_processor() -> Dict[str, str]:
    """The fields of /proc/cpuinfo's first processor block ({} where it cannot be read)."""
    fields: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # every processor of one machine reports the same model and flags
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    return _first_processor().get("model name") or platform.processor() or platform.machine()


def cpu_id() -> str:
    """The CPU's vendor, family and model numbers ("AuthenticAMD family 25 model 17"): what tells apart two CPUs
    whose model names read the same (a cloud's "AMD EPYC" is a Zen 3, 4 or 5); "" where /proc/cpuinfo says none."""
    fields = _first_processor()
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"{fields.get('vendor_id', 'unknown')} family {fields['cpu family']} model {fields['model']}"


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` among the CPU's flags (False where it cannot be read)."""
    return flag in _first_processor().get("flags", "").split()


def machine_info() -> Dict[str, Any]:
    """CPU, cores, JAX version and load average (machines are shared: ratios hold, absolute times less so)."""
    try:
        import jax

        jax_version = jax.__version__
    except ImportError:
        jax_version = "unknown"
    load = [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu_model(), "cpu_id": cpu_id(), "cores": os.cpu_count(), "jax": jax_version,
            "loadavg_1_5_15": load}
