"""The cost model's device rows: what a device computes, holds and moves per second (autopar/analysis/cost.py
reads them; ``autopar calibrate`` measures a CPU's; ``--devices FILE`` adds rows)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace


@dataclass
class Device:
    name: str
    flops: dict[str, float]  # peak dense FLOP/s by compute dtype ("fp32", "bf16", "fp16")
    mem_bw: float  # bytes/s, device memory
    mem_bytes: float  # capacity per device
    intra_bw: float  # bytes/s per rank per direction, inside a node
    intra_alpha: float  # seconds per collective step inside a node
    inter_bw: float  # bytes/s per rank, between nodes
    inter_alpha: float
    ranks_per_node: int
    efficiency: float = 1.0  # achievable fraction of peak FLOP/s on large matmuls
    source: str = ""
    op_overhead: float = 0.0  # seconds per executed op (kernel launch / eager dispatch)
    cores: int = 0  # CPU: cores shared by the ranks of a node (0: each rank has its own device)
    # CPU with more ranks than cores: seconds per ring step of a collective while the ranks compute
    # between collectives (the OS must schedule each peer in turn); 0: not measured, intra_alpha
    loaded_alpha: float = 0.0
    # bytes/s at which torch's optimizer step makes its accesses (cost.OPTIMIZER_ACCESSES x 4 per
    # element), measured by timing torch.optim.AdamW; 0: mem_bw. On a CPU its passes run over warm
    # memory, mostly compute-bound, unlike the fresh outputs mem_bw measures
    optimizer_bw: float = 0.0
    # bytes/s of the per-rank program's memory-bound ops run eagerly, one ATen kernel each (bf16,
    # broadcasting, casts, strided views), measured by ``autopar calibrate --device cuda`` on a
    # transformer block's elementwise ops; 0: mem_bw. The kernels Inductor generates stay at mem_bw
    eager_bw: float = 0.0

    @property
    def kind(self) -> str:
        """The device's kind, "cpu" (its cores shared by the ranks) or "gpu": which Inductor
        thresholds and generated code the cost model applies."""
        return "cpu" if self.cores else "gpu"

    def describe(self) -> str:
        f = ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in self.flops.items())
        return (f"{self.name}: {f} (x{self.efficiency:g} achievable); memory {self.mem_bytes / 2**30:.0f} GiB at "
                f"{self.mem_bw / 1e9:g} GB/s; intra-node {self.intra_bw / 1e9:g} GB/s, alpha "
                f"{self.intra_alpha * 1e6:g} us ({self.ranks_per_node} ranks/node); inter-node "
                f"{self.inter_bw / 1e9:g} GB/s, alpha {self.inter_alpha * 1e6:g} us; {self.op_overhead * 1e6:g} us "
                f"per op" + (f"; eager elementwise ops at {self.eager_bw / 1e9:g} GB/s" if self.eager_bw else "")
                + (f"; optimizer step at {self.optimizer_bw / 1e9:g} GB/s" if self.optimizer_bw else "")
                + (f"; {self.cores} cores shared by a node's ranks" if self.cores else "")
                + (f" (more ranks than cores: {self.loaded_alpha * 1e6:g} us per ring step, collectives "
                   f"not overlapped)" if self.cores and self.loaded_alpha else "")
                + f". Source: {self.source}")


DEVICES: dict[str, Device] = {
    # NVIDIA datasheets (SXM, dense): H100 989 TFLOP/s bf16, 67 fp32 (non-tensor), 3.35 TB/s HBM3,
    # NVLink4 900 GB/s bidirectional (450 per direction); one 400 Gb/s NIC per GPU (50 GB/s).
    "h100": Device("h100", {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12}, 3.35e12, 80 * 2**30,
                   450e9, 10e-6, 50e9, 20e-6, 8, 0.6,
                   "assumption: NVIDIA H100 SXM datasheet peaks, 8 GPUs/node on NVLink4, 400 Gb/s NIC per GPU, "
                   "60% of peak achievable on large matmuls, 5 us launch gap per op (asynchronous)", 5e-6),
    "a100": Device("a100", {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}, 2.039e12, 80 * 2**30,
                   300e9, 10e-6, 25e9, 20e-6, 8, 0.6,
                   "assumption: NVIDIA A100 SXM 80GB datasheet peaks, NVLink3 600 GB/s bidirectional, "
                   "200 Gb/s NIC per GPU, 60% of peak achievable, 5 us launch gap per op (asynchronous)", 5e-6),
    # efficiency 1: the calibrated figures are achieved rates, not peaks
    "cpu": Device("cpu", {"fp32": 83e9, "bf16": 367e9, "fp16": 2.1e9}, 5e9, 24 * 2**30,
                  0.93e9, 169e-6, 0.93e9, 169e-6, 64, 1.0,
                  "calibrated 2026-11-22 by `autopar calibrate` on the development machine (2 cores, 1 thread "
                  "per rank; 512^3 matmuls, an elementwise add on 8 MiB, 2-process gloo all-reduce over loopback, eager "
                  "dispatch of a small op; torch.optim.AdamW's step on 4.5M fp32 parameters measured 2026-11-27: "
                  "32.7 GB/s at 20 accesses per element)", 2.5e-6, 2, optimizer_bw=32.7e9),
}
# H200: H100's compute and links, 4.8 TB/s HBM3e, 141 GB
DEVICES["h200"] = replace(DEVICES["h100"], name="h200", mem_bw=4.8e12, mem_bytes=141 * 2**30,
                          source="assumption: NVIDIA H200 SXM datasheet (H100 compute and links, 4.8 TB/s HBM3e, "
                                 "141 GB), 8 GPUs/node on NVLink4, 400 Gb/s NIC per GPU, 60% of peak achievable, "
                                 "5 us launch gap per op (asynchronous)")


def row_for(device_name: str | None) -> str:
    """The cost model's row for a device as torch names it (``torch.cuda.get_device_name()``;
    None: no GPU, the ``cpu`` row): the row whose name the device's contains (h200, h100, a100),
    else ``h100`` (an assumption for any other GPU: callers that report the row say which)."""
    if device_name is None:
        return "cpu"
    name = device_name.lower()
    return next((row for row in ("h200", "h100", "a100") if row in name), "h100")


def load_devices(path: str) -> None:
    """Add or replace rows of DEVICES from a JSON file written by ``autopar calibrate``."""
    with open(path) as f:
        rows = json.load(f)
    for row in rows if isinstance(rows, list) else [rows]:
        DEVICES[row["name"]] = Device(**row)


def get_device(name: str) -> Device:
    from autopar.errors import PlanError

    if name not in DEVICES:
        raise PlanError(f"unknown device {name!r}", where="--device",
                        fix=f"use one of {sorted(DEVICES)}, or add one with --devices FILE (autopar calibrate)")
    return DEVICES[name]
