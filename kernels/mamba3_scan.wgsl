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
// Forward: one thread per (batch b, head h, value channel p), walking time in order with its row g[p, :] in a
// private array (N ≤ MAX_N); no workgroup memory. It saves the state g entering each chunk of `chunk` steps,
// states [B, n_chunks, H, P, N].
// Backward (option (a), chosen over an SSD-style chunked matmul form for exactness and a small change): one
// workgroup of BT = 64 threads per (b, h, tile of TN = 32 state columns); lane l takes value channel
// c = pb·BT + l of p-block pb = 0, 1, .. in order, so any headdim works (P = 3, 17, 80, 130 ..). It walks the chunks
// last to first, recomputes the chunk's g_t (its row c, its tile's columns) into g_scratch ([B, H, P, min(chunk,
// L), N], read back only by the same thread), then runs the adjoint G_t = Σ_R dy_{t,R} q_{t,R}ᵀ + α_{t+1} G_{t+1}
// backwards with G (TN floats) private. Per step, the sums over p of dq = Σ_p h[p, n] dy[p], dk = Σ_p du[p, n] v[p]
// and of three scalars go through workgroup memory `red` (BT × RS floats, 12.25 KiB < 16 KiB) XB outputs per pass;
// lane x adds column x over the lanes in order and adds it to what earlier p-blocks left (the same lane wrote it).
// dv (a sum over n) is per state tile: dv_part [B, L, H, R, P, n_tiles], added over tiles in order by
// mamba3_scan_sum_channels (none when N ≤ 32); the scalars, part_s [B, L, H, n_tiles, 3], by mamba3_scan_scalars.
// Nothing scales as B·L·H·P·N; no atomics, so results are deterministic.

const MAX_N: u32 = 128u;  // mirrored by the wrapper (mambactl/ops/mamba3_scan.py)
const MAX_R: u32 = 16u;
const BT: u32 = 64u;   // mamba3_scan_backward: threads (value channels) per workgroup
const TN: u32 = 32u;   // mamba3_scan_backward: state columns per workgroup (one tile); mirrored by the wrapper
const XB: u32 = 48u;   // outputs reduced per pass through `red`
const RS: u32 = 49u;   // row stride of `red` (XB + 1: no bank conflicts either way)

// Segments (Mesa llvmpipe caps the loop iterations of one invocation at 65,535 in total, so on that adapter the
// wrapper splits each walk over time into dispatches; on GPUs one dispatch covers everything):
//   forward: steps [seg_begin, seg_end); g enters from last_state when seg_begin > 0 and leaves through it.
//   backward: p-blocks [pb_lo, pb_hi); chunks kc_hi down to kc_lo + 1 (1-based); in each chunk the recompute
//   runs over steps [rec_lo, min(rec_hi, steps)) and the adjoint over steps min(adj_hi, steps) down to adj_lo + 1;
//   with carry_in G starts from g_carry (else 0) and with carry_out G is left there.
struct ScanParams { batch: u32, len: u32, heads: u32, rank: u32, nstate: u32, headdim: u32, chunk: u32, nchunks: u32,
                    seg_begin: u32, seg_end: u32, pb_lo: u32, pb_hi: u32, kc_lo: u32, kc_hi: u32, rec_lo: u32,
                    rec_hi: u32, adj_lo: u32, adj_hi: u32, carry_in: u32, carry_out: u32 }
// Sum over p of part [rows, P, width] -> total [rows, width].
struct SumParams { rows: u32, width: u32, slices: u32 }
// Per (b, t, h) scalars from part_s [B·L·H, n_tiles, 3].
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
@group(0) @binding(13) var<storage, read_write> dv_part: array<f32>;     // [B, L, H, R, P, n_tiles]: dv per state tile
@group(0) @binding(14) var<storage, read_write> dq: array<f32>;          // [B, L, H, R, N]
@group(0) @binding(15) var<storage, read_write> dk: array<f32>;          // [B, L, H, R, N]
@group(0) @binding(16) var<storage, read_write> part_s: array<f32>;      // [B, L, H, n_tiles, 3]
@group(0) @binding(17) var<uniform> sp: SumParams;
@group(0) @binding(18) var<storage, read> part: array<f32>;
@group(0) @binding(19) var<storage, read_write> total: array<f32>;
@group(0) @binding(20) var<uniform> cp: ScalarParams;
@group(0) @binding(21) var<storage, read_write> dadt: array<f32>;
@group(0) @binding(22) var<storage, read_write> ddt: array<f32>;
@group(0) @binding(23) var<storage, read_write> dlam: array<f32>;
@group(0) @binding(33) var<storage, read_write> g_carry: array<f32>;     // [B, H, P, N]: G between backward segments
var<workgroup> red: array<f32, 3136>;  // BT · RS: one contribution per (lane, output), 12.25 KiB

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
    let last = ((b * p.heads + h) * p.headdim + c) * N;
    if (p.seg_begin == 0u) {
        for (var n = 0u; n < N; n++) { g[n] = 0.0; }
    } else {
        for (var n = 0u; n < N; n++) { g[n] = last_state[last + n]; }
    }
    for (var t = p.seg_begin; t < p.seg_end; t++) {
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
    for (var n = 0u; n < N; n++) { last_state[last + n] = g[n]; }
}

// One workgroup of BT threads per (batch b, head h, state tile of TN columns n0 = tile·TN ..); thread `lane` takes
// the value channel c = pb·BT + lane of p-block pb = 0, 1, .. (blocks in order, so any headdim works).
// Grid grid_1d(B·H·n_tiles·BT, BT).
@compute @workgroup_size(64)
fn mamba3_scan_backward(@builtin(local_invocation_index) lane: u32, @builtin(workgroup_id) wid: vec3<u32>,
                        @builtin(num_workgroups) nwg: vec3<u32>) {
    let ntiles = (p.nstate + TN - 1u) / TN;
    let w = wid.y * nwg.x + wid.x;
    if (w >= p.batch * p.heads * ntiles) { return; }  // whole workgroups only (uniform)
    let tile = w % ntiles;
    let h = (w / ntiles) % p.heads;
    let b = w / (ntiles * p.heads);
    let N = p.nstate;
    let R = p.rank;
    let n0 = tile * TN;
    let tn = min(TN, N - n0);     // columns of this tile
    let nq = R * tn;              // dq (then dk) outputs per step
    let nout = 2u * nq + 3u;      // + the three per-step scalars
    let nblocks = (nout + XB - 1u) / XB;
    let span = min(p.chunk, p.len);
    let npb = (p.headdim + BT - 1u) / BT;
    var G: array<f32, TN>;        // α_{t+1} G_{t+1} on entering step t
    var hv: array<f32, TN>;       // h_t[c, n]
    var duv: array<f32, TN>;      // ∂loss/∂u_t[c, n]
    var dyc: array<f32, MAX_R>;
    var vc: array<f32, MAX_R>;
    var dvacc: array<f32, MAX_R>;
    for (var pb = p.pb_lo; pb < min(p.pb_hi, npb); pb++) {
        let c = pb * BT + lane;
        let live = c < p.headdim;
        let cc = min(c, p.headdim - 1u);  // a valid channel for the idle lanes' reads (their results are dropped)
        let lanes = min(BT, p.headdim - pb * BT);
        let scratch = ((b * p.heads + h) * p.headdim + cc) * span * N;  // this channel's g_t rows
        let carry = ((b * p.heads + h) * p.headdim + cc) * N + n0;
        for (var i = 0u; i < TN; i++) { G[i] = 0.0; }
        if (p.carry_in != 0u) {
            for (var i = 0u; i < tn; i++) { G[i] = g_carry[carry + i]; }
        }
        for (var kc = min(p.kc_hi, p.nchunks); kc > p.kc_lo; kc--) {
            let t0 = (kc - 1u) * p.chunk;
            let steps = min(p.chunk, p.len - t0);
            let entry = (((b * p.nchunks + kc - 1u) * p.heads + h) * p.headdim + cc) * N;
            // Recompute g_t over the chunk (this thread's row c, columns of the tile; read back only by it).
            if (live) {
                for (var jj = p.rec_lo; jj < min(p.rec_hi, steps); jj++) {
                    let t = t0 + jj;
                    let j = bth(b, t, h);
                    let alpha = exp(adt[j]);
                    let s = lam[j] * dt[j] + delta_next(b, t, h);
                    for (var n = n0; n < n0 + tn; n++) {
                        var prev = 0.0;
                        if (jj == 0u) { prev = saved_states[entry + n]; } else { prev = g_scratch[scratch + (jj - 1u) * N + n]; }
                        g_scratch[scratch + jj * N + n] = alpha * prev + s * outer_sum(b, t, h, cc, n);
                    }
                }
            }
            // The adjoint, last step to first.
            for (var jj = min(p.adj_hi, steps); jj > p.adj_lo; jj--) {
                let t = t0 + jj - 1u;
                let j = bth(b, t, h);
                let alpha = exp(adt[j]);
                let dn = delta_next(b, t, h);
                let s = lam[j] * dt[j] + dn;
                var dscale = 0.0;  // Σ_n G_t u_t over the tile
                var dyqu = 0.0;    // Σ_n (Σ_R dy q_Rᵀ) u_t
                var gg = 0.0;      // Σ_n G_t g_{t−1}
                for (var r = 0u; r < R; r++) {
                    dvacc[r] = 0.0;
                    dyc[r] = dy[v_index(b, t, h, r, cc)];
                    vc[r] = v[v_index(b, t, h, r, cc)];
                }
                if (live) {
                    for (var i = 0u; i < tn; i++) {
                        let n = n0 + i;
                        let u = outer_sum(b, t, h, cc, n);
                        let dq_ = dy_q(b, t, h, cc, n);
                        let Gn = dq_ + G[i];
                        let g_t = g_scratch[scratch + (jj - 1u) * N + n];
                        var g_prev = 0.0;
                        if (jj == 1u) { g_prev = saved_states[entry + n]; } else { g_prev = g_scratch[scratch + (jj - 2u) * N + n]; }
                        hv[i] = g_t - dn * u;
                        let du = s * Gn - dn * dq_;
                        duv[i] = du;
                        dscale += Gn * u;
                        dyqu += dq_ * u;
                        gg += Gn * g_prev;
                        for (var r = 0u; r < R; r++) { dvacc[r] += du * k[qk_index(b, t, h, r, n)]; }
                        G[i] = alpha * Gn;
                    }
                    for (var r = 0u; r < R; r++) { dv_part[v_index(b, t, h, r, c) * ntiles + tile] = dvacc[r]; }
                }
                // Sums over the channels of this p-block, XB outputs at a time: lane x adds column x of `red`
                // over the lanes in order, and adds it to what the earlier p-blocks left (the same lane wrote
                // that, so program order makes it visible).
                for (var blk = 0u; blk < nblocks; blk++) {
                    for (var xx = 0u; xx < XB; xx++) {
                        let x = blk * XB + xx;
                        var val = 0.0;
                        if (live && x < nout) {
                            if (x < nq) {
                                val = hv[x % tn] * dyc[x / tn];
                            } else if (x < 2u * nq) {
                                val = duv[(x - nq) % tn] * vc[(x - nq) / tn];
                            } else if (x == 2u * nq) {
                                val = dscale;
                            } else if (x == 2u * nq + 1u) {
                                val = dyqu;
                            } else {
                                val = alpha * gg;
                            }
                        }
                        red[lane * RS + xx] = val;
                    }
                    workgroupBarrier();
                    let x = blk * XB + lane;
                    if (lane < XB && x < nout) {
                        var acc = 0.0;
                        for (var l = 0u; l < lanes; l++) { acc += red[l * RS + lane]; }
                        if (x < nq) {
                            let idx = qk_index(b, t, h, x / tn, n0 + x % tn);
                            if (pb > 0u) { acc += dq[idx]; }
                            dq[idx] = acc;
                        } else if (x < 2u * nq) {
                            let idx = qk_index(b, t, h, (x - nq) / tn, n0 + (x - nq) % tn);
                            if (pb > 0u) { acc += dk[idx]; }
                            dk[idx] = acc;
                        } else {
                            let idx = (j * ntiles + tile) * 3u + (x - 2u * nq);
                            if (pb > 0u) { acc += part_s[idx]; }
                            part_s[idx] = acc;
                        }
                    }
                    workgroupBarrier();
                }
            }
        }
        if (p.carry_out != 0u && live) {
            for (var i = 0u; i < tn; i++) { g_carry[carry + i] = G[i]; }
        }
    }
}

// total[row, x] = Σ_c part[(row·slices + c)·width + x], c in order (dv over the state tiles).
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

// Per (b, t, h) of count = B·L·H: sums of part [B·L·H, n_tiles, 3] over the tiles, then
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
