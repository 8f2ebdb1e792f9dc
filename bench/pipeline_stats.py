"""What the driver made of each compute pipeline of a training step: its statistics (registers, spills, shared
memory, instruction counts: whatever the driver reports) per entry point and pipeline constants.

    VK_LAYER_PATH=bench/pipeline_stats VK_INSTANCE_LAYERS=VK_LAYER_MAMBACTL_pipeline_stats \\
    MAMBACTL_PIPELINE_STATS=/tmp/stats.jsonl python bench/pipeline_stats.py [--arch mamba1|mamba2|mamba3|all]
        [--d-model 64 --layers 1 --vocab 512 --seq 64 --batch 8 --d-state 16] [--precision fp32,f16]
        [--stats NAME,...] [--device D] [--out FILE]

The statistics come from the Vulkan layer in bench/pipeline_stats/ (build it first: bench/pipeline_stats/build.sh),
which asks the driver for them (VK_KHR_pipeline_executable_properties) as each pipeline is created and appends
them to MAMBACTL_PIPELINE_STATS; the loader reads the variables above when the process starts, so this script
sets none of them. With MAMBACTL_PIPELINE_IR_DIR=DIR the layer also writes the driver's text representations
(NIR, machine code, ...) to DIR/<seq>_<entry>_<executable>_<representation>.txt, and with
MAMBACTL_PIPELINE_CACHE_DIR=DIR what the driver put in a pipeline cache of each pipeline's own, as
DIR/<seq>_<entry>.pipeline_cache.bin: on a driver without the extension the script then lists those files
(their sizes, and how many ELF headers each holds: NVIDIA's binaries might be cubins, for cuobjdump / nvdisasm).

Which pipelines: one LM training step per --arch (forward with the loss, backward, AdamW with clipping, as
bench/profile_step.py runs it) is recorded, entry point and constants of every dispatch, then each distinct
(entry, constants) is compiled once more in a fresh runtime, with the stats file's new lines after each joined
to it. The constants depend on the shape (GEMM tiles, raster order and K splits on M = batch·seq, N and K; the
weight transpose from 1024 rows; the SSD chunk and head splits on seq, batch and heads), not on the layer count:
for the 130m model's pipelines run --d-model 768 --layers 1 --vocab 50280 --seq 1024 --batch 8 --d-state 16 (or
128 for Mamba-2/3). --precision fp32,f16 records each step with f16 GEMMs (matmul_f16) as well.

Prints a table, entry[constants] | the recorded steps that use it | its dispatches in one step (the most of
them) | executable | subgroup size | the driver's statistics (names as it gives them; hashes left out unless
--stats names them), and with --out one JSON line per pipeline executable.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from common import add_set_option, apply_sets, header, model_config, pipeline_label, training_step  # first: it puts the checkout on sys.path


from mambactl.errors import MambactlError  # noqa: E402
from mambactl.runtime.gpu import Runtime  # noqa: E402

ARCHS = ("mamba1", "mamba2", "mamba3")
ENABLE = ("VK_LAYER_PATH=bench/pipeline_stats VK_INSTANCE_LAYERS=VK_LAYER_MAMBACTL_pipeline_stats "
          "MAMBACTL_PIPELINE_STATS=/tmp/x.jsonl")
PROBE_ENTRY = "fill"  # an entry point without constants, compiled first to see whether the layer answers


class StatsFile:
    """The layer's output: the lines this process appended since the last `new_lines`."""

    def __init__(self, path: str):
        self.path = path
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    def new_lines(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written stays for the next call
        self.offset += end
        lines = []
        for raw in data[:end].splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if line.get("pid") == os.getpid():  # another process may append to the same file
                lines.append(line)
        return lines


def record_step(args, arch: str, precision: str, dispatches: collections.Counter) -> None:
    """Run one training step of `arch` and count the dispatches per (entry, constants)."""
    rt = Runtime(args.device)
    rt.matmul_precision = precision
    run = rt.run

    def recording(entry, groups, constants=None, **kw):
        dispatches[(entry, tuple(sorted((constants or {}).items())))] += 1
        run(entry, groups, constants, **kw)

    rt.run = recording
    cfg = model_config([arch] * args.layers, args.d_model, args.vocab, args.d_state)
    training_step(rt, cfg, args.batch, args.seq)[0]()
    rt.sync()

class CacheDir:
    """MAMBACTL_PIPELINE_CACHE_DIR: the layer's pipeline cache dumps that appeared since the last `new_files`."""

    def __init__(self, path: str | None):
        self.path = path
        self.seen = self._names()

    def _names(self) -> set:
        return set(os.listdir(self.path)) if self.path and os.path.isdir(self.path) else set()

    def new_files(self) -> list[dict]:
        names = self._names()
        new, self.seen = sorted(names - self.seen), names
        out = []
        for name in new:
            data = open(os.path.join(self.path, name), "rb").read()
            out.append({"file": os.path.join(self.path, name), "bytes": len(data), "elf_headers": data.count(b"\x7fELF")})
        return out


def stat_text(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("d-model", 64), ("layers", 1), ("vocab", 512), ("seq", 64), ("batch", 8), ("d-state", 16)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--arch", default="all", choices=[*ARCHS, "all"], help="layer type of the recorded step(s)")
    p.add_argument("--precision", default="fp32", help="GEMM precision(s) of the recorded steps: fp32, f16 or both")
    p.add_argument("--stats", default="", help="only these statistics, comma-separated (default: all but hashes)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="also append one JSON line per pipeline executable to this file")
    add_set_option(p)
    a = p.parse_args()
    apply_sets(p, a.set)
    path = os.environ.get("MAMBACTL_PIPELINE_STATS")
    if not path:
        sys.exit(f"pipeline_stats.py: MAMBACTL_PIPELINE_STATS is not set; enable the layer when starting: {ENABLE} "
                 f"python bench/pipeline_stats.py")
    precisions = a.precision.split(",")
    archs = ARCHS if a.arch == "all" else (a.arch,)
    try:
        # The layer first: a runtime that compiles one pipeline, which must leave a line in the stats file (or,
        # on a driver without the extension, a pipeline cache dump where MAMBACTL_PIPELINE_CACHE_DIR is set).
        stats_file = StatsFile(path)
        compiler = Runtime(a.device)
        caches = CacheDir(os.environ.get("MAMBACTL_PIPELINE_CACHE_DIR"))
        stats_file.new_lines()  # whatever creating the device compiled (wgpu's own pipelines)
        compiler.pipeline(PROBE_ENTRY)
        have_stats = bool(stats_file.new_lines())
        if not have_stats and not caches.new_files():
            sys.exit(f"pipeline_stats.py: no statistics arrived in {path}: the layer is not loaded (enable it when "
                     f"starting: {ENABLE}, layer built by bench/pipeline_stats/build.sh), or the driver offers no "
                     f"VK_KHR_pipeline_executable_properties (then the layer said so on stderr above, and "
                     f"MAMBACTL_PIPELINE_CACHE_DIR=DIR still dumps the driver's pipeline caches)")
        compiler._pipelines.clear()  # each recorded pipeline is created anew below, the probe's too
        compiler._recipes.clear()

        dispatches: collections.Counter = collections.Counter()
        used_by: dict = collections.defaultdict(list)
        for arch in archs:
            for precision in precisions:
                step: collections.Counter = collections.Counter()
                record_step(a, arch, precision, step)
                for key, n in step.items():
                    dispatches[key] = max(dispatches[key], n)
                    used_by[key].append(arch if len(precisions) == 1 else f"{arch}/{precision}")
        stats_file.new_lines()  # the recorded steps' own pipelines
        caches.new_files()

        rows = []  # (key, the layer's line for one executable or {}, the key's pipeline cache dumps)
        for key in sorted(dispatches, key=lambda k: (k[0], pipeline_label(*k))):
            entry, constants = key
            compiler.pipeline(entry, dict(constants) or None)
            lines, dumps = stats_file.new_lines(), caches.new_files()
            for line in lines or [{"executable": "(no statistics)" if have_stats else "", "stats": {}}]:
                rows.append((key, line, dumps))
    except MambactlError as e:
        sys.exit(f"pipeline_stats.py: {e}")

    wanted = [s for s in a.stats.split(",") if s]
    names: list[str] = []
    for _, line, _ in rows:
        for name in line.get("stats", {}):
            if name not in names and (name in wanted if wanted else "hash" not in name.lower()):
                names.append(name)
    info = compiler.info
    print(f"{info.name} ({info.backend}, {info.driver}); {', '.join(archs)} at d_model {a.d_model}, d_state "
          f"{a.d_state}, batch {a.batch} x seq {a.seq}, vocab {a.vocab}; {len(dispatches)} pipelines")
    if have_stats:
        print(f"| pipeline | steps | dispatches | executable | subgroup | {' | '.join(names)} |")
        print("|---" * (5 + len(names)) + "|")
    else:
        print(f"no statistics from this driver; the pipeline cache dumps in {caches.path}:")
        print("| pipeline | steps | dispatches | cache dump | bytes | ELF headers in it |")
        print("|---" * 6 + "|")
    for key, line, dumps in rows:
        first = f"| {pipeline_label(*key)} | {','.join(used_by[key])} | {dispatches[key]} |"
        if have_stats:
            cells = [stat_text(line.get("stats", {}).get(n)) for n in names]
            print(f"{first} {line.get('executable', '')} | {line.get('subgroup_size', '')} | {' | '.join(cells)} |")
        else:
            for d in dumps or [{"file": "(none)", "bytes": "", "elf_headers": ""}]:
                print(f"{first} {os.path.basename(d['file'])} | {d['bytes']} | {d['elf_headers']} |")
    if a.out:
        head = header("pipeline_stats", info)
        shape = {"d_model": a.d_model, "layers": a.layers, "vocab": a.vocab, "seq": a.seq, "batch": a.batch,
                 "d_state": a.d_state}
        with open(a.out, "a", encoding="utf-8") as f:
            for key, line, dumps in rows:
                f.write(json.dumps({**head, **shape, "entry": key[0], "constants": dict(key[1]),
                                    "used_by": used_by[key], "dispatches": dispatches[key],
                                    "executable": line.get("executable"), "description": line.get("description"),
                                    "subgroup_size": line.get("subgroup_size"), "stats": line.get("stats", {}),
                                    "pipeline_cache": dumps}) + "\n")


if __name__ == "__main__":
    main()
