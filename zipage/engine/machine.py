"""The machine an engine runs on, as a profile records it (`machine`, zipage/profile.py).

Profiles measured on one H200 moved by 5-15 % on another H200 (docs/cost_model.md, 'Quick
correction'): the GPU's model alone does not say what a step costs. What may move it is recorded
here: the GPU's name, memory, SM count and clocks (the maximum and the current SM and memory
clocks, where nvidia-smi answers), the driver, CUDA and torch versions, and the host (its CPU
model, core count, torch threads, and a hash of its name, so two profiles from one host are seen
to be one host's without naming it). Every field is best effort: a missing tool or file leaves
the field out rather than failing a calibration.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import socket
import subprocess

import torch

# nvidia-smi --query-gpu fields and the record's names for them: the clocks a profile's step
# times depend on (the SM clock for compute- and latency-bound kernels, the memory clock for
# HBM-bound ones), their maxima, and the power limit that caps them.
SMI_FIELDS = {"driver_version": "driver", "clocks.sm": "sm_clock_mhz",
              "clocks.max.sm": "sm_clock_max_mhz", "clocks.mem": "memory_clock_mhz",
              "clocks.max.mem": "memory_clock_max_mhz", "power.limit": "power_limit_w"}
SMI_TIMEOUT_S = 10.0


def machine_record(device: torch.device) -> dict:
    """What this process measures on: the record a profile keeps as `machine`."""
    record = {"device": device.type, "torch": torch.__version__,
              "python": platform.python_version(), **host_record()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        record.update(gpu_name=properties.name, gpu_memory_bytes=int(properties.total_memory),
                      gpu_sm_count=int(properties.multi_processor_count),
                      cuda=torch.version.cuda)
        record.update(smi_record(device.index if device.index is not None
                                 else torch.cuda.current_device()))
    else:
        record["threads"] = torch.get_num_threads()
    return record


def host_record() -> dict:
    name = socket.gethostname()
    return {"host_cpu": cpu_model(), "host_cores": os.cpu_count(),
            "host_id": hashlib.sha256(name.encode()).hexdigest()[:12]}


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo on Linux; the platform's word elsewhere)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def smi_record(index: int) -> dict:
    """The driver, clocks and power limit of GPU `index`, from nvidia-smi ({} where it is
    missing or fails: a record without clocks is still a record)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        answer = subprocess.run(
            [smi, f"--id={index}", f"--query-gpu={','.join(SMI_FIELDS)}",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [value.strip() for value in answer.strip().splitlines()[0].split(",")] \
        if answer.strip() else []
    record = {}
    for (_, name), value in zip(SMI_FIELDS.items(), values):
        if name == "driver":
            record[name] = value
            continue
        try:
            record[name] = float(value)
        except ValueError:  # "[N/A]": not readable on this GPU
            continue
    return record


def same_kind(ours: dict, theirs: dict | None) -> str | None:
    """None if a profile measured on `theirs` may be re-scaled for `ours` (one kind of device:
    the same GPU model, or both the CPU), else why not, in words. A profile without a record
    (written before records) is taken at its header's word."""
    if theirs is None:
        return None
    if theirs.get("device") != ours.get("device"):
        return (f"measured on a {theirs.get('device')} engine, this is a {ours.get('device')} "
                "engine")
    if ours.get("device") == "cuda" and theirs.get("gpu_name") != ours.get("gpu_name"):
        return f"measured on {theirs.get('gpu_name')!r}, this GPU is {ours.get('gpu_name')!r}"
    return None
