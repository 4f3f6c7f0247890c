"""A node's GPUs as NVML reports them, and whether a spare may use one.

The agent reads the GPU of each of its workers when they start (a spare
warms up), every ``GPU_HEALTH_INTERVAL_S`` after that, and at once when a
failure is announced (a spare is about to be used); it tells the
coordinator whenever a GPU's verdict changes, and the coordinator takes no
spare whose GPU has a problem (control/coordinator.py). NVML answers
without a CUDA context, so reading costs the workers nothing.

A GPU has a problem (``GpuReading.problems``) when it has uncorrectable
ECC errors since the driver loaded, memory pages waiting to be retired or
rows waiting to be remapped (both need a GPU reset), a failed row remap,
or NVML cannot reach it: each lasts until the GPU is reset, and corrupts
results or stops the rank. Clocks held down (hardware slowdown, thermal
slowdown, the power brake) are recorded and not judged: they come and go
with the load, and a slow GPU is a straggler, not a broken one. Corrected
ECC errors, memory in use, utilization and temperature are recorded too.
A reading NVML does not support on a part (MIG, a virtualised GPU), or a
call an older binding lacks, is unknown, not a problem.

We read NVML with NVIDIA's own binding (``nvidia-ml-py``, imported as
``pynvml``); ``NvmlReader`` takes the module, so a test can hand it a fake.
"""

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from megatron.training import gpu_sharing

# Clock-event reasons (NVML's bit masks) that slow a GPU for reasons of
# its health, recorded; the others (idle, power cap, application clocks)
# are its normal work.
BAD_CLOCK_REASONS = {
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML saw it; None where NVML does not support a reading."""

    index: int  # NVML's index (physical, not CUDA_VISIBLE_DEVICES')
    name: str
    memory_used_mib: Optional[int] = None
    memory_total_mib: Optional[int] = None
    utilization_percent: Optional[int] = None
    temperature_c: Optional[int] = None
    ecc_uncorrected: Optional[int] = None  # volatile: since the driver loaded
    ecc_corrected: Optional[int] = None
    retired_pages: Optional[int] = None
    retirement_pending: Optional[bool] = None
    remap_pending: Optional[bool] = None
    remap_failed: Optional[bool] = None
    clock_reasons: Tuple[str, ...] = field(default_factory=tuple)  # the bad ones only
    unreachable: Optional[str] = None  # NVML's error when it cannot reach the GPU

    def problems(self) -> List[str]:
        """Why a spare must not use this GPU (empty: it may)."""
        found = [f"NVML cannot reach it: {self.unreachable}"] if self.unreachable else []
        if self.ecc_uncorrected:
            found.append(f"{self.ecc_uncorrected} uncorrectable ECC errors")
        if self.retirement_pending:
            found.append("memory pages waiting to be retired (needs a GPU reset)")
        if self.remap_pending:
            found.append("memory rows waiting to be remapped (needs a GPU reset)")
        if self.remap_failed:
            found.append("a memory row remap failed")
        return found

    def summary(self) -> str:
        """One line for the events and dashboards."""
        memory = (
            f"{self.memory_used_mib}/{self.memory_total_mib} MiB"
            if self.memory_total_mib is not None
            else "memory unknown"
        )
        ecc = "ECC unknown" if self.ecc_uncorrected is None else f"{self.ecc_uncorrected} ECC"
        clocks = (
            f", clocks held down: {', '.join(self.clock_reasons)}" if self.clock_reasons else ""
        )
        verdict = "; ".join(self.problems()) or "healthy"
        return f"GPU {self.index} ({self.name}, {memory}, {ecc}{clocks}): {verdict}"

    def to_dict(self) -> dict:
        body = asdict(self)
        body["clock_reasons"] = list(self.clock_reasons)
        return body

    @classmethod
    def from_dict(cls, body: Mapping) -> "GpuReading":
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in body.items() if k in names}
        known["clock_reasons"] = tuple(known.get("clock_reasons", ()))
        return cls(**known)


class NvmlUnavailable(RuntimeError):
    """No NVML here (a CPU node, no driver): GPU health is not checked."""


class NvmlReader:
    """Reads the GPUs that a node's workers use through ``nvml`` (the pynvml
    module, or a fake with its functions)."""

    def __init__(self, nvml, environ: Mapping[str, str] = os.environ):
        self.nvml, self.environ = nvml, environ
        try:
            nvml.nvmlInit()
            self.count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as error:
            raise NvmlUnavailable(f"NVML: {error}") from None
        if self.count == 0:
            raise NvmlUnavailable("NVML sees no GPU")

    @classmethod
    def open(cls, environ: Mapping[str, str] = os.environ) -> "NvmlReader":
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("the nvidia-ml-py package is not installed") from None
        return cls(pynvml, environ)

    def visible(self) -> List[str]:
        """The GPUs CUDA numbers 0, 1, ... for the workers: NVML indices or
        UUIDs from CUDA_VISIBLE_DEVICES, else every GPU in NVML's order. As
        CUDA, the list ends at the first entry that names no GPU ("-1")."""
        listed = self.environ.get("CUDA_VISIBLE_DEVICES")
        if listed is None:
            return [str(i) for i in range(self.count)]
        visible = []
        for entry in (e.strip() for e in listed.split(",")):
            if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
                break
            visible.append(entry)
        return visible

    def gpu_of(self, local_rank: int) -> Optional[str]:
        """The GPU a worker of this local rank uses (initialize.setup_device's
        choice), or None where it has none (its worker refuses to start)."""
        visible = self.visible()
        if not visible:
            return None
        mode = gpu_sharing.sharing_mode(self.environ)
        try:
            return visible[gpu_sharing.device_index(local_rank, len(visible), mode)]
        except ValueError:
            return None

    def read(self, gpu: str) -> GpuReading:
        """``gpu``: an NVML index or a UUID (an entry of ``visible``)."""
        n = self.nvml
        try:
            if gpu.isdigit():
                handle = n.nvmlDeviceGetHandleByIndex(int(gpu))
            else:
                handle = n.nvmlDeviceGetHandleByUUID(gpu)
        except n.NVMLError as error:  # fallen off the bus, or gone
            return GpuReading(
                index=int(gpu) if gpu.isdigit() else -1, name=gpu, unreachable=str(error)
            )
        ask = self._asker()
        memory = ask("nvmlDeviceGetMemoryInfo", handle)
        rows = ask("nvmlDeviceGetRemappedRows", handle)  # (corrected, uncorrected, pending, failed)
        pages = [
            ask("nvmlDeviceGetRetiredPages", handle, cause)
            for cause in (
                getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0),
                getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1),
            )
        ]
        # Older bindings name it for throttling.
        clocks = ask("nvmlDeviceGetCurrentClocksEventReasons", handle)
        if clocks is None:
            clocks = ask("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        uncorrected, corrected, volatile = 1, 0, 0  # NVML's memory error types and counter
        return GpuReading(
            index=ask("nvmlDeviceGetIndex", handle) if not gpu.isdigit() else int(gpu),
            name=_text(ask("nvmlDeviceGetName", handle)) or "unknown",
            memory_used_mib=None if memory is None else memory.used >> 20,
            memory_total_mib=None if memory is None else memory.total >> 20,
            utilization_percent=_field(ask("nvmlDeviceGetUtilizationRates", handle), "gpu"),
            temperature_c=ask("nvmlDeviceGetTemperature", handle, 0),  # the GPU's sensor
            ecc_uncorrected=ask("nvmlDeviceGetTotalEccErrors", handle, uncorrected, volatile),
            ecc_corrected=ask("nvmlDeviceGetTotalEccErrors", handle, corrected, volatile),
            retired_pages=None if None in pages else sum(len(p) for p in pages),
            retirement_pending=_flag(ask("nvmlDeviceGetRetiredPagesPendingStatus", handle)),
            remap_pending=None if rows is None else bool(rows[2]),
            remap_failed=None if rows is None else bool(rows[3]),
            clock_reasons=tuple(
                reason for bit, reason in BAD_CLOCK_REASONS.items() if clocks and clocks & bit
            ),
        )

    def _asker(self) -> Callable:
        """Calls the NVML function of that name; None where the part does
        not support it, or the binding lacks it."""

        def ask(name: str, *args):
            function = getattr(self.nvml, name, None)
            if function is None:
                return None
            try:
                return function(*args)
            except self.nvml.NVMLError:
                return None

        return ask

    def read_workers(self, locals_: List[int]) -> Dict[int, GpuReading]:
        """Each local rank's GPU (ranks sharing one GPU share the reading).
        A rank with no GPU of its own is left out: its worker refuses to
        start and says why."""
        readings: Dict[str, GpuReading] = {}
        out = {}
        for local in locals_:
            gpu = self.gpu_of(local)
            if gpu is None:
                continue
            if gpu not in readings:
                readings[gpu] = self.read(gpu)
            out[local] = readings[gpu]
        return out


def _text(value) -> Optional[str]:
    return value.decode() if isinstance(value, bytes) else value


def _field(value, name: str) -> Optional[int]:
    return None if value is None else getattr(value, name)


def _flag(value) -> Optional[bool]:
    return None if value is None else bool(value)
