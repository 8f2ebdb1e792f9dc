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
// mamba3_fold_output_backward: one workgroup of FW threads per row (the dot products k·q, v·dy over strided
// lanes, then a fixed-order tree in workgroup memory: deterministic), P and N any size.
// Backward: mamba3_fold_output_backward corrects the core's dq, dk, dv in place and leaves ∂loss/∂δ_{t+1} =
// dscale_t − (k_t·q_t)(v_t·dy_t) in ddelta; mamba3_fold_scale_backward then gives, with D_t = ddelta_{t−1}
// (0 at t = 0), ddt_t = λ_t dscale_t + (1 − λ_t) D_t and dlam_t = Δ_t (dscale_t − D_t). ∂loss/∂adt is the core's.

const FW: u32 = 64u;  // threads per row of the output kernels (mirrored by mambactl/ops/mamba3_fold.py)

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

fn group_row(wid: vec3<u32>, nwg: vec3<u32>) -> u32 { return wid.y * nwg.x + wid.x; }

// Both sums of red over the workgroup, in a fixed order; every lane gets the result. Called in uniform control flow.
fn workgroup_sum2(lane: u32, part: vec2<f32>) -> vec2<f32> {
    red[lane] = part;
    workgroupBarrier();
    for (var s = FW / 2u; s > 0u; s = s / 2u) {
        if (lane < s) {
            red[lane] = red[lane] + red[lane + s];
        }
        workgroupBarrier();
    }
    let total = red[0];
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
fn mamba3_fold_output(@builtin(local_invocation_index) lane: u32, @builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = group_row(wid, nwg);
    if (row >= p.rows) {
        return;  // uniform: the whole workgroup
    }
    let qk0 = row * p.nstate;
    var kq = 0.0;
    for (var n = lane; n < p.nstate; n += FW) {
        kq += k[qk0 + n] * q[qk0 + n];
    }
    let c = delta_next(row) * workgroup_sum2(lane, vec2<f32>(kq, 0.0)).x;
    let v0 = row * p.headdim;
    for (var j = lane; j < p.headdim; j += FW) {
        y[v0 + j] = y_core[v0 + j] - c * v[v0 + j];
    }
}

@compute @workgroup_size(64)
fn mamba3_fold_output_backward(@builtin(local_invocation_index) lane: u32, @builtin(workgroup_id) wid: vec3<u32>,
                               @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = group_row(wid, nwg);
    if (row >= p.rows) {
        return;
    }
    let qk0 = row * p.nstate;
    let v0 = row * p.headdim;
    var part = vec2<f32>(0.0, 0.0);
    for (var n = lane; n < p.nstate; n += FW) {
        part.x += k[qk0 + n] * q[qk0 + n];
    }
    for (var j = lane; j < p.headdim; j += FW) {
        part.y += v[v0 + j] * dy[v0 + j];
    }
    let dots = workgroup_sum2(lane, part);  // (k·q, v·dy)
    let c = delta_next(row);
    let cv = c * dots.y;
    for (var n = lane; n < p.nstate; n += FW) {
        dq[qk0 + n] = dq[qk0 + n] - cv * k[qk0 + n];
        dk[qk0 + n] = dk[qk0 + n] - cv * q[qk0 + n];
    }
    let ck = c * dots.x;
    for (var j = lane; j < p.headdim; j += FW) {
        dv[v0 + j] = dv[v0 + j] - ck * dy[v0 + j];
    }
    if (lane == 0u) {
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
