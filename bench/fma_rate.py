"""Peak FMA rate of WGSL vec4<f32> and vec4<f16> arithmetic on this adapter (TFLOP/s; GPU wall clock, warm).

    python bench/fma_rate.py [--device D] [--iters 4096]

Each invocation runs `--iters` steps of 8 independent chains acc = fma(x, acc, y) on vec4s (64 FLOP per step),
the x operand broadcast from one component as matmul_f16's outer products do. Answers whether the driver turns
vec4<f16> FMAs into packed HFMA2 (then f16 runs at ~2x f32) — what the f16 GEMM mode's speed rests on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

SHADER = """
{enable}
struct Params {{ iters: u32 }}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    let i = gid.y * nwg.x * 256u + gid.x;
    let s = vec4<{t}>({t}(f32(i & 7u) * 0.001), {t}(0.25), {t}(0.5), {t}(0.75));
    let y = vec4<{t}>({t}(0.125));
    var a0 = s; var a1 = s.yzwx; var a2 = s.zwxy; var a3 = s.wxyz;
    var a4 = -s; var a5 = -s.yzwx; var a6 = -s.zwxy; var a7 = -s.wxyz;
    for (var k = 0u; k < p.iters; k++) {{
        let x = vec4<{t}>(a7.x);
        a0 = fma(x, a0, y); a1 = fma(x, a1, y); a2 = fma(x, a2, y); a3 = fma(x, a3, y);
        a4 = fma(x, a4, y); a5 = fma(x, a5, y); a6 = fma(x, a6, y); a7 = fma(vec4<{t}>(a0.y), a7, y);
    }}
    out[i] = vec4<f32>(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7);
}}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--iters", type=int, default=4096)
    p.add_argument("--groups", type=int, default=132 * 32)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import numpy as np
    import wgpu

    from mambactl.runtime.gpu import get_runtime

    rt = get_runtime(a.device)
    dev = rt.device
    print(f"{rt.info.name} ({rt.info.backend}), features {rt.features}")
    threads = a.groups * 256
    out = dev.create_buffer(size=threads * 16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    uni = dev.create_buffer_with_data(data=np.array([a.iters, 0, 0, 0], np.uint32).tobytes(),
                                      usage=wgpu.BufferUsage.UNIFORM)
    for t in ("f32", "f16"):
        if t == "f16" and "shader-f16" not in rt.features:
            print("f16: the adapter lacks shader-f16")
            continue
        module = dev.create_shader_module(code=SHADER.format(enable="enable f16;" if t == "f16" else "", t=t))
        pipe = dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": 0, "resource": {"buffer": uni, "offset": 0, "size": 16}},
            {"binding": 1, "resource": {"buffer": out, "offset": 0, "size": threads * 16}}])

        def run(n):
            enc = dev.create_command_encoder()
            cp = enc.begin_compute_pass()
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, bg)
            for _ in range(n):
                cp.dispatch_workgroups(a.groups)
            cp.end()
            dev.queue.submit([enc.finish()])
            dev.queue.read_buffer(out, 0, 16)

        run(1)
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            run(5)
            times.append((time.perf_counter() - t0) / 5)
        flops = 64.0 * a.iters * threads
        print(f"vec4<{t}> fma: {flops / statistics.median(times) / 1e12:.1f} TFLOP/s "
              f"({statistics.median(times) * 1e3:.2f} ms per dispatch of {flops / 1e9:.0f} GFLOP)")


if __name__ == "__main__":
    main()
