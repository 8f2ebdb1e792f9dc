// RMSNorm over the last dim: y = x · rstd · w with rstd = 1 / sqrt(mean(x²) + eps), eps a parameter
// (1e-5 is the Mamba default). One 64-thread workgroup per row; rows on a 2-D grid. The *_rows entry points
// (CPU adapters) do the same with one invocation per row and no barriers.

struct Params { rows: u32, dim: u32, eps: f32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> dy: array<f32>;
@group(0) @binding(4) var<storage, read> rstd_in: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;
@group(0) @binding(6) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(7) var<storage, read_write> dx: array<f32>;
@group(0) @binding(8) var<storage, read_write> dw_rows: array<f32>;

var<workgroup> partial: array<f32, 64>;

// Tree sum of one value per thread; every thread gets the total.
fn workgroup_sum(v: f32, t: u32) -> f32 {
    partial[t] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (t < s) { partial[t] += partial[t + s]; }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(64)
fn rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) { return; }  // uniform per workgroup, so the barriers below stay uniform
    let base = row * p.dim;
    var ss = 0.0;
    for (var i = lid.x; i < p.dim; i += 64u) { let v = x[base + i]; ss += v * v; }
    let r = 1.0 / sqrt(workgroup_sum(ss, lid.x) / f32(p.dim) + p.eps);
    for (var i = lid.x; i < p.dim; i += 64u) { y[base + i] = x[base + i] * r * w[i]; }
    if (lid.x == 0u) { rstd[row] = r; }
}

// dx = rstd·(dy·w) − x·rstd³·mean(dy·w·x); dw_rows = dy·x·rstd, the per-row terms of dw, which
// ops.reduce.column_sums then sums over rows in blocks.
@compute @workgroup_size(64)
fn rmsnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) { return; }
    let base = row * p.dim;
    let r = rstd_in[row];
    var s = 0.0;
    for (var i = lid.x; i < p.dim; i += 64u) { s += dy[base + i] * w[i] * x[base + i]; }
    let c = r * r * r * workgroup_sum(s, lid.x) / f32(p.dim);
    for (var i = lid.x; i < p.dim; i += 64u) {
        dx[base + i] = r * dy[base + i] * w[i] - x[base + i] * c;
        dw_rows[base + i] = dy[base + i] * x[base + i] * r;
    }
}

// CPU adapters (Mesa llvmpipe runs a workgroup as SIMD loops on one thread; each barrier of workgroup_sum is a
// coroutine switch, ~2 ms per call at 512 rows of 64): one invocation per row, walking it in a loop.
// Grid grid_1d(rows, 64).
@compute @workgroup_size(64)
fn rmsnorm_forward_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = gid.y * nwg.x * 64u + gid.x;
    if (row >= p.rows) { return; }
    let base = row * p.dim;
    var ss = 0.0;
    for (var i = 0u; i < p.dim; i++) { let v = x[base + i]; ss += v * v; }
    let r = 1.0 / sqrt(ss / f32(p.dim) + p.eps);
    for (var i = 0u; i < p.dim; i++) { y[base + i] = x[base + i] * r * w[i]; }
    rstd[row] = r;
}

@compute @workgroup_size(64)
fn rmsnorm_backward_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = gid.y * nwg.x * 64u + gid.x;
    if (row >= p.rows) { return; }
    let base = row * p.dim;
    let r = rstd_in[row];
    var s = 0.0;
    for (var i = 0u; i < p.dim; i++) { s += dy[base + i] * w[i] * x[base + i]; }
    let c = r * r * r * s / f32(p.dim);
    for (var i = 0u; i < p.dim; i++) {
        let g = dy[base + i];
        let v = x[base + i];
        dx[base + i] = r * g * w[i] - v * c;
        dw_rows[base + i] = g * v * r;
    }
}
