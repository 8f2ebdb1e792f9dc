"""Adapter discovery and choice, and device creation with the adapter's real limits.

Choice everywhere: `--device INDEX|NAME` or `MAMBACTL_DEVICE`, else the best adapter
(discrete > integrated > CPU; Vulkan/Metal/DX12 before GL).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass

import wgpu

from mambactl.errors import MambactlError

# The limits and features that decide what mambactl can run and how fast.
REPORTED_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroups-per-dimension",
    "max-storage-buffers-per-shader-stage",
)
REPORTED_FEATURES = ("shader-f16", "subgroup", "subgroups", "timestamp-query", "cooperative-matrix")
# Features requested when present; kernels check `Runtime.features` before relying on one.
WANTED_FEATURES = ("shader-f16", "subgroup", "timestamp-query")

_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 1}

NO_ADAPTER_HELP = (
    "no GPU adapter found by wgpu. Install a GPU driver with Vulkan, Metal or DX12 support; on a machine "
    "without a GPU install a software adapter: `apt-get install -y mesa-vulkan-drivers` (Mesa lavapipe, Vulkan) "
    "or Mesa's llvmpipe OpenGL (libgl1-mesa-dri, libegl1)"
)


@dataclass
class AdapterInfo:
    index: int
    name: str
    backend: str
    type: str
    vendor: str
    driver: str
    limits: dict
    features: list

    def to_dict(self) -> dict:
        return asdict(self)


def _quiet_egl() -> None:
    # Mesa's EGL (behind the GL adapter) prints an error per probe when XDG_RUNTIME_DIR is unset.
    if not os.environ.get("XDG_RUNTIME_DIR"):
        path = os.path.join(tempfile.gettempdir(), f"mambactl-runtime-{os.getuid()}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = path


def _software_threads() -> None:
    # Mesa's software adapters (lavapipe, llvmpipe) split each dispatch's workgroups statically over
    # LP_NUM_THREADS workers, one per core by default, and every dispatch waits for its slowest worker: when
    # anything else takes a core for a moment (our own host thread, lavapipe's queue thread) the whole dispatch
    # waits. Twice as many workers as cores measured 1.1-1.3x the PyTorch + mamba.py peer's tiny-config steps
    # side by side on 2 cores, against 0.7-0.9x with the default (docs/performance.md, CPU). A value the user
    # set wins; GPU drivers do not read it.
    os.environ.setdefault("LP_NUM_THREADS", str(2 * (os.cpu_count() or 1)))


def _enumerate() -> list:
    _quiet_egl()
    _software_threads()
    try:
        return list(wgpu.gpu.enumerate_adapters_sync())
    except Exception as exc:  # a broken loader or driver: still one clear line
        raise MambactlError(f"{NO_ADAPTER_HELP} (wgpu: {str(exc).splitlines()[0] if str(exc) else exc!r})") from None


def describe(index: int, adapter) -> AdapterInfo:
    info = adapter.info
    limits = {k: int(adapter.limits[k]) for k in REPORTED_LIMITS if k in adapter.limits}
    features = sorted(f for f in adapter.features if f in REPORTED_FEATURES)
    return AdapterInfo(
        index=index,
        name=info.get("device", "") or "unknown",
        backend=info.get("backend_type", "") or "unknown",
        type=info.get("adapter_type", "") or "unknown",
        vendor=info.get("vendor", ""),
        driver=info.get("description", ""),
        limits=limits,
        features=features,
    )


def list_adapters() -> list[AdapterInfo]:
    return [describe(i, a) for i, a in enumerate(_enumerate())]


def _rank(info: AdapterInfo) -> tuple:
    return (_TYPE_RANK.get(info.type, 4), _BACKEND_RANK.get(info.backend, 2), info.index)


def choose_adapter(spec: str | int | None = None):
    """Return (adapter, AdapterInfo). `spec` is an index or a case-insensitive substring of the name
    (or "name/backend", e.g. "llvmpipe/OpenGL"); None falls back to MAMBACTL_DEVICE, then the best adapter."""
    adapters = _enumerate()
    if not adapters:
        raise MambactlError(NO_ADAPTER_HELP)
    infos = [describe(i, a) for i, a in enumerate(adapters)]
    if spec is None or spec == "":
        spec = os.environ.get("MAMBACTL_DEVICE") or None
    if spec is None:
        best = min(infos, key=_rank)
        return adapters[best.index], best
    text = str(spec).strip()
    if text.isdigit():
        i = int(text)
        if i >= len(adapters):
            raise MambactlError(f"device {i} does not exist; `mambactl devices` lists {len(adapters)} adapter(s)")
        return adapters[i], infos[i]
    name, _, backend = text.lower().partition("/")
    matches = [
        inf for inf in infos if name in inf.name.lower() and (not backend or backend in inf.backend.lower())
    ]
    if not matches:
        names = ", ".join(f"{i.index}: {i.name} ({i.backend})" for i in infos)
        raise MambactlError(f"no adapter matches device {text!r}; available: {names}")
    best = min(matches, key=_rank)
    return adapters[best.index], best


def create_device(adapter):
    """Request the device with every limit at the adapter's maximum (not the WebGPU defaults)."""
    features = [f for f in WANTED_FEATURES if f in adapter.features]
    limits = {k: v for k, v in adapter.limits.items()}
    return adapter.request_device_sync(required_features=features, required_limits=limits), features
