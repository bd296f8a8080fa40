"""What the machine is and how busy it is: recorded with every run."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

from harness.spec import tuning


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return sorted(flags & {"avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"})
    except OSError:
        pass
    return []


def cpu_identity() -> dict:
    """``vendor``, ``family``, ``model`` and every ``flags`` entry of the first CPU in /proc/cpuinfo (empty
    values where it cannot be read): what decides the kernel an OpenBLAS build picks."""
    out = {"vendor": "", "family": "", "model": "", "flags": []}
    names = {"vendor_id": "vendor", "cpu family": "family", "model": "model"}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key in names and not out[names[key]]:
                out[names[key]] = value
            elif key == "flags":
                out["flags"] = sorted(set(value.split()))
                break
    except OSError:
        pass
    return out


def numpy_blas() -> dict:
    """The BLAS NumPy is linked against (name, version), as far as NumPy tells."""
    import numpy as np

    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg.get("Build Dependencies", {}).get("blas", {})
        return {"name": blas.get("name"), "version": blas.get("version"), "openblas_config": blas.get("openblas configuration")}
    except TypeError:  # numpy < 1.26 has no mode="dicts"
        return {"name": "unknown (numpy < 1.26)"}


def gpu_info() -> list[str]:
    """GPU names and driver from nvidia-smi, or [] where there is none."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


def cpu_times() -> dict:
    """Aggregate CPU jiffies from /proc/stat (for the steal share over a run)."""
    try:
        parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]
        return {n: int(v) for n, v in zip(names, parts)}
    except (OSError, IndexError, ValueError):
        return {}


def steal_share(before: dict, after: dict) -> float | None:
    """Fraction of CPU time stolen by the hypervisor between two cpu_times() readings."""
    if not before or not after:
        return None
    total = sum(after.values()) - sum(before.values())
    return round((after.get("steal", 0) - before.get("steal", 0)) / total, 4) if total > 0 else None


def host_name() -> str:
    """The name each result row records as the host it ran on."""
    return platform.node() or "localhost"


def machine_info() -> dict:
    """CPU, cores, memory, BLAS, GPU and current load."""
    return {
        "hostname": host_name(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "memory_gb": _mem_gb(),
        "numpy_blas": numpy_blas(),
        "gpus": gpu_info(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        # the caller's variables that steer a numerical library: what every worker inherits unless clean_env
        "steering_env": tuning.steering(dict(os.environ)),
    }


#: tracked paths whose changes are a run's output, not the code that made it: a run writing into
#: results/examples/<config> leaves its commit clean
OUTPUT_PATHS = ("results/",)


def git_changes(path: str | Path | None = None) -> list[str] | None:
    """The tracked files that differ from the commit, outputs (:data:`OUTPUT_PATHS`) and untracked files
    left out: what makes the code a run ran other than its commit says; None outside git."""
    cwd = Path(path or Path(__file__).resolve().parents[2])
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if status.returncode != 0:
        return None
    changed = []
    for line in status.stdout.splitlines():
        name = line[3:].split(" -> ")[-1].strip().strip('"')
        if name and not name.startswith(OUTPUT_PATHS):
            changed.append(name)
    return changed


def git_commit(path: str | Path | None = None) -> str | None:
    """The project's git commit, with "-dirty" when its code differs from it (:func:`git_changes`: a run's
    own output and untracked files do not count), or None outside git."""
    cwd = Path(path or Path(__file__).resolve().parents[2])
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
    except (OSError, subprocess.SubprocessError):
        return None
    return sha.stdout.strip() + ("-dirty" if git_changes(cwd) else "")


def record_host(meta: dict, host: str, machine: dict | None, gemm_peaks: dict, gpu_roofs: dict | None) -> None:
    """Fold one host's facts into run.json's ``hosts``: its machine, the GEMM peaks measured there (added
    to those it had) and its GPU roofs (where measured). A local run has one host; a Dask run, each
    host a group's pass ran on."""
    entry = meta.setdefault("hosts", {}).setdefault(host, {"machine": machine, "gemm_peak_gflops": {}})
    entry["machine"] = machine
    entry["gemm_peak_gflops"].update(gemm_peaks)
    if gpu_roofs:
        entry["gpu_roofs"] = gpu_roofs
