//! include texture
// RMSNorm over the last dim: y = x · rstd · w with rstd = 1 / sqrt(mean(x²) + eps), eps a parameter
// (1e-5 is the Mamba default). One WG-thread workgroup per row (forward) or per block of block_rows rows
// (backward); rows on a 2-D grid. The *_rows entry points (CPU adapters) do the same with one invocation per row
// (forward) or per block of rows (backward) and no barriers, reading their inputs through textures (texture.wgsl).
// With ADD the residual add around it is fused in (models/lm.py): the forward normalises h = x + residual and
// writes h too (the next layer's residual stream), the backward returns dx + add_to (the gradient reaching h from
// its other consumer), so the separate add kernels and their passes over [M, D] are gone.
// The weight gradient's per-row terms dy·x·rstd are summed over each block's rows in place (dw_part [blocks, D],
// each thread owning its columns, so no race), and ops.reduce.column_sums adds the blocks in a fixed order.

override ADD: bool = false;

struct Params { rows: u32, dim: u32, eps: f32, block_rows: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> dy: array<f32>;
@group(0) @binding(4) var<storage, read> rstd_in: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;
@group(0) @binding(6) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(7) var<storage, read_write> dx: array<f32>;
@group(0) @binding(8) var<storage, read_write> dw_part: array<f32>;
@group(0) @binding(9) var<storage, read> residual: array<f32>;  // ADD, forward
@group(0) @binding(10) var<storage, read_write> h: array<f32>;  // ADD, forward: x + residual
@group(0) @binding(11) var<storage, read> add_to: array<f32>;   // ADD, backward
@group(0) @binding(12) var x_tex: texture_2d<f32>;  // the *_rows entry points' x, w, dy, residual and add_to
@group(0) @binding(13) var w_tex: texture_2d<f32>;
@group(0) @binding(14) var dy_tex: texture_2d<f32>;
@group(0) @binding(15) var residual_tex: texture_2d<f32>;
@group(0) @binding(16) var add_to_tex: texture_2d<f32>;

// Threads per workgroup of the GPU kernels: 256, so the backward's blocks of rows (M / 8 workgroups) still fill a
// large GPU (1,024 × 64 threads left it a quarter occupied, at ~1 TB/s).
const WG: u32 = 256u;

var<workgroup> partial: array<f32, WG>;

// Tree sum of one value per thread; every thread gets the total.
fn workgroup_sum(v: f32, t: u32) -> f32 {
    partial[t] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (t < s) { partial[t] += partial[t + s]; }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

// The normalised input at element k: x, or with ADD x + residual, which it also stores (read back by `normed_at`).
fn input_at(k: u32) -> f32 {
    if (ADD) {
        let v = x[k] + residual[k];
        h[k] = v;
        return v;
    }
    return x[k];
}

fn normed_at(k: u32) -> f32 {
    if (ADD) { return h[k]; }
    return x[k];
}

// dx at element k (column i) of a row with rstd r and c = r³·mean(dy·w·x), from dy (g), x (v), w[i] and with ADD
// add_to[k] (extra); dw's term is added into its block.
fn backward_at(k: u32, i: u32, g: f32, v: f32, wi: f32, extra: f32, r: f32, c: f32, part: u32, first: bool) {
    var d = r * g * wi - v * c;
    if (ADD) { d += extra; }
    dx[k] = d;
    let term = g * v * r;
    if (first) { dw_part[part + i] = term; } else { dw_part[part + i] += term; }
}

@compute @workgroup_size(WG)
fn rmsnorm_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                   @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) { return; }  // uniform per workgroup, so the barriers below stay uniform
    let base = row * p.dim;
    var ss = 0.0;
    for (var i = lid.x; i < p.dim; i += WG) { let v = input_at(base + i); ss += v * v; }
    let r = 1.0 / sqrt(workgroup_sum(ss, lid.x) / f32(p.dim) + p.eps);
    for (var i = lid.x; i < p.dim; i += WG) { y[base + i] = normed_at(base + i) * r * w[i]; }
    if (lid.x == 0u) { rstd[row] = r; }
}

// dx = rstd·(dy·w) − x·rstd³·mean(dy·w·x) (+ add_to); dw_part[block] = Σ over the block's rows of dy·x·rstd.
@compute @workgroup_size(WG)
fn rmsnorm_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_id) lid: vec3<u32>) {
    let block = wid.y * nwg.x + wid.x;
    let row0 = block * p.block_rows;
    if (row0 >= p.rows) { return; }  // uniform per workgroup, as is every row loop below
    for (var row = row0; row < min(p.rows, row0 + p.block_rows); row++) {
        let base = row * p.dim;
        let r = rstd_in[row];
        var s = 0.0;
        for (var i = lid.x; i < p.dim; i += WG) { s += dy[base + i] * w[i] * x[base + i]; }
        let c = r * r * r * workgroup_sum(s, lid.x) / f32(p.dim);
        for (var i = lid.x; i < p.dim; i += WG) {
            let k = base + i;
            var extra = 0.0;
            if (ADD) { extra = add_to[k]; }
            backward_at(k, i, dy[k], x[k], w[i], extra, r, c, block * p.dim, row == row0);
        }
    }
}

// x (with ADD x + residual) at element k, through the textures.
fn input_texture(k: u32) -> f32 {
    if (ADD) { return texture_elem(x_tex, k) + texture_elem(residual_tex, k); }
    return texture_elem(x_tex, k);
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
    for (var i = 0u; i < p.dim; i++) {
        let v = input_texture(base + i);
        if (ADD) { h[base + i] = v; }
        ss += v * v;
    }
    let r = 1.0 / sqrt(ss / f32(p.dim) + p.eps);
    for (var i = 0u; i < p.dim; i++) { y[base + i] = input_texture(base + i) * r * texture_elem(w_tex, i); }
    rstd[row] = r;
}

// One invocation per block of block_rows rows. Grid grid_1d(blocks, 64).
@compute @workgroup_size(64)
fn rmsnorm_backward_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let block = gid.y * nwg.x * 64u + gid.x;
    let row0 = block * p.block_rows;
    if (row0 >= p.rows) { return; }
    for (var row = row0; row < min(p.rows, row0 + p.block_rows); row++) {
        let base = row * p.dim;
        let r = rstd_in[row];
        var s = 0.0;
        for (var i = 0u; i < p.dim; i++) {
            s += texture_elem(dy_tex, base + i) * texture_elem(w_tex, i) * texture_elem(x_tex, base + i);
        }
        let c = r * r * r * s / f32(p.dim);
        for (var i = 0u; i < p.dim; i++) {
            let k = base + i;
            var extra = 0.0;
            if (ADD) { extra = texture_elem(add_to_tex, k); }
            backward_at(k, i, texture_elem(dy_tex, k), texture_elem(x_tex, k), texture_elem(w_tex, i), extra, r, c,
                        block * p.dim, row == row0);
        }
    }
}
