// Mamba-3 SISO fold: the elementwise pieces that turn the exponential-trapezoidal scan into a plain Mamba-2 SSD
// (kernels/ssd.wgsl's chunked core), as mambactl/reference/mamba3.py's mamba3_fold_scale / mamba3_fold_output /
// mamba3_fold_backward. With δ_t = (1 − λ_t) Δ_t (δ after each sequence's last step = 0),
//   h_t = α_t h_{t−1} + β_t v_{t−1} k_{t−1}ᵀ + γ_t v_t k_tᵀ  (β = (1 − λ) Δ α, γ = λ Δ)
// is g_t = exp(adt_t) g_{t−1} + s_t v_t k_tᵀ with s_t = λ_t Δ_t + δ_{t+1} and h_t = g_t − δ_{t+1} v_t k_tᵀ, so
//   y_t = h_t q_t = g_t q_t − δ_{t+1} v_t (k_t · q_t):
// the core runs with x = v, B = k (one group per head), C = q, log-decay adt and input scale s.
// Layouts (row-major; a "row" is one (batch, step, head)): dt, lam, scale, dscale, ddelta, ddt, dlam [B, L, H];
// q, k, dq, dk [B, L, H, N]; v, y_core, y, dy, dv [B, L, H, P]. Row i is step t = (i / H) % L, and row i + H is
// step t + 1 of the same sequence when t + 1 < L (the shift never crosses a batch row).
// mamba3_fold_scale, mamba3_fold_scale_backward: one thread per row. mamba3_fold_output,
// mamba3_fold_output_backward: FL lanes per row, FW / FL rows per workgroup of FW (the dot products k·q, v·dy over
// strided lanes, then a fixed-order tree in workgroup memory: deterministic), P and N any size. FL = 64 on GPUs;
// FL = 1 on CPU adapters (one invocation per row, no barrier: cheaper there). Rows past the end (the last
// workgroup) run with empty loops so that every lane reaches every barrier.
// Backward: mamba3_fold_output_backward corrects the core's dq, dk, dv in place and leaves ∂loss/∂δ_{t+1} =
// dscale_t − (k_t·q_t)(v_t·dy_t) in ddelta; mamba3_fold_scale_backward then gives, with D_t = ddelta_{t−1}
// (0 at t = 0), ddt_t = λ_t dscale_t + (1 − λ_t) D_t and dlam_t = Δ_t (dscale_t − D_t). ∂loss/∂adt is the core's.

const FW: u32 = 64u;  // workgroup size of the output kernels
override FL: u32 = 64u;  // lanes per row, dividing FW (mambactl/ops/mamba3_fold.py picks it)

struct FoldParams { rows: u32, len: u32, heads: u32, nstate: u32, headdim: u32 }

@group(0) @binding(0) var<uniform> p: FoldParams;
@group(0) @binding(1) var<storage, read> dt: array<f32>;
@group(0) @binding(2) var<storage, read> lam: array<f32>;
@group(0) @binding(3) var<storage, read> q: array<f32>;
@group(0) @binding(4) var<storage, read> k: array<f32>;
@group(0) @binding(5) var<storage, read> v: array<f32>;
@group(0) @binding(6) var<storage, read> y_core: array<f32>;
@group(0) @binding(7) var<storage, read> dy: array<f32>;
@group(0) @binding(8) var<storage, read> dscale: array<f32>;
@group(0) @binding(9) var<storage, read_write> scale: array<f32>;
@group(0) @binding(10) var<storage, read_write> y: array<f32>;
@group(0) @binding(11) var<storage, read_write> dq: array<f32>;
@group(0) @binding(12) var<storage, read_write> dk: array<f32>;
@group(0) @binding(13) var<storage, read_write> dv: array<f32>;
@group(0) @binding(14) var<storage, read_write> ddelta: array<f32>;
@group(0) @binding(15) var<storage, read_write> ddt: array<f32>;
@group(0) @binding(16) var<storage, read_write> dlam: array<f32>;

var<workgroup> red: array<vec2<f32>, FW>;

fn step_of(row: u32) -> u32 { return (row / p.heads) % p.len; }

// δ_{t+1} for row (b, t, h); 0 at a sequence's last step.
fn delta_next(row: u32) -> f32 {
    if (step_of(row) + 1u >= p.len) {
        return 0.0;
    }
    let nxt = row + p.heads;
    return (1.0 - lam[nxt]) * dt[nxt];
}

fn thread_row(gid: vec3<u32>, nwg: vec3<u32>) -> u32 { return gid.y * nwg.x * 256u + gid.x; }

struct RowLane { row: u32, lane: u32, live: bool }

fn row_lane(local: u32, wid: vec3<u32>, nwg: vec3<u32>) -> RowLane {
    let row = (wid.y * nwg.x + wid.x) * (FW / FL) + local / FL;
    return RowLane(row, local % FL, row < p.rows);
}

// Both sums over the FL lanes of a row, in a fixed order; each of them gets them. Uniform control flow only.
fn lanes_sum2(local: u32, lane: u32, part: vec2<f32>) -> vec2<f32> {
    if (FL == 1u) { return part; }
    red[local] = part;
    workgroupBarrier();
    for (var s = FL / 2u; s > 0u; s = s / 2u) {
        if (lane < s) {
            red[local] = red[local] + red[local + s];
        }
        workgroupBarrier();
    }
    let total = red[local - lane];
    workgroupBarrier();  // red is free again
    return total;
}

@compute @workgroup_size(256)
fn mamba3_fold_scale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = thread_row(gid, nwg);
    if (i >= p.rows) {
        return;
    }
    scale[i] = lam[i] * dt[i] + delta_next(i);
}

@compute @workgroup_size(64)
fn mamba3_fold_output(@builtin(local_invocation_index) local: u32, @builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>) {
    let it = row_lane(local, wid, nwg);
    let row = it.row;
    let N = select(0u, p.nstate, it.live);  // what this lane walks: nothing past the end
    let P = select(0u, p.headdim, it.live);
    let qk0 = row * p.nstate;
    var kq = 0.0;
    for (var n = it.lane; n < N; n += FL) {
        kq += k[qk0 + n] * q[qk0 + n];
    }
    kq = lanes_sum2(local, it.lane, vec2<f32>(kq, 0.0)).x;
    if (!it.live) {
        return;  // after the last barrier
    }
    let c = delta_next(row) * kq;
    let v0 = row * p.headdim;
    for (var j = it.lane; j < P; j += FL) {
        y[v0 + j] = y_core[v0 + j] - c * v[v0 + j];
    }
}

@compute @workgroup_size(64)
fn mamba3_fold_output_backward(@builtin(local_invocation_index) local: u32, @builtin(workgroup_id) wid: vec3<u32>,
                               @builtin(num_workgroups) nwg: vec3<u32>) {
    let it = row_lane(local, wid, nwg);
    let row = it.row;
    let N = select(0u, p.nstate, it.live);
    let P = select(0u, p.headdim, it.live);
    let qk0 = row * p.nstate;
    let v0 = row * p.headdim;
    var part = vec2<f32>(0.0, 0.0);
    for (var n = it.lane; n < N; n += FL) {
        part.x += k[qk0 + n] * q[qk0 + n];
    }
    for (var j = it.lane; j < P; j += FL) {
        part.y += v[v0 + j] * dy[v0 + j];
    }
    let dots = lanes_sum2(local, it.lane, part);  // (k·q, v·dy)
    if (!it.live) {
        return;
    }
    let c = delta_next(row);
    let cv = c * dots.y;
    for (var n = it.lane; n < N; n += FL) {
        dq[qk0 + n] = dq[qk0 + n] - cv * k[qk0 + n];
        dk[qk0 + n] = dk[qk0 + n] - cv * q[qk0 + n];
    }
    let ck = c * dots.x;
    for (var j = it.lane; j < P; j += FL) {
        dv[v0 + j] = dv[v0 + j] - ck * dy[v0 + j];
    }
    if (it.lane == 0u) {
        ddelta[row] = dscale[row] - dots.x * dots.y;
    }
}

@compute @workgroup_size(256)
fn mamba3_fold_scale_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = thread_row(gid, nwg);
    if (i >= p.rows) {
        return;
    }
    var d_prev = 0.0;  // ∂loss/∂δ_t, from row t − 1's correction and scale
    if (step_of(i) > 0u) {
        d_prev = ddelta[i - p.heads];
    }
    let ds = dscale[i];
    ddt[i] = lam[i] * ds + (1.0 - lam[i]) * d_prev;
    dlam[i] = dt[i] * (ds - d_prev);
}
