// Mamba-2's gated, grouped RMSNorm (mamba_ssm RMSNormGated, norm_before_gate = False):
//   u = y · silu(z),  out = u · rstd · w,  rstd = 1 / sqrt(mean(u²) + eps) over each group of `group` channels.
// One WG-thread workgroup per (row, group) for the forward, per (block of block_rows rows, group) for the
// backward (on a 2-D grid), which also sums the weight gradient's terms dout·u·rstd over its rows in place
// (dw_part [blocks, dim], each thread owning its columns; ops.reduce.column_sums adds the blocks in order).
// z may be a column range of a wider matrix (Mamba-2's in_proj output: rows z_stride floats apart, z's column c at
// z_col + c), and dz is written the same way into the combined in_proj gradient (dz_stride, dz_col): no
// column_slice copy of z and no column_scatter of dz.
// The *_rows entry points (CPU adapters) do the same with one invocation per (row, group) or (block, group) and no
// barriers: llvmpipe runs a workgroup as SIMD loops on one thread, each barrier a coroutine switch (the 256-thread
// kernels took 4.4 / 6.5 ms a call forward / backward at 512 rows of 128 there).

struct Params { rows: u32, dim: u32, group: u32, block_rows: u32, eps: f32, z_stride: u32, z_col: u32,
                dz_stride: u32, dz_col: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> z: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read> dout: array<f32>;
@group(0) @binding(5) var<storage, read> rstd_in: array<f32>;  // [rows, dim / group]
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(9) var<storage, read_write> dy: array<f32>;
@group(0) @binding(10) var<storage, read_write> dz: array<f32>;
@group(0) @binding(11) var<storage, read_write> dw_part: array<f32>;  // [blocks, dim]

// Threads per workgroup of the GPU kernels: 256, so the backward's blocks of rows (M / 8 workgroups) still fill a
// large GPU (1,024 × 64 threads left it a quarter occupied, at ~1 TB/s).
const WG: u32 = 256u;

var<workgroup> partial: array<f32, WG>;

fn sigmoid(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }

fn z_at(row: u32, col: u32) -> f32 { return z[row * p.z_stride + p.z_col + col]; }

fn gated(row: u32, col: u32) -> f32 { let zv = z_at(row, col); return y[row * p.dim + col] * zv * sigmoid(zv); }

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

// The forward's output at column col of row `row`, its group's rstd r.
fn store_out(row: u32, col: u32, r: f32) { out[row * p.dim + col] = gated(row, col) * r * w[col]; }

// dout·w·u at column col of row `row`: the terms of the backward's group sum.
fn dot_term(row: u32, col: u32) -> f32 { return dout[row * p.dim + col] * w[col] * gated(row, col); }

// dy, dz and dw's term at column col of row `row` (rstd r, c = r³·mean(dout·w·u) over its group); the term is added
// into block `block`'s row of dw_part, or stored there for the block's first row.
fn backward_at(row: u32, col: u32, r: f32, c: f32, block: u32, first: bool) {
    let k = row * p.dim + col;
    let zv = z_at(row, col);
    let sg = sigmoid(zv);
    let yv = y[k];
    let g = dout[k];
    let u = yv * zv * sg;
    let du = r * g * w[col] - u * c;
    dy[k] = du * zv * sg;
    dz[row * p.dz_stride + p.dz_col + col] = du * yv * sg * (1.0 + zv * (1.0 - sg));
    let term = g * u * r;
    let j = block * p.dim + col;
    if (first) { dw_part[j] = term; } else { dw_part[j] += term; }
}

@compute @workgroup_size(WG)
fn rmsnorm_gated_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let item = wid.y * nwg.x + wid.x;  // row · groups + group
    let groups = p.dim / p.group;
    if (item >= p.rows * groups) { return; }  // uniform per workgroup, so the barriers below stay uniform
    let row = item / groups;
    let col0 = (item % groups) * p.group;
    var ss = 0.0;
    for (var i = lid.x; i < p.group; i += WG) { let u = gated(row, col0 + i); ss += u * u; }
    let r = 1.0 / sqrt(workgroup_sum(ss, lid.x) / f32(p.group) + p.eps);
    for (var i = lid.x; i < p.group; i += WG) { store_out(row, col0 + i, r); }
    if (lid.x == 0u) { rstd[item] = r; }
}

// du = r·(dout·w) − u·r³·mean(dout·w·u) over the group; dy = du·silu(z), dz = du·y·silu'(z);
// dw_part[block, col] = Σ over the block's rows of dout·u·r.
@compute @workgroup_size(WG)
fn rmsnorm_gated_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_id) lid: vec3<u32>) {
    let item = wid.y * nwg.x + wid.x;  // block · groups + group
    let groups = p.dim / p.group;
    let block = item / groups;
    let row0 = block * p.block_rows;
    if (row0 >= p.rows) { return; }  // uniform per workgroup, as is every row loop below
    let col0 = (item % groups) * p.group;
    for (var row = row0; row < min(p.rows, row0 + p.block_rows); row++) {
        let r = rstd_in[row * groups + item % groups];
        var s = 0.0;
        for (var i = lid.x; i < p.group; i += WG) { s += dot_term(row, col0 + i); }
        let c = r * r * r * workgroup_sum(s, lid.x) / f32(p.group);
        for (var i = lid.x; i < p.group; i += WG) { backward_at(row, col0 + i, r, c, block, row == row0); }
    }
}

// CPU adapters: one invocation per (row, group). Grid grid_1d(rows · groups, 64).
@compute @workgroup_size(64)
fn rmsnorm_gated_forward_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let item = gid.y * nwg.x * 64u + gid.x;
    let groups = p.dim / p.group;
    if (item >= p.rows * groups) { return; }
    let row = item / groups;
    let col0 = (item % groups) * p.group;
    var ss = 0.0;
    for (var i = 0u; i < p.group; i++) { let u = gated(row, col0 + i); ss += u * u; }
    let r = 1.0 / sqrt(ss / f32(p.group) + p.eps);
    for (var i = 0u; i < p.group; i++) { store_out(row, col0 + i, r); }
    rstd[item] = r;
}

// One invocation per (block of block_rows rows, group). Grid grid_1d(blocks · groups, 64).
@compute @workgroup_size(64)
fn rmsnorm_gated_backward_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let item = gid.y * nwg.x * 64u + gid.x;
    let groups = p.dim / p.group;
    let block = item / groups;
    let row0 = block * p.block_rows;
    if (row0 >= p.rows) { return; }
    let col0 = (item % groups) * p.group;
    for (var row = row0; row < min(p.rows, row0 + p.block_rows); row++) {
        let r = rstd_in[row * groups + item % groups];
        var s = 0.0;
        for (var i = 0u; i < p.group; i++) { s += dot_term(row, col0 + i); }
        let c = r * r * r * s / f32(p.group);
        for (var i = 0u; i < p.group; i++) { backward_at(row, col0 + i, r, c, block, row == row0); }
    }
}
