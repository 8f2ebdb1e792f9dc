// Mamba-3 scan (exponential-trapezoidal recurrence, SISO and MIMO rank R) and its exact backward, as
// mambactl/reference/mamba3.py's mamba3_scan / mamba3_scan_backward. Layouts (row-major):
//   q, k [B, L, H, R, N];  v, y [B, L, H, R, P];  adt = A·Δ, dt = Δ, lam = λ [B, L, H].
//   h_t = α_t h_{t−1} + β_t Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ_t Σ_r v_{t,r} k_{t,r}ᵀ,  y_{t,R} = h_t q_{t,R},
//   α = exp(A·Δ), β = (1 − λ) Δ α, γ = λ Δ.
// Both directions run the equivalent SSD form (the reference's docstring): with u_t = Σ_r v_{t,r} k_{t,r}ᵀ,
// δ_t = (1 − λ_t) Δ_t (δ_L = 0) and s_t = γ_t + δ_{t+1},
//   g_t = α_t g_{t−1} + s_t u_t,  h_t = g_t − δ_{t+1} u_t,
// so the carried state is g alone [P, N] per (batch, head).
//
// Threads: one per (batch b, head h, value channel p), walking time in order with its row g[p, :] in a
// private array (N ≤ MAX_N). No workgroup memory and no barriers: every thread is independent.
// Memory: the forward saves the state g entering each chunk of `chunk` steps, states [B, n_chunks, H, P, N].
// The backward walks the chunks last to first: it recomputes the chunk's states g_t into g_scratch
// ([B, H, P, min(chunk, L), N], per thread), then runs the adjoint G_t = ∂loss/∂g_t =
// Σ_R dy_{t,R} q_{t,R}ᵀ + α_{t+1} G_{t+1} backwards. dv is local to a thread; the sums over p (dq, dk and the
// per-(t, head) scalars) go out as per-thread partials and second dispatches add them over p in order, so
// results are deterministic without atomics.

const MAX_N: u32 = 128u;  // mirrored by the wrapper (mambactl/ops/mamba3_scan.py)
const MAX_R: u32 = 16u;

struct ScanParams { batch: u32, len: u32, heads: u32, rank: u32, nstate: u32, headdim: u32, chunk: u32, nchunks: u32 }
// Sum over p of part [rows, P, width] -> total [rows, width].
struct SumParams { rows: u32, width: u32, slices: u32 }
// Per (b, t, h) scalars from part_s [B·L·H, P, 3].
struct ScalarParams { count: u32, steps: u32, nheads: u32, nslices: u32 }

@group(0) @binding(0) var<uniform> p: ScanParams;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> adt: array<f32>;
@group(0) @binding(5) var<storage, read> dt: array<f32>;
@group(0) @binding(6) var<storage, read> lam: array<f32>;
@group(0) @binding(7) var<storage, read> dy: array<f32>;
@group(0) @binding(8) var<storage, read> saved_states: array<f32>;     // [B, n_chunks, H, P, N]
@group(0) @binding(9) var<storage, read_write> y: array<f32>;
@group(0) @binding(10) var<storage, read_write> states: array<f32>;   // [B, n_chunks, H, P, N]
@group(0) @binding(11) var<storage, read_write> last_state: array<f32>;  // [B, H, P, N]: g after the last step
@group(0) @binding(12) var<storage, read_write> g_scratch: array<f32>;   // [B, H, P, min(chunk, L), N]
@group(0) @binding(13) var<storage, read_write> dv: array<f32>;          // [B, L, H, R, P]
@group(0) @binding(14) var<storage, read_write> part_q: array<f32>;      // [B, L, H, P, R, N]
@group(0) @binding(15) var<storage, read_write> part_k: array<f32>;      // [B, L, H, P, R, N]
@group(0) @binding(16) var<storage, read_write> part_s: array<f32>;      // [B, L, H, P, 3]
@group(0) @binding(17) var<uniform> sp: SumParams;
@group(0) @binding(18) var<storage, read> part: array<f32>;
@group(0) @binding(19) var<storage, read_write> total: array<f32>;
@group(0) @binding(20) var<uniform> cp: ScalarParams;
@group(0) @binding(21) var<storage, read_write> dadt: array<f32>;
@group(0) @binding(22) var<storage, read_write> ddt: array<f32>;
@group(0) @binding(23) var<storage, read_write> dlam: array<f32>;

// Index of (b, t, h) in a [B, L, H] tensor.
fn bth(b: u32, t: u32, h: u32) -> u32 { return (b * p.len + t) * p.heads + h; }

// (b, t, h, r, n) in q / k.
fn qk_index(b: u32, t: u32, h: u32, r: u32, n: u32) -> u32 { return (bth(b, t, h) * p.rank + r) * p.nstate + n; }

// (b, t, h, r, c) in v / y / dy.
fn v_index(b: u32, t: u32, h: u32, r: u32, c: u32) -> u32 { return (bth(b, t, h) * p.rank + r) * p.headdim + c; }

// δ_{t+1} = (1 − λ_{t+1}) Δ_{t+1}, zero after the last step.
fn delta_next(b: u32, t: u32, h: u32) -> f32 {
    if (t + 1u >= p.len) { return 0.0; }
    let i = bth(b, t + 1u, h);
    return (1.0 - lam[i]) * dt[i];
}

// u_t[c, n] = Σ_r v_{t,r}[c] k_{t,r}[n].
fn outer_sum(b: u32, t: u32, h: u32, c: u32, n: u32) -> f32 {
    var acc = 0.0;
    for (var r = 0u; r < p.rank; r++) { acc += v[v_index(b, t, h, r, c)] * k[qk_index(b, t, h, r, n)]; }
    return acc;
}

// Σ_R dy_{t,R}[c] q_{t,R}[n].
fn dy_q(b: u32, t: u32, h: u32, c: u32, n: u32) -> f32 {
    var acc = 0.0;
    for (var r = 0u; r < p.rank; r++) { acc += dy[v_index(b, t, h, r, c)] * q[qk_index(b, t, h, r, n)]; }
    return acc;
}

// Grid grid_1d(B·H·P, 64).
@compute @workgroup_size(64)
fn mamba3_scan_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= p.batch * p.heads * p.headdim) { return; }
    let c = i % p.headdim;
    let h = (i / p.headdim) % p.heads;
    let b = i / (p.headdim * p.heads);
    let N = p.nstate;
    var g: array<f32, MAX_N>;
    for (var n = 0u; n < N; n++) { g[n] = 0.0; }
    for (var t = 0u; t < p.len; t++) {
        if (t % p.chunk == 0u) {
            let base = (((b * p.nchunks + t / p.chunk) * p.heads + h) * p.headdim + c) * N;
            for (var n = 0u; n < N; n++) { states[base + n] = g[n]; }
        }
        let j = bth(b, t, h);
        let alpha = exp(adt[j]);
        let dn = delta_next(b, t, h);
        let s = lam[j] * dt[j] + dn;
        for (var n = 0u; n < N; n++) { g[n] = alpha * g[n] + s * outer_sum(b, t, h, c, n); }
        for (var r = 0u; r < p.rank; r++) {
            var acc = 0.0;
            for (var n = 0u; n < N; n++) {
                acc += (g[n] - dn * outer_sum(b, t, h, c, n)) * q[qk_index(b, t, h, r, n)];
            }
            y[v_index(b, t, h, r, c)] = acc;
        }
    }
    let base = ((b * p.heads + h) * p.headdim + c) * N;
    for (var n = 0u; n < N; n++) { last_state[base + n] = g[n]; }
}

// Grid grid_1d(B·H·P, 64), as the forward.
@compute @workgroup_size(64)
fn mamba3_scan_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= p.batch * p.heads * p.headdim) { return; }
    let c = i % p.headdim;
    let h = (i / p.headdim) % p.heads;
    let b = i / (p.headdim * p.heads);
    let N = p.nstate;
    let R = p.rank;
    let span = min(p.chunk, p.len);
    let scratch = i * span * N;  // this thread's g_t rows; i = (b·H + h)·P + c
    var G: array<f32, MAX_N>;    // α_{t+1} G_{t+1} on entering step t
    var dvacc: array<f32, MAX_R>;
    for (var n = 0u; n < N; n++) { G[n] = 0.0; }
    for (var kc = p.nchunks; kc > 0u; kc--) {
        let t0 = (kc - 1u) * p.chunk;
        let steps = min(p.chunk, p.len - t0);
        let entry = (((b * p.nchunks + kc - 1u) * p.heads + h) * p.headdim + c) * N;
        // Recompute g_t over the chunk.
        for (var jj = 0u; jj < steps; jj++) {
            let t = t0 + jj;
            let j = bth(b, t, h);
            let alpha = exp(adt[j]);
            let s = lam[j] * dt[j] + delta_next(b, t, h);
            for (var n = 0u; n < N; n++) {
                var prev = 0.0;
                if (jj == 0u) { prev = saved_states[entry + n]; } else { prev = g_scratch[scratch + (jj - 1u) * N + n]; }
                g_scratch[scratch + jj * N + n] = alpha * prev + s * outer_sum(b, t, h, c, n);
            }
        }
        // The adjoint, last step to first.
        for (var jj = steps; jj > 0u; jj--) {
            let t = t0 + jj - 1u;
            let j = bth(b, t, h);
            let alpha = exp(adt[j]);
            let dn = delta_next(b, t, h);
            let s = lam[j] * dt[j] + dn;
            var dscale = 0.0;  // Σ_n G_t u_t
            var dyqu = 0.0;    // Σ_n (Σ_R dy q_Rᵀ) u_t
            var gg = 0.0;      // Σ_n G_t g_{t−1}
            for (var r = 0u; r < R; r++) { dvacc[r] = 0.0; }
            let prow = (j * p.headdim + c) * R;  // row (b, t, h, c, ·) of part_q / part_k, times N
            for (var n = 0u; n < N; n++) {
                let u = outer_sum(b, t, h, c, n);
                let dq_ = dy_q(b, t, h, c, n);
                let Gn = dq_ + G[n];
                let g_t = g_scratch[scratch + (jj - 1u) * N + n];
                var g_prev = 0.0;
                if (jj == 1u) { g_prev = saved_states[entry + n]; } else { g_prev = g_scratch[scratch + (jj - 2u) * N + n]; }
                let hn = g_t - dn * u;
                let du = s * Gn - dn * dq_;
                dscale += Gn * u;
                dyqu += dq_ * u;
                gg += Gn * g_prev;
                for (var r = 0u; r < R; r++) {
                    part_q[(prow + r) * N + n] = hn * dy[v_index(b, t, h, r, c)];
                    part_k[(prow + r) * N + n] = du * v[v_index(b, t, h, r, c)];
                    dvacc[r] += du * k[qk_index(b, t, h, r, n)];
                }
                G[n] = alpha * Gn;
            }
            for (var r = 0u; r < R; r++) { dv[v_index(b, t, h, r, c)] = dvacc[r]; }
            let sbase = (j * p.headdim + c) * 3u;
            part_s[sbase] = dscale;
            part_s[sbase + 1u] = dyqu;
            part_s[sbase + 2u] = alpha * gg;
        }
    }
}

// total[row, x] = Σ_c part[(row·slices + c)·width + x], c in order (dq, dk over the value channels).
// Grid grid_1d(rows·width).
@compute @workgroup_size(256)
fn mamba3_scan_sum_channels(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= sp.rows * sp.width) { return; }
    let row = i / sp.width;
    let x = i % sp.width;
    var acc = 0.0;
    for (var c = 0u; c < sp.slices; c++) { acc += part[(row * sp.slices + c) * sp.width + x]; }
    total[i] = acc;
}

// Per (b, t, h) of count = B·L·H: sums of part [B·L·H, P, 3] over P, then
//   ∂/∂δ_t = (dscale − dyqu) at t − 1 (zero at t = 0), dadt = Σ α G g_{t−1},
//   ddt = dscale λ + ∂/∂δ_t (1 − λ), dlam = (dscale − ∂/∂δ_t) Δ.  Grid grid_1d(count).
@compute @workgroup_size(256)
fn mamba3_scan_scalars(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= cp.count) { return; }
    let t = (i / cp.nheads) % cp.steps;
    var dscale = 0.0;
    var da = 0.0;
    for (var c = 0u; c < cp.nslices; c++) {
        dscale += part[(i * cp.nslices + c) * 3u];
        da += part[(i * cp.nslices + c) * 3u + 2u];
    }
    var ddelta = 0.0;
    if (t > 0u) {
        let prev = i - cp.nheads;
        var a = 0.0;
        var bb = 0.0;
        for (var c = 0u; c < cp.nslices; c++) {
            a += part[(prev * cp.nslices + c) * 3u];
            bb += part[(prev * cp.nslices + c) * 3u + 1u];
        }
        ddelta = a - bb;
    }
    let l = lam[i];
    dadt[i] = da;
    ddt[i] = dscale * l + ddelta * (1.0 - l);
    dlam[i] = (dscale - ddelta) * dt[i];
}

// ---- Recurrent decoding (one token per batch row) ----
// mamba3_scan_rotate: q, k [B, H, R, N] (this token's, turned by its own angle increment θ_inc) are turned on by
// the angle θ0 reached before it (rotations in one plane compose: rot(θ0) rot(θ_inc) = rot(θ0 + θ_inc)), and
// θ_out = θ0 + θ_inc [B, H, S] (the same float sum as the parallel prep's running θ). Pairs as
// kernels/mamba3_prep.wgsl (MIMO: (j, j + N/2), SISO: (2j, 2j + 1)). Grid grid_1d(B·H·R·N).
// mamba3_scan_step: h [B, H, P, N] advances in place, h = α h + β Σ_r v_prev,r k_prev,rᵀ + γ Σ_r v_r k_rᵀ,
// y_R = h q_R (y [B, H, R, P]). One thread per (b, h, p). Grid grid_1d(B·H·P, 64).
struct StepParams { sbatch: u32, sheads: u32, srank: u32, snstate: u32, sheaddim: u32, sangles: u32, smimo: u32 }

@group(0) @binding(24) var<uniform> st: StepParams;
@group(0) @binding(25) var<storage, read> theta0: array<f32>;          // [B, H, S]
@group(0) @binding(26) var<storage, read> theta_inc: array<f32>;       // [B, H, S]
@group(0) @binding(27) var<storage, read_write> theta_out: array<f32>; // [B, H, S]
@group(0) @binding(28) var<storage, read_write> q_out: array<f32>;     // [B, H, R, N]
@group(0) @binding(29) var<storage, read_write> k_out: array<f32>;
@group(0) @binding(30) var<storage, read> k_prev: array<f32>;          // [B, H, R, N]
@group(0) @binding(31) var<storage, read> v_prev: array<f32>;          // [B, H, R, P]
@group(0) @binding(32) var<storage, read_write> ssm_state: array<f32>; // [B, H, P, N]

@compute @workgroup_size(256)
fn mamba3_scan_rotate(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let N = st.snstate;
    let S = st.sangles;
    if (i >= st.sbatch * st.sheads * st.srank * N) { return; }
    let n = i % N;
    let bh = i / (N * st.srank);  // b·H + h
    let r = (i / N) % st.srank;
    if (r == 0u && n < S) { theta_out[bh * S + n] = theta0[bh * S + n] + theta_inc[bh * S + n]; }
    // the angle j turning n, whether n is the second of its pair, and its partner m
    var j = S;
    var second = false;
    var m = n;
    if (st.smimo != 0u) {
        let half = N / 2u;
        if (n < S) { j = n; m = n + half; } else if (n >= half && n - half < S) { j = n - half; second = true; m = n - half; }
    } else if (n / 2u < S) {
        j = n / 2u;
        second = (n % 2u) == 1u;
        m = select(n + 1u, n - 1u, second);
    }
    let base = i - n;
    if (j >= S) { q_out[i] = q[i]; k_out[i] = k[i]; return; }
    let c = cos(theta0[bh * S + j]);
    let s = sin(theta0[bh * S + j]);
    if (!second) {  // x0 c − x1 s
        q_out[i] = q[i] * c - q[base + m] * s;
        k_out[i] = k[i] * c - k[base + m] * s;
    } else {        // x0 s + x1 c
        q_out[i] = q[base + m] * s + q[i] * c;
        k_out[i] = k[base + m] * s + k[i] * c;
    }
}

@compute @workgroup_size(64)
fn mamba3_scan_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    let P = st.sheaddim;
    let N = st.snstate;
    let R = st.srank;
    if (i >= st.sbatch * st.sheads * P) { return; }
    let c = i % P;
    let bh = i / P;  // b·H + h
    let alpha = exp(adt[bh]);
    let beta = (1.0 - lam[bh]) * dt[bh] * alpha;
    let gamma = lam[bh] * dt[bh];
    let base = i * N;
    for (var n = 0u; n < N; n++) {
        var up = 0.0;
        var u = 0.0;
        for (var r = 0u; r < R; r++) {
            up += v_prev[(bh * R + r) * P + c] * k_prev[(bh * R + r) * N + n];
            u += v[(bh * R + r) * P + c] * k[(bh * R + r) * N + n];
        }
        ssm_state[base + n] = alpha * ssm_state[base + n] + beta * up + gamma * u;
    }
    for (var r = 0u; r < R; r++) {
        var acc = 0.0;
        for (var n = 0u; n < N; n++) { acc += ssm_state[base + n] * q[(bh * R + r) * N + n]; }
        y[(bh * R + r) * P + c] = acc;
    }
}
