// Mamba-3 SISO fold: the elementwise pieces that turn the exponential-trapezoidal scan into the chunked SSD core
// of kernels/ssd.wgsl, as mambactl/reference/mamba3.py's mamba3_fold_scale / mamba3_fold_backward. With
// δ_t = (1 − λ_t) Δ_t (δ after each sequence's last step = 0),
//   h_t = α_t h_{t−1} + β_t v_{t−1} k_{t−1}ᵀ + γ_t v_t k_tᵀ  (β = (1 − λ) Δ α, γ = λ Δ)
// is g_t = exp(adt_t) g_{t−1} + s_t v_t k_tᵀ with s_t = γ_t + δ_{t+1} and h_t = g_t − δ_{t+1} v_t k_tᵀ
// = exp(adt_t) g_{t−1} + γ_t v_t k_tᵀ, so y_t = h_t q_t is the core's output with x = v, B = k (one group per
// head), C = q, log-decay adt, input scale s and diagonal weight d = γ (step t's own term weighted by γ_t
// instead of s_t): no correction pass over q, k, v.
// Layouts (row-major; a "row" is one (batch, step, head)): dt, lam, scale, diag, dscale, ddiag, ddt, dlam
// [B, L, H]. Row i is step t = (i / H) % L, and row i + H is step t + 1 of the same sequence when t + 1 < L (the
// shift never crosses a batch row). One thread per row.
// Backward, from the core's dscale and ddiag, with D_t = dscale_{t−1} (0 at t = 0):
//   ddt_t = λ_t (dscale_t + ddiag_t) + (1 − λ_t) D_t,  dlam_t = Δ_t (dscale_t + ddiag_t − D_t).
// ∂loss/∂adt and ∂q, ∂k, ∂v are the core's.

struct FoldParams { rows: u32, len: u32, heads: u32 }

@group(0) @binding(0) var<uniform> p: FoldParams;
@group(0) @binding(1) var<storage, read> dt: array<f32>;
@group(0) @binding(2) var<storage, read> lam: array<f32>;
@group(0) @binding(8) var<storage, read> dscale: array<f32>;
@group(0) @binding(9) var<storage, read_write> scale: array<f32>;
@group(0) @binding(10) var<storage, read_write> diag: array<f32>;
@group(0) @binding(11) var<storage, read> ddiag: array<f32>;
@group(0) @binding(15) var<storage, read_write> ddt: array<f32>;
@group(0) @binding(16) var<storage, read_write> dlam: array<f32>;

fn step_of(row: u32) -> u32 { return (row / p.heads) % p.len; }

fn thread_row(gid: vec3<u32>, nwg: vec3<u32>) -> u32 { return gid.y * nwg.x * 256u + gid.x; }

@compute @workgroup_size(256)
fn mamba3_fold_scale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = thread_row(gid, nwg);
    if (i >= p.rows) {
        return;
    }
    var delta_next = 0.0;  // δ_{t+1}; 0 at a sequence's last step
    if (step_of(i) + 1u < p.len) {
        delta_next = (1.0 - lam[i + p.heads]) * dt[i + p.heads];
    }
    let gamma = lam[i] * dt[i];
    scale[i] = gamma + delta_next;
    diag[i] = gamma;
}

@compute @workgroup_size(256)
fn mamba3_fold_scale_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = thread_row(gid, nwg);
    if (i >= p.rows) {
        return;
    }
    var d_prev = 0.0;  // ∂loss/∂δ_t: δ_t is in step t − 1's scale alone
    if (step_of(i) > 0u) {
        d_prev = dscale[i - p.heads];
    }
    let own = dscale[i] + ddiag[i];  // γ_t is in step t's scale and its diagonal weight
    ddt[i] = lam[i] * own + (1.0 - lam[i]) * d_prev;
    dlam[i] = dt[i] * (own - d_prev);
}
