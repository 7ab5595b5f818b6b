"""XID errors, classified: which ones an application causes and which ones need the card reset.

NVML's XID event carries every XID the driver logs, including those a crashing or
killed process causes. vLLM's most common crash ("CUDA error: an illegal memory
access was encountered") comes with 13 and 31; killing a process with GPU work in
flight (what r3090d does to a frozen engine) logs 43 and 45. Those are events: the
engine is restarted like after any other failure. Only the XIDs NVIDIA's catalog
resolves with a GPU reset or a reboot hold starts back, until the operator has
reset the card (`r3090ctl restart`) or the machine has rebooted.

The descriptions are the catalog's words (NVIDIA, "Xid Errors", docs.nvidia.com/deploy/xid-errors).
An XID not in the table is treated as application-level for starts (starting
again is what fixes most of them) and alerted as critical, since nothing here
knows what it means.

The driver may also give its own verdict: NVML's GPU recovery action (field
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, driver 565 and later). Where it asks for a
reset or a reboot, that holds starts too, whatever the XID.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class XidClass(enum.StrEnum):
    """What an XID asks of r3090d; the exporter's `class` label."""

    APPLICATION = "application"  # a process's own fault: restart the engine, warn
    RESET = "reset"  # the card needs a reset or a reboot: no start until then, critical
    ROW_REMAP = "row_remap"  # a reset "at a convenient time": warn, keep serving
    UNKNOWN = "unknown"  # not in the table: restart like APPLICATION, alert critical


@dataclass(frozen=True)
class XidInfo:
    xid: int
    cls: XidClass
    meaning: str


_TABLE = (
    (8, XidClass.APPLICATION, "GPU stopped processing"),
    (13, XidClass.APPLICATION, "Graphics Engine Exception"),
    (31, XidClass.APPLICATION, "GPU memory page fault"),
    (32, XidClass.APPLICATION, "Invalid or corrupted push buffer stream"),
    (43, XidClass.APPLICATION, "GPU stopped processing"),
    (45, XidClass.APPLICATION, "Preemptive cleanup, due to previous errors"),
    (68, XidClass.APPLICATION, "NVDEC0 Exception"),
    (69, XidClass.APPLICATION, "Graphics Engine class error"),
    (94, XidClass.APPLICATION, "Contained ECC error"),
    (109, XidClass.APPLICATION, "Context Switch Timeout Error"),
    (48, XidClass.RESET, "Double Bit ECC Error"),
    (61, XidClass.RESET, "Internal micro-controller breakpoint/warning"),
    (62, XidClass.RESET, "Internal micro-controller halt"),
    (74, XidClass.RESET, "NVLINK Error"),
    (79, XidClass.RESET, "GPU has fallen off the bus"),
    (92, XidClass.RESET, "High single-bit ECC error rate"),
    (95, XidClass.RESET, "Uncontained ECC error"),
    (119, XidClass.RESET, "GSP RPC Timeout"),
    (120, XidClass.RESET, "GSP Error"),
    (63, XidClass.ROW_REMAP, "ECC page retirement or row remapping recording event"),
    (64, XidClass.ROW_REMAP, "ECC page retirement or row remapper recording failure"),
)
XIDS = {xid: XidInfo(xid, cls, meaning) for xid, cls, meaning in _TABLE}


def classify(xid: int) -> XidInfo:
    return XIDS.get(xid, XidInfo(xid, XidClass.UNKNOWN, f"unknown XID {xid}"))


def describe(xid: int) -> str:
    info = classify(xid)
    return info.meaning if info.cls is XidClass.UNKNOWN else f"XID {xid} ({info.meaning})"


class RecoveryAction(enum.StrEnum):
    """NVML's nvmlDeviceGpuRecoveryAction_t: what the driver says the GPU needs."""

    NONE = "none"
    GPU_RESET = "gpu_reset"
    NODE_REBOOT = "node_reboot"
    DRAIN_P2P = "drain_p2p"
    DRAIN_AND_RESET = "drain_and_reset"

    @property
    def text(self) -> str:
        return self.value.replace("_", " ")


# NVML's numbers for them (NVML_GPU_RECOVERY_ACTION_*), in order.
RECOVERY_ACTION_CODES = dict(enumerate(RecoveryAction))


# The recovery actions after which no engine may start on the card.
HOLDING_ACTIONS = (RecoveryAction.GPU_RESET, RecoveryAction.NODE_REBOOT, RecoveryAction.DRAIN_AND_RESET)

RESET_PROCEDURE = (
    "stop r3090d (systemctl stop r3090d: its NVML session blocks the reset), "
    "reset the card (nvidia-smi -r -i <index>) or reboot, then start r3090d; "
    "r3090ctl restart clears the hold once the card is reset"
)


@dataclass(frozen=True)
class ResetHold:
    """Why no engine may start: the card needs a reset or a reboot. Cleared by r3090ctl restart, or a reboot."""

    reason: str  # e.g. "XID 79 (GPU has fallen off the bus)"
    since_wall: float  # wall clock, for the record on disk and status
