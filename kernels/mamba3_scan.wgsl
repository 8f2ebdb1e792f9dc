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
// Forward (mamba3_scan_forward_tiled): one workgroup of 256 threads per (batch b, head h, block of 32 value
// channels); each channel's row g[p, :] is split over 8 threads (state tiles of ceil(N / 8) ≤ 16 columns, kept in
// registers). Time goes in tiles of T steps (T·R ≤ 16): a tile's k, q, v and per-step scalars are staged in
// workgroup memory by all threads at once (k, q rows are contiguous in memory), the threads walk the T steps from
// there keeping their partial y_{t,r}[p] (over their columns) privately, and after the tile lane x adds the 8
// partials of output x in order. It saves the state g entering each chunk of `chunk` steps, states
// [B, n_chunks, H, P, N]. Where not even one step's k, q fit 16 KiB (R·(2N + 32) + 3 > 4096 floats, e.g. R 16 with
// N 128) mamba3_scan_forward runs instead: one thread per (b, h, p) with the whole row g[p, :] private.
// Backward (option (a), chosen over an SSD-style chunked matmul form for exactness and a small change): one
// workgroup of BT = 64 threads per (b, h, tile of TN = 16 state columns); lane l takes value channel
// c = pb·BT + l of p-block pb = 0, 1, .. in order, so any headdim works (P = 3, 17, 80, 130 ..). It walks the chunks
// last to first, recomputes the chunk's g_t (its row c, its tile's columns, carried in registers) into g_scratch
// ([B, H, min(chunk, L), N, P]: adjacent lanes adjacent, so its stores and loads coalesce; read back only by the
// same thread), then runs the adjoint G_t = Σ_R dy_{t,R} q_{t,R}ᵀ + α_{t+1} G_{t+1} backwards with G, g_t, g_{t−1}
// (TN floats each) private (loops over a tile's columns run TN times, guarded, so the arrays stay in registers;
// g_t is the previous step's g_{t−1}, so one scratch row is loaded per step). Per step, the sums over p of
// dq_r = Σ_p h[p, n] dy_r[p], dk_r = Σ_p du[p, n] v_r[p] and of three scalars go through workgroup memory `red`
// (BT × RS floats, 9.25 KiB), one pass per r for dq_r and dk_r (the scalars ride with the last); lane x adds
// column x over the lanes in a fixed order (four interleaved chains) and adds it to what earlier p-blocks left (the
// same lane wrote it).
// dv (a sum over n) is per state tile: dv_part [n_tiles, B, L, H, R, P] (stores coalesce), added over tiles in order by
// mamba3_scan_sum_channels (none when N ≤ 32); the scalars, part_s [B, L, H, n_tiles, 3], by mamba3_scan_scalars.
// Nothing scales as B·L·H·P·N; no atomics, so results are deterministic.

const MAX_N: u32 = 128u;  // mirrored by the wrapper (mambactl/ops/mamba3_scan.py)
const MAX_R: u32 = 16u;
const BT: u32 = 64u;   // mamba3_scan_backward: threads (value channels) per workgroup
const TN: u32 = 16u;   // mamba3_scan_backward: state columns per workgroup (one tile); mirrored by the wrapper
const RS: u32 = 37u;   // row stride of `red` (≥ 2 TN + 3; odd: no bank conflicts either way)

// Segments (Mesa llvmpipe caps the loop iterations of one invocation at 65,535 in total, so on that adapter the
// wrapper splits each walk over time into dispatches; on GPUs one dispatch covers everything):
//   forward: steps [seg_begin, seg_end); g enters from last_state when seg_begin > 0 and leaves through it.
//   backward: p-blocks [pb_lo, pb_hi); chunks kc_hi down to kc_lo + 1 (1-based); in each chunk the recompute
//   runs over steps [rec_lo, min(rec_hi, steps)) and the adjoint over steps min(adj_hi, steps) down to adj_lo + 1;
//   with carry_in G starts from g_carry (else 0) and with carry_out G is left there.
struct ScanParams { batch: u32, len: u32, heads: u32, rank: u32, nstate: u32, headdim: u32, chunk: u32, nchunks: u32,
                    seg_begin: u32, seg_end: u32, pb_lo: u32, pb_hi: u32, kc_lo: u32, kc_hi: u32, rec_lo: u32,
                    rec_hi: u32, adj_lo: u32, adj_hi: u32, carry_in: u32, carry_out: u32, tile: u32 }
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
@group(0) @binding(12) var<storage, read_write> g_scratch: array<f32>;   // [B, H, min(chunk, L), N, P]
@group(0) @binding(13) var<storage, read_write> dv_part: array<f32>;     // [n_tiles, B, L, H, R, P]: dv per state tile
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
var<workgroup> red: array<f32, 2368>;  // BT · RS: one contribution per (lane, output), 9.25 KiB

// mamba3_scan_forward_tiled: FP value channels × FNT state tiles per workgroup (lane = nt·FP + pl, so a warp shares
// its state tile), time in tiles of `tile` steps staged in `fbuf`; FBUF floats = 16 KiB.
const FP: u32 = 32u;
const FNT: u32 = 8u;
const FW: u32 = 256u;     // FP · FNT
const MAX_NT: u32 = 16u;  // state columns per thread: ceil(MAX_N / FNT)
const MAX_TR: u32 = 16u;  // steps × rank per time tile; mirrored by the wrapper
const FBUF: u32 = 4096u;  // mirrored by the wrapper
var<workgroup> fbuf: array<f32, 4096>;

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

// The forward on GPUs (and everywhere the tile fits): one workgroup of FW threads per (batch b, head h, block of FP
// value channels); lane = nt·FP + pl holds g[c, n0 .. n0 + nw) of channel c = block·FP + pl, state tile nt
// (n0 = nt·nw, nw = ceil(N / FNT) ≤ MAX_NT), so the state lives in registers and 8× more threads walk than
// channels. Time goes in tiles of T = p.tile steps (T·R ≤ MAX_TR): all threads stage the tile's k, q (R·N each per
// step), v (R·FP) and (α, s, δ_{t+1}) in `fbuf` at once, walk the T steps from workgroup memory keeping the partial
// y_{t,r}[c] over their columns privately, then (k, q no longer needed) put those partials in `fbuf` and lane x
// adds the FNT partials of output x in order. Layout of fbuf while walking: k [T·R, N], q [T·R, N], v [T·R, FP],
// scalars [T, 3]; afterwards y partials [T·R, FW]. Grid grid_1d(B·H·ceil(P / FP)·FW, FW).
@compute @workgroup_size(256)
fn mamba3_scan_forward_tiled(@builtin(local_invocation_index) lane: u32, @builtin(workgroup_id) wid: vec3<u32>,
                             @builtin(num_workgroups) nwg: vec3<u32>) {
    let npb = (p.headdim + FP - 1u) / FP;
    let w = wid.y * nwg.x + wid.x;
    if (w >= p.batch * p.heads * npb) { return; }  // whole workgroups only (uniform)
    let pb = w % npb;
    let h = (w / npb) % p.heads;
    let b = w / (npb * p.heads);
    let N = p.nstate;
    let R = p.rank;
    let T = p.tile;
    let pl = lane % FP;
    let nt = lane / FP;
    let c = pb * FP + pl;
    let live = c < p.headdim;
    let cc = min(c, p.headdim - 1u);
    let nw = (N + FNT - 1u) / FNT;
    let n0 = min(nt * nw, N);
    let nn = min(nw, N - n0);     // this thread's columns (0 for tiles past N)
    let pbw = min(FP, p.headdim - pb * FP);  // live channels of the block
    let last = ((b * p.heads + h) * p.headdim + cc) * N;
    var g: array<f32, MAX_NT>;
    var hv: array<f32, MAX_NT>;
    var yacc: array<f32, MAX_TR>;
    for (var i = 0u; i < MAX_NT; i++) {
        g[i] = 0.0;
        if (p.seg_begin > 0u && i < nn) { g[i] = last_state[last + n0 + i]; }
    }
    let rn = R * N;
    for (var t0 = p.seg_begin; t0 < p.seg_end; t0 += T) {
        let steps = min(T, p.seg_end - t0);
        let rows = steps * R;
        let q_off = rows * N;
        let v_off = 2u * rows * N;
        let s_off = v_off + rows * FP;
        let nstage = s_off + 3u * steps;
        // Stage: k and q rows of the tile are contiguous in memory ([B, L, H, R, N] with steps apart by H·R·N).
        for (var idx = lane; idx < nstage; idx += FW) {
            var val = 0.0;
            if (idx < v_off) {
                let which = idx / q_off;       // 0: k, 1: q
                let e = idx - which * q_off;
                let jj = e / rn;
                let src = bth(b, t0 + jj, h) * rn + (e - jj * rn);
                if (which == 0u) { val = k[src]; } else { val = q[src]; }
            } else if (idx < s_off) {
                let e = idx - v_off;
                let row = e / FP;
                let x = e % FP;
                if (x < pbw) {
                    let jj = row / R;
                    val = v[v_index(b, t0 + jj, h, row % R, pb * FP + x)];
                }
            } else {
                let e = idx - s_off;
                let jj = e / 3u;
                let which = e % 3u;
                let t = t0 + jj;
                let j = bth(b, t, h);
                if (which == 0u) { val = exp(adt[j]); }
                else if (which == 1u) { val = lam[j] * dt[j] + delta_next(b, t, h); }
                else { val = delta_next(b, t, h); }
            }
            fbuf[idx] = val;
        }
        workgroupBarrier();
        for (var jj = 0u; jj < steps; jj++) {
            let t = t0 + jj;
            if (t % p.chunk == 0u && live) {
                let base = (((b * p.nchunks + t / p.chunk) * p.heads + h) * p.headdim + c) * N + n0;
                for (var i = 0u; i < MAX_NT; i++) { if (i < nn) { states[base + i] = g[i]; } }
            }
            let alpha = fbuf[s_off + 3u * jj];
            let s = fbuf[s_off + 3u * jj + 1u];
            let dn = fbuf[s_off + 3u * jj + 2u];
            let krow = jj * rn;
            let vrow = v_off + jj * R * FP + pl;
            for (var i = 0u; i < MAX_NT; i++) {
                if (i < nn) {
                    var u = 0.0;
                    for (var r = 0u; r < R; r++) { u += fbuf[vrow + r * FP] * fbuf[krow + r * N + n0 + i]; }
                    g[i] = alpha * g[i] + s * u;
                    hv[i] = g[i] - dn * u;
                }
            }
            for (var r = 0u; r < R; r++) {
                var acc = 0.0;
                let qrow = q_off + krow + r * N + n0;
                for (var i = 0u; i < MAX_NT; i++) { if (i < nn) { acc += hv[i] * fbuf[qrow + i]; } }
                yacc[jj * R + r] = acc;
            }
        }
        workgroupBarrier();
        for (var row = 0u; row < rows; row++) { fbuf[row * FW + lane] = yacc[row]; }
        workgroupBarrier();
        for (var idx = lane; idx < rows * FP; idx += FW) {
            let row = idx / FP;
            let x = idx % FP;
            if (x < pbw) {
                var acc = 0.0;
                for (var q_ = 0u; q_ < FNT; q_++) { acc += fbuf[row * FW + q_ * FP + x]; }
                y[v_index(b, t0 + row / R, h, row % R, pb * FP + x)] = acc;
            }
        }
        workgroupBarrier();
    }
    if (live) {
        for (var i = 0u; i < MAX_NT; i++) { if (i < nn) { last_state[last + n0 + i] = g[i]; } }
    }
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
    let span = min(p.chunk, p.len);
    let npb = (p.headdim + BT - 1u) / BT;
    var G: array<f32, TN>;        // α_{t+1} G_{t+1} on entering step t
    var gr: array<f32, TN>;       // the recompute's g_t; in the adjoint, g_t of the step at hand
    var gp: array<f32, TN>;       // g_{t−1}
    let nv = p.batch * p.len * p.heads * p.rank * p.headdim;  // dv_part's tile stride
    var gpn: array<f32, TN>;      // g_{t−2}, loaded a step ahead (its latency overlaps this step's reductions)
    var hv: array<f32, TN>;       // h_t[c, n]
    var duv: array<f32, TN>;      // ∂loss/∂u_t[c, n]
    let sbase = (b * p.heads + h) * span * N * p.headdim;  // g_scratch [B, H, span, N, P]: lanes adjacent
    for (var pb = p.pb_lo; pb < min(p.pb_hi, npb); pb++) {
        let c = pb * BT + lane;
        let live = c < p.headdim;
        let cc = min(c, p.headdim - 1u);  // a valid channel for the idle lanes' reads (their results are dropped)
        let carry = ((b * p.heads + h) * p.headdim + cc) * N + n0;
        for (var i = 0u; i < TN; i++) {
            G[i] = 0.0;
            if (p.carry_in != 0u && i < tn) { G[i] = g_carry[carry + i]; }
        }
        for (var kc = min(p.kc_hi, p.nchunks); kc > p.kc_lo; kc--) {
            let t0 = (kc - 1u) * p.chunk;
            let steps = min(p.chunk, p.len - t0);
            let entry = (((b * p.nchunks + kc - 1u) * p.heads + h) * p.headdim + cc) * N + n0;
            // Recompute g_t over the chunk (this thread's row c, the tile's columns) in registers, stored to
            // g_scratch (read back only by this thread; adjacent lanes adjacent, so stores coalesce).
            if (live) {
                let r_end = min(p.rec_hi, steps);
                if (p.rec_lo < r_end) {
                    for (var i = 0u; i < TN; i++) {
                        if (i < tn) {
                            if (p.rec_lo == 0u) { gr[i] = saved_states[entry + i]; }
                            else { gr[i] = g_scratch[sbase + ((p.rec_lo - 1u) * N + n0 + i) * p.headdim + cc]; }
                        }
                    }
                }
                for (var jj = p.rec_lo; jj < r_end; jj++) {
                    let t = t0 + jj;
                    let j = bth(b, t, h);
                    let alpha = exp(adt[j]);
                    let s = lam[j] * dt[j] + delta_next(b, t, h);
                    for (var i = 0u; i < TN; i++) {
                        if (i < tn) {
                            gr[i] = alpha * gr[i] + s * outer_sum(b, t, h, cc, n0 + i);
                            g_scratch[sbase + (jj * N + n0 + i) * p.headdim + cc] = gr[i];
                        }
                    }
                }
            }
            // The adjoint, last step to first; g_t carries over from the step after (g_{t−1} there), and g_{t−1}
            // was loaded during the step after (gpn), except on a dispatch's first step.
            let a_hi = min(p.adj_hi, steps);
            for (var jj = a_hi; jj > p.adj_lo; jj--) {
                let t = t0 + jj - 1u;
                let j = bth(b, t, h);
                let alpha = exp(adt[j]);
                let dn = delta_next(b, t, h);
                let s = lam[j] * dt[j] + dn;
                var dscale = 0.0;  // Σ_n G_t u_t over the tile
                var dyqu = 0.0;    // Σ_n (Σ_R dy q_Rᵀ) u_t
                var gg = 0.0;      // Σ_n G_t g_{t−1}
                for (var i = 0u; i < TN; i++) {
                    if (i < tn) {
                        let n = n0 + i;
                        if (jj == a_hi) {
                            gr[i] = g_scratch[sbase + ((jj - 1u) * N + n) * p.headdim + cc];
                            if (jj == 1u) { gp[i] = saved_states[entry + i]; }
                            else { gp[i] = g_scratch[sbase + ((jj - 2u) * N + n) * p.headdim + cc]; }
                        } else {
                            gr[i] = gp[i];
                            gp[i] = gpn[i];
                        }
                    }
                }
                for (var i = 0u; i < TN; i++) {
                    if (i < tn) {
                        let n = n0 + i;
                        let u = outer_sum(b, t, h, cc, n);
                        let dq_ = dy_q(b, t, h, cc, n);
                        let Gn = dq_ + G[i];
                        hv[i] = gr[i] - dn * u;
                        let du = s * Gn - dn * dq_;
                        duv[i] = du;
                        dscale += Gn * u;
                        dyqu += dq_ * u;
                        gg += Gn * gp[i];
                        G[i] = alpha * Gn;
                    }
                }
                if (jj > p.adj_lo + 1u) {  // the next step's g_{t−1}
                    for (var i = 0u; i < TN; i++) {
                        if (i < tn) {
                            if (jj == 2u) { gpn[i] = saved_states[entry + i]; }
                            else { gpn[i] = g_scratch[sbase + ((jj - 3u) * N + n0 + i) * p.headdim + cc]; }
                        }
                    }
                }
                if (live) {
                    for (var r = 0u; r < R; r++) {
                        var acc = 0.0;
                        for (var i = 0u; i < TN; i++) {
                            if (i < tn) { acc += duv[i] * k[qk_index(b, t, h, r, n0 + i)]; }
                        }
                        dv_part[tile * nv + v_index(b, t, h, r, c)] = acc;
                    }
                }
                // Sums over the channels of this p-block through `red`, one pass per r: dq_r in slots [0, TN),
                // dk_r in [TN, 2 TN) and, with the last, the three scalars in 2 TN ..: lane x adds column x over the
                // lanes and adds it to what the earlier p-blocks left (the same lane wrote that).
                for (var r = 0u; r < R; r++) {
                    var fy = 0.0;
                    var fv = 0.0;
                    if (live) {
                        fy = dy[v_index(b, t, h, r, cc)];
                        fv = v[v_index(b, t, h, r, cc)];
                    }
                    for (var i = 0u; i < TN; i++) {  // idle lanes add exact zeros
                        red[lane * RS + i] = select(0.0, hv[i] * fy, live);
                        red[lane * RS + TN + i] = select(0.0, duv[i] * fv, live);
                    }
                    let last_pass = r + 1u == R;
                    if (last_pass) {
                        red[lane * RS + 2u * TN] = select(0.0, dscale, live);
                        red[lane * RS + 2u * TN + 1u] = select(0.0, dyqu, live);
                        red[lane * RS + 2u * TN + 2u] = select(0.0, alpha * gg, live);
                    }
                    workgroupBarrier();
                    let x = lane % TN;
                    let is_dk = lane >= TN && lane < 2u * TN;
                    if ((lane < 2u * TN && x < tn) || (last_pass && lane >= 2u * TN && lane < 2u * TN + 3u)) {
                        // all BT rows (idle lanes' are +0.0) in four interleaved chains, combined in a fixed order
                        var a0 = 0.0;
                        var a1 = 0.0;
                        var a2 = 0.0;
                        var a3 = 0.0;
                        for (var l = 0u; l < BT; l += 4u) {
                            a0 += red[l * RS + lane];
                            a1 += red[(l + 1u) * RS + lane];
                            a2 += red[(l + 2u) * RS + lane];
                            a3 += red[(l + 3u) * RS + lane];
                        }
                        var acc = (a0 + a1) + (a2 + a3);
                        var idx = 0u;
                        if (lane < 2u * TN) {
                            idx = qk_index(b, t, h, r, n0 + x);
                            if (is_dk) {
                                if (pb > 0u) { acc += dk[idx]; }
                                dk[idx] = acc;
                            } else {
                                if (pb > 0u) { acc += dq[idx]; }
                                dq[idx] = acc;
                            }
                        } else {
                            idx = (j * ntiles + tile) * 3u + (lane - 2u * TN);
                            if (pb > 0u) { acc += part_s[idx]; }
                            part_s[idx] = acc;
                        }
                    }
                    workgroupBarrier();
                }
            }
        }
        if (p.carry_out != 0u && live) {
            for (var i = 0u; i < TN; i++) { if (i < tn) { g_carry[carry + i] = G[i]; } }
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
