"""Data-parallel training over MPI (mpi4py; `pip install 'mambactl[mpi]'`): `mpirun -n N mambactl train CONFIG`.

`init()` is called at the top of `train.loop.train`. Outside an MPI launcher (no launcher variables in the
environment) it returns None without importing mpi4py, and training is exactly the single-process path; the
same when the job has a single rank. Otherwise it returns a `Distributed` and the loop uses its hooks:

- each rank opens its own adapter (`device_spec`): the local rank's GPU among the host's best adapters, all ranks
  on the one software adapter of a CPU-only machine, or `--device` / `train.device` / `MAMBACTL_DEVICE` (a
  comma-separated list is indexed by the local rank: `--device 0,1,2,3`);
- every rank draws the whole global batch from the same seeded sampler and keeps its contiguous share of the rows
  (`shard`), so the sampler state, the global batch, the learning rate and the loss curve are those of one process
  with the same config; the gradient of each rank is scaled by the GLOBAL target count, so the sum over ranks is
  the gradient of the global mean loss;
- `GradReducer.allreduce()` sums the gradients over ranks (MPI_SUM from host buffers, several parameter tensors
  per bucket, one `Iallreduce` per bucket started as soon as its readback is done, so the reduction of a bucket
  overlaps the readback of the next) and writes them back into the GPU gradient tensors before the optimizer
  computes the global norm;
- `run()` turns an exception on any rank into one line `error: rank N: ...` on stderr and MPI_Abort, so the whole
  job exits non-zero instead of hanging in a collective.

Test-only hook: MAMBACTL_TEST_FAIL_RANK=R (with MAMBACTL_TEST_FAIL_STEP=S, default 1) makes rank R raise before
update S; tests/test_distributed.py uses it to check that a failing rank ends the job.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

from mambactl.errors import MambactlError

# Environment variables MPI launchers set on every rank, with the number of ranks in the job
# (Open MPI, MPICH/Intel MPI Hydra and PMI-2 (also srun --mpi=pmi2), MVAPICH).
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# Set by PMIx launchers (srun --mpi=pmix, prterun) that may not set a size variable.
_RANK_VARS = ("PMIX_RANK", "PMI_RANK")
BUCKET_BYTES = int(float(os.environ.get("MAMBACTL_BUCKET_MB", "25")) * 2**20)
FAIL_RANK_VAR, FAIL_STEP_VAR = "MAMBACTL_TEST_FAIL_RANK", "MAMBACTL_TEST_FAIL_STEP"
_CPU = "CPU"


def launched_size() -> int | None:
    """The job size an MPI launcher announced in the environment; 0 when a launcher is seen without one; None
    when there is no launcher."""
    for var in _SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0 if any(var in os.environ for var in _RANK_VARS) else None


def init() -> "Distributed | None":
    """A Distributed for a job of two or more MPI ranks, else None (the single-process path; mpi4py is not
    even imported outside a launcher)."""
    size = launched_size()
    if size is None or size == 1:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        if size == 0:  # a PMIx variable alone is not proof of a multi-rank job
            return None
        raise MambactlError(f"launched by an MPI launcher with {size} ranks, but mpi4py is not installed; "
                            f"install it with `pip install 'mambactl[mpi]'` (it needs an MPI library, e.g. "
                            f"Debian's openmpi-bin libopenmpi-dev)") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        return None
    return Distributed(MPI, comm)


class Distributed:
    """This rank's place in the job and the collectives the training loop needs."""

    def __init__(self, mpi, comm):
        self.MPI, self.comm = mpi, comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        local = comm.Split_type(mpi.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()
        self.is_main = self.rank == 0
        fail = os.environ.get(FAIL_RANK_VAR, "")
        self._fail_rank = int(fail) if fail.strip().lstrip("-").isdigit() else None
        self._fail_step = int(os.environ.get(FAIL_STEP_VAR, "1") or 1)

    # failure handling -------------------------------------------------------------------------------------
    def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on this rank; any exception prints `error: rank N: ...` and aborts the whole job
        (MPI_Abort), so the other ranks never wait forever in a collective. All ranks leave together."""
        if not self.is_main:
            # Rank 0 alone prints progress and the summary; errors still reach stderr.
            sys.stdout = open(os.devnull, "w")
        try:
            result = fn(*args, **kwargs)
            self.comm.Barrier()
            return result
        except BaseException as exc:  # noqa: BLE001 - every failure must end the job, not hang it
            self.abort(exc)

    def abort(self, exc: BaseException) -> None:
        if isinstance(exc, MambactlError):
            text = str(exc)
        elif isinstance(exc, KeyboardInterrupt):
            text = "interrupted"
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            text = f"internal {type(exc).__name__}: {first}"
        try:
            sys.stderr.write(f"error: rank {self.rank} (of {self.world}): {text}; aborting the job\n")
            sys.stderr.flush()
        finally:
            self.comm.Abort(1)

    def check_test_failure(self, step: int) -> None:
        """The test-only failure hook (see the module docstring)."""
        if self._fail_rank == self.rank and step + 1 == self._fail_step:
            raise RuntimeError(f"test failure injected by {FAIL_RANK_VAR}={self.rank} before update {step + 1}")

    # setup ------------------------------------------------------------------------------------------------
    def device_spec(self, configured: str) -> str:
        """The adapter this rank opens: `configured` (train.device / --device), else MAMBACTL_DEVICE, else the
        local rank's GPU. A comma-separated spec is indexed by the local rank."""
        spec = configured if configured != "auto" else os.environ.get("MAMBACTL_DEVICE", "").strip() or "auto"
        if spec != "auto":
            choices = [s.strip() for s in spec.split(",") if s.strip()]
            if not choices:
                raise MambactlError(f"device {spec!r}: no adapter named")
            return choices[self.local_rank % len(choices)]
        from mambactl.runtime import device as device_mod

        infos = device_mod.list_adapters()
        if not infos:
            raise MambactlError(device_mod.NO_ADAPTER_HELP)
        best = min(infos, key=device_mod._rank)
        if best.type == _CPU:  # a CPU-only machine: every rank shares the software adapter
            return str(best.index)
        gpus = sorted((i for i in infos if i.type == best.type and i.backend == best.backend), key=lambda i: i.index)
        if self.local_size > len(gpus) and self.local_rank == 0:
            sys.stderr.write(f"warning: {self.local_size} ranks on this host share {len(gpus)} {best.type} "
                             f"adapter(s); launch one rank per GPU\n")
        return str(gpus[self.local_rank % len(gpus)].index)

    def check_batch(self, batch_size: int) -> None:
        if batch_size < self.world:
            raise MambactlError(f"train.batch_size {batch_size} is the global batch and must be at least the number "
                                f"of ranks ({self.world}), so that every rank gets a row")

    def bcast(self, obj, root: int = 0):
        return self.comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self.comm.Barrier()

    def agree(self, what: str, value) -> None:
        """Raise on every rank whose `value` differs from rank 0's (e.g. a config or data that differ by host)."""
        digest = hashlib.sha256(repr(value).encode()).hexdigest()
        digests = self.comm.allgather(digest)
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if self.rank in bad:
            raise MambactlError(f"this rank's {what} differs from rank 0's (ranks {bad} differ); give every rank "
                                f"the same config and data")

    def allgather(self, obj) -> list:
        return self.comm.allgather(obj)

    # per-step work ----------------------------------------------------------------------------------------
    def rows(self, batch_size: int) -> slice:
        """This rank's contiguous share of the global batch's rows (np.array_split's split)."""
        base, extra = divmod(batch_size, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def shard(self, batch: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        ids, targets = batch
        rows = self.rows(len(ids))
        return np.ascontiguousarray(ids[rows]), np.ascontiguousarray(targets[rows])

    def sum(self, values) -> np.ndarray:
        """Element-wise float64 sum over ranks (small host vectors: losses, counts)."""
        buf = np.ascontiguousarray(values, dtype=np.float64)
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return buf


class GradReducer:
    """Sums gradient tensors over the ranks in place: grads[i] <- Σ_ranks grads[i].

    Gradients are grouped in order into buckets of at most BUCKET_BYTES (a larger tensor is a bucket alone).
    A bucket of several tensors is gathered into one GPU staging buffer with buffer copies and read back in one
    transfer; each bucket's Iallreduce starts as soon as its host copy exists, while the next bucket is read.
    After all reductions complete, the sums are written back (through the staging buffer) into the gradient
    tensors, recorded ahead of whatever the caller records next (the optimizer's norm and update).
    """

    def __init__(self, dist: Distributed, grads: list, bucket_bytes: int = BUCKET_BYTES):
        self.dist, self.grads = dist, list(grads)
        self.rt = self.grads[0].runtime
        self.buckets: list[list[int]] = []
        size = 0
        for i, g in enumerate(self.grads):
            if g.size == 0:
                continue
            if not self.buckets or size + g.nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += g.nbytes
        staged = [sum(self.grads[i].size for i in b) for b in self.buckets if len(b) > 1]
        self.staging = self.rt.empty((max(staged),)) if staged else None

    def _view(self, n: int):
        from mambactl.runtime.tensor import Tensor

        return Tensor(self.rt, self.staging.buffer, (n,), np.float32, owner=self.staging)

    def _read(self, bucket: list[int]) -> np.ndarray:
        if len(bucket) == 1:
            return self.rt.read(self.grads[bucket[0]]).reshape(-1)
        offset = 0
        for i in bucket:
            g = self.grads[i]
            self.rt.copy(g, self.staging, g.nbytes, 0, offset)
            offset += g.nbytes
        return self.rt.read(self._view(offset // 4))

    def _write(self, bucket: list[int], data: np.ndarray) -> None:
        if len(bucket) == 1:
            self.rt.write(self.grads[bucket[0]], data)
            return
        self.rt.write(self._view(data.size), data)
        offset = 0
        for i in bucket:
            g = self.grads[i]
            self.rt.copy(self.staging, g, g.nbytes, offset, 0)
            offset += g.nbytes

    def allreduce(self) -> None:
        MPI, comm = self.dist.MPI, self.dist.comm
        hosts, requests = [], []
        for bucket in self.buckets:
            host = np.ascontiguousarray(self._read(bucket), dtype=np.float32)
            hosts.append(host)
            requests.append(comm.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM))
            MPI.Request.Testall(requests)  # drive progress of the reductions in flight
        MPI.Request.Waitall(requests)
        for bucket, host in zip(self.buckets, hosts):
            self._write(bucket, host)
