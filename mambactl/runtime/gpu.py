"""The GPU runtime: one device, a pipeline cache, a buffer pool and a command recorder.

Ops call `rt.run(entry, groups, **bindings_and_params)`; dispatches are recorded, not submitted, until
something needs the results on the host (`read`) or new host data (`write`), or a batch has piled up (so the
GPU starts on it while the host records the rest): a whole training step is a handful of submits and no host
round trip. After the host has waited for the GPU (a read), the first batch is FIRST_SUBMIT dispatches and each
next one twice the last (a batch cut short by a write counts as its own length), up to DISPATCHES_PER_SUBMIT, so
an idle GPU starts within a few dispatches' recording instead of waiting for 256 of them to be recorded. All of a
batch's uniform parameters go up in one write, and every dispatch binds its slot of that buffer by a dynamic
offset, so bind groups depend only on the buffers bound and are cached (a training step binds the same pooled
buffers every time).

A block of work that is the same every time (a decoding step of the Mamba layers: same kernels, same buffers,
same parameters) can be recorded once as a `Graph` (`with rt.capture() as g: ...`) and queued again with
`rt.replay(g)`, skipping the ops' Python: the host cost of a replayed dispatch is its encoding alone.

A kernel may read a tensor through a texture (`var x_tex: texture_2d<f32>;`, bound by name like a buffer): the
tensor is then copied into its own rgba32float texture, TEXTURE_ROW texels (4 floats each) a row, so float e is
component e % 4 of texel e / 4 (kernels/texture.wgsl). The copy is recorded before the dispatch unless the texture
already holds the tensor's bytes: every buffer carries the count of the last recorded command that may have written
it (a dispatch binding it read_write, a copy into it, a host write), and a texture the count it was copied at. That
is for the CPU adapters' kernels: on Mesa lavapipe a storage-buffer load is a loop over the SIMD lanes, a texel fetch
an unrolled gather (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import wgpu

from mambactl.errors import MambactlError, ShapeError
from mambactl.runtime import device as device_mod
from mambactl.runtime.kernels import all_modules, entry_point
from mambactl.runtime.memory import BufferPool
from mambactl.runtime.tensor import DTYPES, Tensor

_UNIFORM_SLOT = 256  # >= minUniformBufferOffsetAlignment on every backend
_UNIFORM_SLOTS = 4096
DISPATCHES_PER_SUBMIT = 256
# 4 (was 32): a synced Mamba-2 130m step on the H200 started its GPU work ~1 ms sooner, 208.0 -> 206.4 ms (median of
# 6 after 3 warm-up, one call, 2026-12-03); a streamed one was level (204.1 / 203.8) for its 3 more submits.
FIRST_SUBMIT = 4
# wgpu's WGSL compiler guards every array index (a clamp) and gives every loop an extra iteration counter with a
# second exit, so a shader cannot read out of bounds or hang: the defence a browser needs against untrusted
# shaders. Ours are our own and tested against references, so modules are compiled without those checks
# (wgpu-native's wgpuDeviceCreateShaderModuleTrusted) unless this is 1; storage buffers stay guarded by the
# driver's robust buffer access either way.
SHADER_RUNTIME_CHECKS = 0
TEXTURE_ROW = 4096  # texels per row of a tensor's texture (TEXTURE_ROW_SHIFT in kernels/texture.wgsl): 64 KiB of floats
_BIND_GROUP_CACHE = 65536  # entries; past this the cache starts over
_TEXTURE_CACHE = 1024  # tensors' textures (Runtime._texture); past this the cache starts over
_PACK = {"u32": "I", "i32": "i", "f32": "f"}
_BIND_TYPE = {
    "uniform": {"buffer": {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True}},
    "read": {"buffer": {"type": wgpu.BufferBindingType.read_only_storage}},
    "read_write": {"buffer": {"type": wgpu.BufferBindingType.storage}},
    "texture": {"texture": {"sample_type": wgpu.TextureSampleType.unfilterable_float,
                            "view_dimension": wgpu.TextureViewDimension.d2, "multisampled": False}},
}


def grid_1d(n: int, workgroup: int = 256) -> tuple[int, int]:
    """Workgroups for n threads as a 2-D grid (kernels index y * groups_x * workgroup + x)."""
    groups = max(1, -(-n // workgroup))
    gx = min(groups, 65535)
    return gx, -(-groups // gx)


@dataclass
class Graph:
    """Recorded work to queue again (`Runtime.capture`, `Runtime.replay`): per dispatch its pipeline, bind group,
    uniform bytes (one slot per uniform binding) and grid; copies as recorded. It keeps every tensor made while
    it was captured, so their buffers stay its own (the pool cannot hand them to anyone else)."""

    commands: list = field(default_factory=list)
    tensors: list = field(default_factory=list)


def _shader_module(device, label: str, code: str, checks: int):
    """A WGSL module; with `checks` 0, compiled without wgpu's index clamps and loop counters (SHADER_RUNTIME_CHECKS)."""
    if checks:
        return device.create_shader_module(label=label, code=code)
    from wgpu.backends.wgpu_native._api import GPUShaderModule, ffi, lib, libf, new_struct_p, to_c_string_view

    source = new_struct_p("WGPUShaderSourceWGSL *", code=to_c_string_view(code))
    source[0].chain.next = ffi.NULL
    source[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    descriptor = new_struct_p("WGPUShaderModuleDescriptor *", nextInChain=ffi.cast("WGPUChainedStruct *", source),
                              label=to_c_string_view(label))
    handle = libf.wgpuDeviceCreateShaderModuleTrusted(device._internal, descriptor, lib.WGPUShaderRuntimeChecks_None)
    if handle == ffi.NULL:
        raise MambactlError(f"the WGSL module {label} failed to compile")
    return GPUShaderModule(label, handle, device)


def _texture_rows(nbytes: int) -> int:
    """Rows of the texture that holds `nbytes` of a tensor (at least one)."""
    return max(1, -(-nbytes // (16 * TEXTURE_ROW)))


def _texture_copies(buffer, offset: int, nbytes: int, texture) -> list:
    """The C arguments of the copies of a tensor's bytes into its texture (Runtime._texture): its whole rows, then
    the last, partial row (rounded up to a texel: fits_texture checked those bytes are in the buffer). Built once
    per texture and recorded by `_copy_to_texture`: wgpu's `copy_buffer_to_texture` builds and checks these
    structs in Python at every call, ~50 µs each on this project's CPU machine (a buffer copy: ~4 µs), and a
    training step records dozens of copies on lavapipe. -> [buffer, texture, [(source, target, size)]]."""
    from wgpu.backends.wgpu_native._api import lib, new_struct, new_struct_p

    row_bytes = 16 * TEXTURE_ROW
    full, tail = divmod(nbytes, row_bytes)
    parts = []  # (first texture row, first byte, texels a row, rows)
    if full:
        parts.append((0, offset, TEXTURE_ROW, full))
    if tail:
        parts.append((full, offset + full * row_bytes, -(-tail // 16), 1))
    copies = []
    for row, start, width, rows in parts:
        source = new_struct_p("WGPUTexelCopyBufferInfo *", buffer=buffer._internal,
                              layout=new_struct("WGPUTexelCopyBufferLayout", offset=start, bytesPerRow=row_bytes,
                                                rowsPerImage=rows))
        target = new_struct_p("WGPUTexelCopyTextureInfo *", texture=texture._internal, mipLevel=0,
                              origin=new_struct("WGPUOrigin3D", x=0, y=row, z=0), aspect=lib.WGPUTextureAspect_All)
        size = new_struct_p("WGPUExtent3D *", width=width, height=rows, depthOrArrayLayers=1)
        copies.append((source, target, size))
    return [buffer, texture, copies]  # the objects too: the structs hold only their handles


def _copy_to_texture(encoder, copies: list) -> None:
    """Record a tensor's copies into its texture (`_texture_copies`)."""
    from wgpu.backends.wgpu_native._api import libf

    for source, target, size in copies[2]:
        libf.wgpuCommandEncoderCopyBufferToTexture(encoder._internal, source, target, size)


class _ComputePass:
    """An untimed compute pass recorded through wgpu-native's C calls: wgpu's Python methods cost ~32 µs a pass
    (begin and end) and ~18 µs a set_bind_group on this project's CPU machine, where a training step records
    dozens of passes and a hundred dispatches and lavapipe runs nothing while the host records."""

    _descriptor = None  # WGPUComputePassDescriptor without a label or timestamps, built once

    def __init__(self, encoder):
        from wgpu.backends.wgpu_native._api import ffi, libf, new_struct_p, to_c_string_view

        if _ComputePass._descriptor is None:
            _ComputePass._descriptor = new_struct_p("WGPUComputePassDescriptor *", label=to_c_string_view(""),
                                                    timestampWrites=ffi.NULL)
        self._ffi, self._libf = ffi, libf
        self._handle = libf.wgpuCommandEncoderBeginComputePass(encoder._internal, _ComputePass._descriptor)

    def dispatch(self, pipeline, bind_group, offsets, groups) -> None:
        libf, handle = self._libf, self._handle
        libf.wgpuComputePassEncoderSetPipeline(handle, pipeline._internal)
        libf.wgpuComputePassEncoderSetBindGroup(handle, 0, bind_group._internal, len(offsets),
                                                self._ffi.new("uint32_t[]", offsets))
        libf.wgpuComputePassEncoderDispatchWorkgroups(handle, *groups)

    def end(self) -> None:
        self._libf.wgpuComputePassEncoderEnd(self._handle)
        self._libf.wgpuComputePassEncoderRelease(self._handle)


class Runtime:
    def __init__(self, device: str | int | None = None):
        self.adapter, self.info = device_mod.choose_adapter(device)
        self.device, self.features = device_mod.create_device(self.adapter)
        self.limits = dict(self.device.limits)
        self.max_binding = int(self.limits["max-storage-buffer-binding-size"])
        self.max_groups = int(self.limits["max-compute-workgroups-per-dimension"])
        self.pool = BufferPool(self.device)
        self._shader_modules: dict[tuple[str, bool], object] = {}  # (module, with its subgroup functions)
        self._pipelines: dict[tuple, tuple] = {}
        self._recipes: dict = {}  # run()'s per-(entry, constants) cache (_recipe)
        self._uniforms = self.device.create_buffer(
            size=_UNIFORM_SLOT * _UNIFORM_SLOTS, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
        )
        self._uniform_bytes = bytearray()
        self._pending: list[tuple] = []
        self._submit_after = FIRST_SUBMIT  # dispatches in the next batch
        # (layout, bound buffers) -> (bind group, the buffers: kept so their ids stay theirs)
        self._bind_groups: dict[tuple, tuple] = {}
        # (id(buffer), byte offset, bytes) of a tensor read through a texture -> [texture, view, the buffer's write
        # count when it was copied in]; id(buffer) -> its write count (the pool keeps every buffer, so ids stay theirs)
        self._textures: dict[tuple[int, int, int], list] = {}
        self._writes: dict[int, int] = {}
        self._unread = None
        self._write_count = 0
        self._fence = None
        # Tests set this: every new tensor starts as NaN, so an element a kernel forgets to write fails.
        self.poison = False
        # The GEMMs' precision when an op does not say ("fp32" or "f16", see ops/linear.py); the training loop
        # sets it from [train] matmul_precision, so the models need no per-mode code.
        self.matmul_precision = "fp32"
        self.submits = 0  # counted so tests and benchmarks can check "a handful of submits per step"
        # Set to a list to time every dispatch on the GPU (bench/profile_step.py): each flush then appends
        # (entry, constants, nanoseconds) per dispatch, read back with timestamp queries (a host round trip).
        self.gpu_times: list | None = None
        self._queries = None
        self._subgroup_size: int | None = None
        self._graph: Graph | None = None  # being captured

    @property
    def subgroup_size(self) -> int:
        """Lanes per subgroup in compute shaders (0 without the subgroup feature), measured once by a probe
        dispatch: kernels that share loads through fixed lane numbers (matmul_subgroup) need exactly 8."""
        if self._subgroup_size is None:
            size = 0
            if "subgroup" in self.features:
                out = self.empty((4,))
                self.run("subgroup_size_probe", (1,), c=out)
                size = int(self.read(out)[0])
            self._subgroup_size = size
        return self._subgroup_size

    # pipelines --------------------------------------------------------------------------------------
    def pipeline(self, entry: str, constants: dict | None = None):
        """Compile (once per process) the entry point's module and pipeline, with an explicit layout."""
        key = (entry, tuple(sorted((constants or {}).items())))
        if key not in self._pipelines:
            ep = entry_point(entry)
            missing = [f for f in ep.features if f not in self.features]
            if missing:
                raise MambactlError(f"{entry} needs the adapter feature {', '.join(missing)}, which {self.info.name} "
                                    f"({self.info.backend}) does not offer")
            # A module's subgroup functions are compiled only for the entry points that use them (the CPU
            # adapters' kernels): every other entry gets the module without them, the code GPUs were measured with.
            module_key = (ep.module, "subgroup" in ep.features)
            if module_key not in self._shader_modules:
                self._shader_modules[module_key] = _shader_module(
                    self.device, ep.module, all_modules()[ep.module].source_for(ep.features), SHADER_RUNTIME_CHECKS
                )
            bgl = self.device.create_bind_group_layout(
                entries=[
                    {"binding": b.number, "visibility": wgpu.ShaderStage.COMPUTE, **_BIND_TYPE[b.kind]}
                    for b in ep.bindings
                ]
            )
            layout = self.device.create_pipeline_layout(bind_group_layouts=[bgl])
            stage = {"module": self._shader_modules[module_key], "entry_point": entry}
            if constants:
                stage["constants"] = {k: float(v) for k, v in constants.items()}
            pipe = self.device.create_compute_pipeline(label=entry, layout=layout, compute=stage)
            self._pipelines[key] = (pipe, bgl, ep)
        return self._pipelines[key]

    # recording --------------------------------------------------------------------------------------
    def _recipe(self, entry: str, constants: dict | None) -> tuple:
        """What `run` needs per (entry, constants as given), cached: a training step records ~80 dispatches and
        on a 2-core CPU adapter the host's Python per dispatch is part of every step (the adapter runs a
        submit on the submitting thread's time; docs/architecture.md). -> (pipeline, layout, entry point, its
        bindings as (name, kind), the uniform fields' names, their struct packer, the slot's padding)."""
        key = (entry, tuple(constants.items())) if constants else entry
        recipe = self._recipes.get(key)
        if recipe is None:
            pipe, bgl, ep = self.pipeline(entry, constants)
            packer = struct.Struct("<" + "".join(_PACK[t] for _, t in ep.params))
            recipe = self._recipes[key] = (pipe, bgl, ep, tuple((b.name, b.kind) for b in ep.bindings),
                                           tuple(name for name, _ in ep.params), packer,
                                           bytes(_UNIFORM_SLOT - packer.size))
        return recipe

    def run(self, entry: str, groups, constants: dict | None = None, **args) -> None:
        """Record one dispatch. `args` names every buffer (Tensor) and uniform field (number) it uses."""
        pipe, bgl, ep, bindings, fields, packer, pad = self._recipe(entry, constants)
        groups = tuple(int(g) for g in groups) + (1,) * (3 - len(groups))
        if min(groups) < 1 or max(groups) > self.max_groups:
            raise ShapeError(f"{entry}: workgroup grid {groups} outside [1, {self.max_groups}] per dimension")
        slots, buffers, key, written = 0, [], [id(bgl)], []
        for name, kind in bindings:
            if kind == "uniform":
                if not slots:
                    try:
                        values = [args[f] for f in fields]
                    except KeyError as e:
                        raise ShapeError(f"{entry}: uniform parameter {e.args[0]!r} not given") from None
                    uniform_slot = packer.pack(*values) + pad
                slots += 1
                buffers.append(self._uniforms)
                key.append(id(self._uniforms))
                continue
            t = args.get(name)
            if kind == "texture" and t is None and name in args:  # a kernel whose constants leave it unread
                view = self._unread_texture()
                buffers.append(view)
                key.append(id(view))
                continue
            if not isinstance(t, Tensor):
                raise ShapeError(f"{entry}: buffer {name!r} not given (got {type(t).__name__})")
            nbytes = t.nbytes
            if nbytes > self.max_binding:
                raise ShapeError(
                    f"{entry}: tensor {name!r} {t.shape} is {nbytes} bytes, over this device's storage binding "
                    f"limit of {self.max_binding} bytes"
                )
            buf = t.buffer
            if kind == "texture":
                view = self._texture(entry, name, t)
                buffers.append(view)
                key.append(id(view))
                continue
            if kind == "read_write":
                written.append(buf)
            # A pooled tensor binds its whole buffer; a view at an offset (an Arena's) binds its own bytes, so a
            # small view of a large buffer stays inside the storage binding limit.
            size = buf.size
            if t.offset or size > self.max_binding:
                size = max(4, nbytes)
            buffers.append((buf, t.offset, size))
            key += (id(buf), t.offset, size)
        label = (entry, constants)  # read only when gpu_times is on (and kept by a graph, which may be replayed then)
        command = ("dispatch", pipe, self._bind_group(bgl, ep, buffers, tuple(key)), uniform_slot * slots if slots else b"",
                   slots, groups, label)
        self._queue(command)
        self._wrote(*written)

    def _wrote(self, *buffers) -> None:
        """Count a recorded write to these buffers (their textures' copies are then out of date)."""
        self._write_count += 1
        for buf in buffers:
            self._writes[id(buf)] = self._write_count

    def fits_texture(self, *tensors: Tensor) -> bool:
        """Whether a kernel can read every one of `tensors` through a texture: its rows fit the device's 2-D
        texture limit and its bytes start on a texel (16 bytes) and, rounded up to whole texels, lie inside its
        buffer."""
        limit = int(self.limits["max-texture-dimension-2d"])
        return all(_texture_rows(t.nbytes) <= limit and t.offset % 16 == 0
                   and t.offset + -(-t.nbytes // 16) * 16 <= t.buffer.size for t in tensors)

    def _unread_texture(self):
        """A 1-texel texture to bind where a kernel's pipeline constants leave a texture binding unread (`x_tex=None`:
        conv1d's walks read buffers on GPUs, textures on CPU adapters)."""
        if self._unread is None:
            texture = self.device.create_texture(size=(1, 1, 1), format=wgpu.TextureFormat.rgba32float,
                                                 usage=wgpu.TextureUsage.TEXTURE_BINDING)
            self._unread = (texture, texture.create_view())
        return self._unread[1]

    def _texture(self, entry: str, name: str, t: Tensor):
        """The view of t's texture, with its copy recorded unless the texture holds t's bytes already (always while
        capturing: a replay must copy what the host wrote between replays)."""
        key = (id(t.buffer), t.offset, t.nbytes)
        hit = self._textures.get(key)
        if hit is None:
            if not self.fits_texture(t):
                raise ShapeError(f"{entry}: tensor {name!r} {t.shape} cannot be read through a texture on this device")
            if len(self._textures) >= _TEXTURE_CACHE:
                self._textures.clear()
            texture = self.device.create_texture(size=(TEXTURE_ROW, _texture_rows(t.nbytes), 1),
                                                 format=wgpu.TextureFormat.rgba32float,
                                                 usage=wgpu.TextureUsage.TEXTURE_BINDING | wgpu.TextureUsage.COPY_DST)
            hit = self._textures[key] = [texture, texture.create_view(), -1,
                                         _texture_copies(t.buffer, t.offset, t.nbytes, texture)]
        count = self._writes.get(key[0], 0)
        if hit[2] != count or self._graph is not None:
            self._queue(("texture", hit[3]))
            hit[2] = count
        return hit[1]

    def _queue(self, command: tuple) -> None:
        """Record a command, and keep it in the graph being captured if there is one."""
        if self._graph is not None:
            self._graph.commands.append(command)
        self._record(command)

    def _record(self, command: tuple) -> None:
        """Queue a dispatch ("dispatch", pipeline, bind group, uniform bytes, uniform slots, grid, label) or a copy;
        the uniform bytes go into this batch's ring, which the dispatch binds at their offsets."""
        if command[0] == "dispatch":
            _, pipe, bind_group, uniform_bytes, slots, groups, label = command
            if len(self._uniform_bytes) // _UNIFORM_SLOT + slots > _UNIFORM_SLOTS:
                self.flush()
            base = len(self._uniform_bytes)
            self._uniform_bytes += uniform_bytes
            command = ("dispatch", pipe, bind_group, [base + i * _UNIFORM_SLOT for i in range(slots)], groups, label)
        self._pending.append(command)
        if len(self._pending) >= self._submit_after:
            self.flush()

    @contextlib.contextmanager
    def capture(self):
        """Record what the block queues into a Graph (yielded) while it runs as usual. The block may not write,
        fill or read tensors (a replay would not repeat that host side): inputs go into tensors made before it
        and written between replays, outputs are read after it."""
        if self._graph is not None:
            raise MambactlError("capture: already capturing")
        self.subgroup_size  # the ops' one probe that reads back, run before (kernel choices depend on it)
        graph = self._graph = Graph()
        try:
            yield graph
        finally:
            self._graph = None

    def replay(self, graph: Graph) -> None:
        """Queue a captured graph's dispatches and copies again, in order (on the same buffers)."""
        for command in graph.commands:
            self._record(command)
        for hit in self._textures.values():  # whatever the graph wrote, no texture is known to be current
            hit[2] = -1

    def _bind_group(self, bgl, ep, buffers: list, key: tuple):
        """`buffers`: per binding, the uniform ring or a tensor's (buffer, byte offset, bytes bound); `key`
        names them (the layout's id, then the ring's id or each buffer's id, offset and size)."""
        hit = self._bind_groups.get(key)
        if hit is None:
            if len(self._bind_groups) >= _BIND_GROUP_CACHE:
                self._bind_groups.clear()
            entries = []
            for b, bound in zip(ep.bindings, buffers):
                if b.kind == "texture":
                    entries.append({"binding": b.number, "resource": bound})
                    continue
                if b.kind == "uniform":
                    entries.append({"binding": b.number, "resource": {"buffer": bound, "offset": 0,
                                                                      "size": _UNIFORM_SLOT}})
                    continue
                buf, offset, size = bound
                entries.append({"binding": b.number, "resource": {"buffer": buf, "offset": offset, "size": size}})
            hit = self._bind_groups[key] = (self.device.create_bind_group(layout=bgl, entries=entries), buffers)
        return hit[0]

    def copy(self, src: Tensor, dst: Tensor, nbytes: int | None = None, src_offset: int = 0, dst_offset: int = 0) -> None:
        """Record a buffer-to-buffer copy (ordered with the dispatches around it)."""
        n = src.nbytes if nbytes is None else nbytes
        self._queue(("copy", src.buffer, src.offset + src_offset, dst.buffer, dst.offset + dst_offset, n))
        self._wrote(dst.buffer)

    def clear(self, t: Tensor) -> None:
        """Record zeroing t's bytes as a buffer clear (wgpu's clear_buffer: a memset on Mesa lavapipe, where the fill
        kernel's per-lane stores took 0.45 ms for the tiny model's 98k gradients), ordered with the dispatches."""
        self._queue(("clear", t.buffer, t.offset, t.nbytes))
        self._wrote(t.buffer)

    def flush(self) -> None:
        """Submit everything recorded so far as one command buffer (compute passes split only by copies and clears)."""
        if not self._pending:
            return
        if self._uniform_bytes:
            self.device.queue.write_buffer(self._uniforms, 0, bytes(self._uniform_bytes))
        timed = self.gpu_times is not None and "timestamp-query" in self.features
        encoder = self.device.create_command_encoder()
        cpass, labels = None, []
        for cmd in self._pending:
            if cmd[0] == "dispatch":
                _, pipe, bind_group, offsets, groups, label = cmd
                if timed:  # one pass per dispatch, so the pass's timestamps are the dispatch's
                    tpass = encoder.begin_compute_pass(timestamp_writes=self._timestamp_writes(len(labels)))
                    tpass.set_pipeline(pipe)
                    tpass.set_bind_group(0, bind_group, offsets)
                    tpass.dispatch_workgroups(*groups)
                    tpass.end()
                    labels.append(label)
                    continue
                if cpass is None:
                    cpass = _ComputePass(encoder)
                cpass.dispatch(pipe, bind_group, offsets, groups)
            else:
                if cpass is not None:
                    cpass.end()
                    cpass = None
                if cmd[0] == "texture":
                    _copy_to_texture(encoder, cmd[1])
                    continue
                if cmd[0] == "clear":
                    encoder.clear_buffer(cmd[1], cmd[2], cmd[3])
                    continue
                _, src, so, dst, do, n = cmd
                encoder.copy_buffer_to_buffer(src, so, dst, do, n)
        if cpass is not None:
            cpass.end()
        if labels:
            queries, resolved = self._queries
            encoder.resolve_query_set(queries, 0, 2 * len(labels), resolved, 0)
        self.device.queue.submit([encoder.finish()])
        self.submits += 1
        self._submit_after = min(DISPATCHES_PER_SUBMIT, max(FIRST_SUBMIT, 2 * len(self._pending)))
        self._pending.clear()
        self._uniform_bytes = bytearray()
        if labels:
            ticks = np.frombuffer(self.device.queue.read_buffer(self._queries[1], 0, 16 * len(labels)), np.uint64)
            self.gpu_times.extend((entry, constants, int(end) - int(begin))
                                  for (entry, constants), begin, end in zip(labels, ticks[0::2], ticks[1::2]))

    def _timestamp_writes(self, i: int) -> dict:
        if self._queries is None:
            n = 2 * (DISPATCHES_PER_SUBMIT + 1)
            self._queries = (self.device.create_query_set(type=wgpu.QueryType.timestamp, count=n),
                             self.device.create_buffer(size=8 * n, usage=wgpu.BufferUsage.QUERY_RESOLVE
                                                       | wgpu.BufferUsage.COPY_SRC))
        return {"query_set": self._queries[0], "beginning_of_pass_write_index": 2 * i,
                "end_of_pass_write_index": 2 * i + 1}

    def sync(self) -> None:
        """Flush and wait until the GPU has finished (for timing)."""
        self.flush()
        # A 4-byte readback waits for all submitted work (wgpu 0.32's on_submitted_work_done is broken).
        if self._fence is None:
            self._fence = self.empty((1,))
        self.read(self._fence)

    # tensors ----------------------------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32) -> Tensor:
        dtype = np.dtype(dtype)
        if dtype not in DTYPES:
            raise ShapeError(f"unsupported dtype {dtype}; mambactl tensors are float32, int32 or uint32")
        n = math.prod(int(s) for s in shape) * 4
        if n > int(self.limits["max-buffer-size"]):
            raise ShapeError(f"tensor {tuple(shape)} needs {n} bytes, over this device's max buffer size")
        t = Tensor(self, self.pool.acquire(n), shape, dtype)
        if self._graph is not None:
            self._graph.tensors.append(t)
        if self.poison and t.size:
            self.run("fill", grid_1d(t.size), dst=t, n=t.size, value=float("nan"))
        return t

    def from_numpy(self, array) -> Tensor:
        array = np.ascontiguousarray(array)
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        elif array.dtype == np.int64:
            array = array.astype(np.int32)
        t = self.empty(array.shape, array.dtype)
        self.write(t, array)
        return t

    def write(self, t: Tensor, array) -> None:
        # queue.write_buffer runs before any later submit; flush first so a pooled buffer that
        # recorded-but-unsubmitted work still reads is not overwritten early.
        self._not_capturing("write")
        self.flush()
        data = np.ascontiguousarray(array, dtype=t.dtype)
        if data.size != t.size:
            raise ShapeError(f"write: array of {data.size} elements into a tensor of {t.size}")
        if data.size:
            self.device.queue.write_buffer(t.buffer, t.offset, data.tobytes())
            self._wrote(t.buffer)

    def read(self, t: Tensor) -> np.ndarray:
        self._not_capturing("read")
        self.flush()
        self._submit_after = FIRST_SUBMIT  # the readback drains the GPU: start it again soon
        if t.size == 0:
            return np.zeros(t.shape, t.dtype)
        mem = self.device.queue.read_buffer(t.buffer, t.offset, t.nbytes)
        return np.frombuffer(mem, dtype=t.dtype).reshape(t.shape).copy()

    def _not_capturing(self, what: str) -> None:
        if self._graph is not None:
            raise MambactlError(f"{what}: host transfers cannot be captured in a graph (runtime.capture)")

    def fill(self, t: Tensor, value: float) -> None:
        """Set every element (e.g. NaN to poison outputs in tests, 0 to reset gradient accumulators)."""
        self.write(t, np.full(t.shape, value, dtype=t.dtype))


_RUNTIMES: dict = {}


def get_runtime(device: str | int | None = None) -> Runtime:
    """The process-wide runtime for a device spec (None: MAMBACTL_DEVICE or the best adapter)."""
    key = device if device not in ("", None) else None
    if key not in _RUNTIMES:
        _RUNTIMES[key] = Runtime(key)
    return _RUNTIMES[key]
