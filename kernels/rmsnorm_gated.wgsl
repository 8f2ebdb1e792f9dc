// Mamba-2's gated, grouped RMSNorm (mamba_ssm RMSNormGated, norm_before_gate = False):
//   u = y · silu(z),  out = u · rstd · w,  rstd = 1 / sqrt(mean(u²) + eps) over each group of `group` channels.
// One 64-thread workgroup per (row, group) for the forward and the input gradients (rows·groups on a 2-D grid);
// the weight gradient sums over rows in slices (one thread per column and slice) and then adds the slices in
// order, so it is deterministic and still spreads over the GPU when there are many rows and few columns.

override ACCUMULATE: bool = false;

struct Params { rows: u32, dim: u32, group: u32, slice_rows: u32, slices: u32, eps: f32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> z: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read> dout: array<f32>;
@group(0) @binding(5) var<storage, read> rstd_in: array<f32>;  // [rows, dim / group]
@group(0) @binding(6) var<storage, read> dw_part_in: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read_write> rstd: array<f32>;
@group(0) @binding(9) var<storage, read_write> dy: array<f32>;
@group(0) @binding(10) var<storage, read_write> dz: array<f32>;
@group(0) @binding(11) var<storage, read_write> dw_part: array<f32>;  // [slices, dim]
@group(0) @binding(12) var<storage, read_write> dw: array<f32>;

var<workgroup> partial: array<f32, 64>;

fn sigmoid(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }

fn gated(i: u32) -> f32 { let zv = z[i]; return y[i] * zv * sigmoid(zv); }

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
fn rmsnorm_gated_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let item = wid.y * nwg.x + wid.x;  // row · groups + group
    let groups = p.dim / p.group;
    if (item >= p.rows * groups) { return; }  // uniform per workgroup, so the barriers below stay uniform
    let base = item * p.group;  // rows are contiguous, so (row, group) starts at item · group
    var ss = 0.0;
    for (var i = lid.x; i < p.group; i += 64u) { let u = gated(base + i); ss += u * u; }
    let r = 1.0 / sqrt(workgroup_sum(ss, lid.x) / f32(p.group) + p.eps);
    let col0 = (item % groups) * p.group;
    for (var i = lid.x; i < p.group; i += 64u) { out[base + i] = gated(base + i) * r * w[col0 + i]; }
    if (lid.x == 0u) { rstd[item] = r; }
}

// du = r·(dout·w) − u·r³·mean(dout·w·u) over the group; dy = du·silu(z), dz = du·y·silu'(z).
@compute @workgroup_size(64)
fn rmsnorm_gated_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                          @builtin(local_invocation_id) lid: vec3<u32>) {
    let item = wid.y * nwg.x + wid.x;
    let groups = p.dim / p.group;
    if (item >= p.rows * groups) { return; }
    let base = item * p.group;
    let col0 = (item % groups) * p.group;
    let r = rstd_in[item];
    var s = 0.0;
    for (var i = lid.x; i < p.group; i += 64u) { s += dout[base + i] * w[col0 + i] * gated(base + i); }
    let c = r * r * r * workgroup_sum(s, lid.x) / f32(p.group);
    for (var i = lid.x; i < p.group; i += 64u) {
        let k = base + i;
        let zv = z[k];
        let sg = sigmoid(zv);
        let du = r * dout[k] * w[col0 + i] - zv * sg * y[k] * c;
        dy[k] = du * zv * sg;
        dz[k] = du * y[k] * sg * (1.0 + zv * (1.0 - sg));
    }
}

// dw_part[slice, col] = Σ over the slice's rows of dout·u·rstd. Grid (ceil(dim / 64), slices).
@compute @workgroup_size(64)
fn rmsnorm_gated_weight_partial(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    if (col >= p.dim) { return; }
    let groups = p.dim / p.group;
    let g = col / p.group;
    let row0 = gid.y * p.slice_rows;
    var acc = 0.0;
    for (var row = row0; row < min(row0 + p.slice_rows, p.rows); row++) {
        let k = row * p.dim + col;
        acc += dout[k] * gated(k) * rstd_in[row * groups + g];
    }
    dw_part[gid.y * p.dim + col] = acc;
}

// dw (+)= Σ_slices dw_part, slices in order. Grid (ceil(dim / 64)).
@compute @workgroup_size(64)
fn rmsnorm_gated_weight_sum(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    if (col >= p.dim) { return; }
    var acc = 0.0;
    for (var k = 0u; k < p.slices; k++) { acc += dw_part_in[k * p.dim + col]; }
    if (ACCUMULATE) { acc += dw[col]; }
    dw[col] = acc;
}
