// Mamba-3 scan (exponential-trapezoidal recurrence, MIMO rank R) and its exact backward, as
// mambactl/reference/mamba3.py's mamba3_scan / mamba3_scan_backward, plus the decoding step (any R). Training and
// prefill of SISO layers (R = 1) do not come here: they run the chunked SSD core (kernels/ssd.wgsl) with the fold of
// kernels/mamba3_fold.wgsl (mambactl/ops/mamba3_scan.py); these kernels still take R = 1. Layouts (row-major):
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
// Backward (recurrent, exact): one workgroup of 256 threads per (b, h, block of 64 state columns); the value
// channels in blocks of 64 walked in order (any headdim), each thread holding 4 channels × 4 columns of the state in
// registers. It walks the chunks last to first, recomputes the chunk's g_t into g_scratch
// ([B·H·ceil(N / 64), min(chunk, L), 16, 256]: adjacent lanes adjacent, read back only by the same thread), then
// runs the adjoint G_t = Σ_R dy_{t,R} q_{t,R}ᵀ + α_{t+1} G_{t+1} backwards. Per step and rank r, the sums over
// channels (dq_r = Σ_p h[p, n] dy_r[p], dk_r = Σ_p du[p, n] v_r[p]), over columns (dv_r = Σ_n du[p, n] k_r[n]) and,
// on the last pass, of three scalars go through workgroup memory `bred` once: each thread first adds its own 4
// channels / 4 columns, then one lane per output adds 16 thread rows in a fixed order (2R barriers a step).
// dv over column blocks: dv_part [n_blocks, B, L, H, R, P], added in order by mamba3_scan_sum_channels (none when
// N ≤ 64); the scalars, part_s [B, L, H, 8·n_blocks, 3] (8 warp slices per block), by mamba3_scan_scalars.
// Nothing scales as B·L·H·P·N; no atomics, so results are deterministic.

const MAX_N: u32 = 128u;  // mirrored by the wrapper (mambactl/ops/mamba3_scan.py)
const MAX_R: u32 = 16u;
const BW: u32 = 256u;   // mamba3_scan_backward: threads per workgroup
const BPB: u32 = 64u;   // value channels per block (16 thread rows × 4); mirrored by the wrapper
const BNB: u32 = 64u;   // state columns per workgroup (16 thread columns × 4); mirrored by the wrapper
const BDV: u32 = 2048u; // bred: dq / dk partials [16, 128] at 0, dv partials [16, 64] at BDV, scalars [3, 256] at BSC
const BSC: u32 = 3072u;

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
var<workgroup> bred: array<f32, 3840>;  // mamba3_scan_backward's per-step partials, 15 KiB

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

// One workgroup of BW = 256 threads per (batch b, head h, block of BNB = 64 state columns); value channels in
// blocks of BPB = 64, walked in order (pb = 0, 1, ..), so any headdim works. Thread lane = cg·16 + ng holds the
// 4 × 4 state elements e = ci·4 + ni of channels c = pb·64 + ci·16 + cg and columns n = nb·64 + ni·16 + ng
// (strided, so a warp's k / q loads and its workgroup-memory stores are contiguous) in registers: G, g_t, g_{t−1},
// h_t, ∂u_t.
// Elements past P or N hold exact zeros (their loads read 0), so they add nothing. Per step and rank r, each thread
// sums its 4 channels (dq_r, dk_r partials of its 4 columns) and its 4 columns (dv_r partials of its 4 channels)
// privately, stores them in `bred` (XOR-swizzled: conflict-free stores and loads), one barrier, then lanes 0..191
// each add one output over the 16 thread rows in a fixed order (four interleaved chains); on the last pass the
// three per-step scalars go the same way, lanes 192..215 adding 32 lanes each (one warp's slice: part_s holds
// 8 slices per column block). A second barrier ends the pass. So 2R barriers per step for 16 elements × 256
// threads (the old kernel: 2R for 16 × 64), and 16 (not 64) loads per reduced output.
// Grid grid_1d(B·H·ceil(N / BNB)·BW, BW).
@compute @workgroup_size(256)
fn mamba3_scan_backward(@builtin(local_invocation_index) lane: u32, @builtin(workgroup_id) wid: vec3<u32>,
                        @builtin(num_workgroups) nwg: vec3<u32>) {
    let ncb = (p.nstate + BNB - 1u) / BNB;
    let w = wid.y * nwg.x + wid.x;
    if (w >= p.batch * p.heads * ncb) { return; }  // whole workgroups only (uniform)
    let nb = w % ncb;
    let h = (w / ncb) % p.heads;
    let b = w / (ncb * p.heads);
    let N = p.nstate;
    let P = p.headdim;
    let R = p.rank;
    let cg = lane / 16u;
    let ng = lane % 16u;
    let span = min(p.chunk, p.len);
    let npb = (P + BPB - 1u) / BPB;
    let nv = p.batch * p.len * p.heads * R * P;  // dv_part's column-block stride
    let nsl = ncb * 8u;                          // part_s slices
    var G: array<f32, 16>;   // α_{t+1} G_{t+1} on entering step t
    var gr: array<f32, 16>;  // recompute: g_t; adjoint: g_t of the step at hand
    var gp: array<f32, 16>;  // g_{t−1}
    var hv: array<f32, 16>;  // h_t
    var duv: array<f32, 16>; // ∂loss/∂u_t
    var nidx: array<u32, 4>; // this thread's columns (clamped) and whether they exist
    var nok: array<bool, 4>;
    for (var ni = 0u; ni < 4u; ni++) {
        let n = nb * BNB + ni * 16u + ng;
        nok[ni] = n < N;
        nidx[ni] = min(n, N - 1u);
    }
    let sbase = w * span * 16u * BW;  // g_scratch [B·H·ncb, span, 16, BW]: lanes adjacent
    for (var pb = p.pb_lo; pb < min(p.pb_hi, npb); pb++) {
        var cidx: array<u32, 4>;
        var cok: array<bool, 4>;
        for (var ci = 0u; ci < 4u; ci++) {
            let c = pb * BPB + ci * 16u + cg;
            cok[ci] = c < P;
            cidx[ci] = min(c, P - 1u);
        }
        for (var e = 0u; e < 16u; e++) {
            G[e] = 0.0;
            gr[e] = 0.0;
            gp[e] = 0.0;
            let ok = cok[e / 4u] && nok[e % 4u];
            if (p.carry_in != 0u && ok) {
                G[e] = g_carry[((b * p.heads + h) * P + cidx[e / 4u]) * N + nidx[e % 4u]];
            }
        }
        for (var kc = min(p.kc_hi, p.nchunks); kc > p.kc_lo; kc--) {
            let t0 = (kc - 1u) * p.chunk;
            let steps = min(p.chunk, p.len - t0);
            let entry = ((b * p.nchunks + kc - 1u) * p.heads + h) * P;
            // Recompute g_t over the chunk into g_scratch (read back only by this thread; stores coalesce).
            let r_end = min(p.rec_hi, steps);
            if (p.rec_lo < r_end) {
                for (var e = 0u; e < 16u; e++) {
                    let ok = cok[e / 4u] && nok[e % 4u];
                    if (p.rec_lo == 0u) {
                        gr[e] = select(0.0, saved_states[(entry + cidx[e / 4u]) * N + nidx[e % 4u]], ok);
                    } else {
                        gr[e] = g_scratch[sbase + ((p.rec_lo - 1u) * 16u + e) * BW + lane];
                    }
                }
            }
            for (var jj = p.rec_lo; jj < r_end; jj++) {
                let t = t0 + jj;
                let j = bth(b, t, h);
                let alpha = exp(adt[j]);
                let s = lam[j] * dt[j] + delta_next(b, t, h);
                var u: array<f32, 16>;
                for (var e = 0u; e < 16u; e++) { u[e] = 0.0; }
                for (var r = 0u; r < R; r++) {
                    for (var e = 0u; e < 16u; e++) {
                        let vv = select(0.0, v[v_index(b, t, h, r, cidx[e / 4u])], cok[e / 4u]);
                        let kk = select(0.0, k[qk_index(b, t, h, r, nidx[e % 4u])], nok[e % 4u]);
                        u[e] += vv * kk;
                    }
                }
                for (var e = 0u; e < 16u; e++) {
                    gr[e] = alpha * gr[e] + s * u[e];
                    g_scratch[sbase + (jj * 16u + e) * BW + lane] = gr[e];
                }
            }
            // The adjoint, last step to first.
            let a_hi = min(p.adj_hi, steps);
            for (var jj = a_hi; jj > p.adj_lo; jj--) {
                let t = t0 + jj - 1u;
                let j = bth(b, t, h);
                let alpha = exp(adt[j]);
                let dn = delta_next(b, t, h);
                let s = lam[j] * dt[j] + dn;
                for (var e = 0u; e < 16u; e++) {
                    let ok = cok[e / 4u] && nok[e % 4u];
                    if (jj == a_hi) { gr[e] = g_scratch[sbase + ((jj - 1u) * 16u + e) * BW + lane]; }
                    else { gr[e] = gp[e]; }
                    if (jj == 1u) { gp[e] = select(0.0, saved_states[(entry + cidx[e / 4u]) * N + nidx[e % 4u]], ok); }
                    else { gp[e] = g_scratch[sbase + ((jj - 2u) * 16u + e) * BW + lane]; }
                }
                var u: array<f32, 16>;
                var dq_: array<f32, 16>;
                for (var e = 0u; e < 16u; e++) { u[e] = 0.0; dq_[e] = 0.0; }
                for (var r = 0u; r < R; r++) {
                    for (var e = 0u; e < 16u; e++) {
                        let ci = cidx[e / 4u];
                        let nn = nidx[e % 4u];
                        let cm = cok[e / 4u];
                        let nm = nok[e % 4u];
                        let vi = v_index(b, t, h, r, ci);
                        let ki = qk_index(b, t, h, r, nn);
                        u[e] += select(0.0, v[vi], cm) * select(0.0, k[ki], nm);
                        dq_[e] += select(0.0, dy[vi], cm) * select(0.0, q[ki], nm);
                    }
                }
                var dscale = 0.0;  // Σ G_t u_t over this thread's elements
                var dyqu = 0.0;    // Σ (Σ_R dy q_Rᵀ) u_t
                var gg = 0.0;      // Σ G_t g_{t−1}
                for (var e = 0u; e < 16u; e++) {
                    let Gn = dq_[e] + G[e];
                    hv[e] = gr[e] - dn * u[e];
                    duv[e] = s * Gn - dn * dq_[e];
                    dscale += Gn * u[e];
                    dyqu += dq_[e] * u[e];
                    gg += Gn * gp[e];
                    G[e] = alpha * Gn;
                }
                for (var r = 0u; r < R; r++) {
                    let last_pass = r + 1u == R;
                    var fy: array<f32, 4>;
                    var fv: array<f32, 4>;
                    var fk: array<f32, 4>;
                    for (var i = 0u; i < 4u; i++) {
                        fy[i] = select(0.0, dy[v_index(b, t, h, r, cidx[i])], cok[i]);
                        fv[i] = select(0.0, v[v_index(b, t, h, r, cidx[i])], cok[i]);
                        fk[i] = select(0.0, k[qk_index(b, t, h, r, nidx[i])], nok[i]);
                    }
                    let sw = 16u * (cg & 1u);
                    for (var ni = 0u; ni < 4u; ni++) {
                        let x = ni * 16u + ng;
                        bred[cg * 128u + (x ^ sw)] =
                            ((hv[ni] * fy[0] + hv[4u + ni] * fy[1]) + (hv[8u + ni] * fy[2] + hv[12u + ni] * fy[3]));
                        bred[cg * 128u + ((64u + x) ^ sw)] =
                            ((duv[ni] * fv[0] + duv[4u + ni] * fv[1]) + (duv[8u + ni] * fv[2] + duv[12u + ni] * fv[3]));
                    }
                    for (var ci = 0u; ci < 4u; ci++) {
                        let y_ = ci * 16u + cg;
                        bred[BDV + ng * 64u + (y_ ^ (2u * ng))] =
                            ((duv[ci * 4u] * fk[0] + duv[ci * 4u + 1u] * fk[1])
                             + (duv[ci * 4u + 2u] * fk[2] + duv[ci * 4u + 3u] * fk[3]));
                    }
                    if (last_pass) {
                        let m = lane / 32u;
                        let i = lane % 32u;
                        bred[BSC + m * 32u + ((i + m) % 32u)] = dscale;
                        bred[BSC + 256u + m * 32u + ((i + m + 8u) % 32u)] = dyqu;
                        bred[BSC + 512u + m * 32u + ((i + m + 16u) % 32u)] = alpha * gg;
                    }
                    workgroupBarrier();
                    if (lane < 192u) {
                        let x = lane % 64u;
                        var a0 = 0.0;
                        var a1 = 0.0;
                        var a2 = 0.0;
                        var a3 = 0.0;
                        if (lane < 128u) {  // dq_r (lanes 0..63) and dk_r (64..127) of column nb·64 + x
                            let col = lane;
                            for (var g4 = 0u; g4 < 16u; g4 += 4u) {
                                a0 += bred[g4 * 128u + col];
                                a1 += bred[(g4 + 1u) * 128u + (col ^ 16u)];
                                a2 += bred[(g4 + 2u) * 128u + col];
                                a3 += bred[(g4 + 3u) * 128u + (col ^ 16u)];
                            }
                        } else {            // dv_r of channel pb·64 + x, over the 16 column rows
                            for (var g4 = 0u; g4 < 16u; g4 += 4u) {
                                a0 += bred[BDV + g4 * 64u + (x ^ (2u * g4))];
                                a1 += bred[BDV + (g4 + 1u) * 64u + (x ^ (2u * g4 + 2u))];
                                a2 += bred[BDV + (g4 + 2u) * 64u + (x ^ (2u * g4 + 4u))];
                                a3 += bred[BDV + (g4 + 3u) * 64u + (x ^ (2u * g4 + 6u))];
                            }
                        }
                        var acc = (a0 + a1) + (a2 + a3);
                        if (lane < 128u) {
                            let n = nb * BNB + x;
                            if (n < N) {
                                let idx = qk_index(b, t, h, r, n);
                                if (lane < 64u) {
                                    if (pb > 0u) { acc += dq[idx]; }
                                    dq[idx] = acc;
                                } else {
                                    if (pb > 0u) { acc += dk[idx]; }
                                    dk[idx] = acc;
                                }
                            }
                        } else {
                            let c = pb * BPB + x;
                            if (c < P) { dv_part[nb * nv + v_index(b, t, h, r, c)] = acc; }
                        }
                    } else if (last_pass && lane < 216u) {  // scalar sc over warp m's 32 lanes
                        let jx = lane - 192u;
                        let sc = jx / 8u;
                        let m = jx % 8u;
                        var a0 = 0.0;
                        var a1 = 0.0;
                        var a2 = 0.0;
                        var a3 = 0.0;
                        let base = BSC + sc * 256u + m * 32u;
                        for (var i = 0u; i < 32u; i += 4u) {
                            a0 += bred[base + (i + m + 8u * sc) % 32u];
                            a1 += bred[base + (i + 1u + m + 8u * sc) % 32u];
                            a2 += bred[base + (i + 2u + m + 8u * sc) % 32u];
                            a3 += bred[base + (i + 3u + m + 8u * sc) % 32u];
                        }
                        var acc = (a0 + a1) + (a2 + a3);
                        let idx = (j * nsl + nb * 8u + m) * 3u + sc;
                        if (pb > 0u) { acc += part_s[idx]; }
                        part_s[idx] = acc;
                    }
                    workgroupBarrier();
                }
            }
        }
        if (p.carry_out != 0u) {
            for (var e = 0u; e < 16u; e++) {
                if (cok[e / 4u] && nok[e % 4u]) {
                    g_carry[((b * p.heads + h) * P + cidx[e / 4u]) * N + nidx[e % 4u]] = G[e];
                }
            }
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

// One decoding step: h = α h + β Σ_r v_prev k_prevᵀ + γ Σ_r v kᵀ, y_r = h q_r. STEP_LANES threads take a row
// (b, h, p) of h, each the states n ≡ its lane (mod STEP_LANES), and a tree in fbuf adds their parts of each y_r:
// 32 on GPUs (one thread walking all N was latency-bound, 45 µs a layer on the H200), 1 on CPU adapters (as
// ssd_step). Grid grid_1d(B·H·P·STEP_LANES, 256).
override STEP_LANES: u32 = 32u;

@compute @workgroup_size(256)
fn mamba3_scan_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                    @builtin(local_invocation_index) t: u32) {
    let i = (gid.y * nwg.x * 256u + gid.x) / STEP_LANES;
    let lane = t % STEP_LANES;
    let P = st.sheaddim;
    let N = st.snstate;
    let R = st.srank;
    let inside = i < st.sbatch * st.sheads * P;
    let c = i % P;
    let bh = i / P;  // b·H + h
    let base = i * N;
    if (inside) {
        let alpha = exp(adt[bh]);
        let beta = (1.0 - lam[bh]) * dt[bh] * alpha;
        let gamma = lam[bh] * dt[bh];
        for (var n = lane; n < N; n += STEP_LANES) {
            var up = 0.0;
            var u = 0.0;
            for (var r = 0u; r < R; r++) {
                up += v_prev[(bh * R + r) * P + c] * k_prev[(bh * R + r) * N + n];
                u += v[(bh * R + r) * P + c] * k[(bh * R + r) * N + n];
            }
            ssm_state[base + n] = alpha * ssm_state[base + n] + beta * up + gamma * u;
        }
    }
    for (var r = 0u; r < R; r++) {
        var acc = 0.0;
        if (inside) {
            for (var n = lane; n < N; n += STEP_LANES) { acc += ssm_state[base + n] * q[(bh * R + r) * N + n]; }
        }
        if (STEP_LANES > 1u) {  // each thread only ever writes and finally reads its own slot: no barrier after
            fbuf[t] = acc;
            workgroupBarrier();
            for (var half = STEP_LANES / 2u; half > 0u; half >>= 1u) {
                if (lane < half) { fbuf[t] += fbuf[t + half]; }
                workgroupBarrier();
            }
            acc = fbuf[t];
        }
        if (inside && lane == 0u) { y[(bh * R + r) * P + c] = acc; }
    }
}
