// Mamba-3 mixer pieces around the scan (mambactl/reference/mamba3.py `_prepare` / `_finish` and their backward).
// proj [M = B·L, cols] is in_proj's output, columns [z | x | B | C | dd_dt | dd_A | trap | angle] with widths
// [di, di, R·G·N, R·G·N, H, H, H, S] (di = H·P). Bn, Cn [M, R, G, N] are B, C after their RMSNorm over each
// (rank, group)'s N dims: Bn = B · rstd · B_norm.weight, rstd = 1 / sqrt(mean(B²) + eps), made here from proj's
// columns in place (mamba3_prep_norm; backward mamba3_prep_norm_backward: a workgroup per row or block of rows).
//   Δ = softplus(dd_dt + dt_bias),  A = −max(heavy_tail(dd_A), A_floor),  λ = sigmoid(trap),
//   θ_t = θ_{t−1} + Δ_t π tanh(angle_t),  k = rot(θ, Bn[group of h] + B_bias),  q = rot(θ, Cn + C_bias),
//   v_r = mimo_x_r ⊙ x,  zr_r = mimo_z_r ⊙ z.
// Only θ's running sum over time (and, backward, the reverse running sum of ∂loss/∂θ) is sequential; it has its
// own kernels (mamba3_prep_theta, mamba3_prep_dtheta: a workgroup per (batch, 16 (head, angle) columns), its 16
// lanes of threads per column each summing a 16th of the time range, then a scan of the lane totals in
// workgroup memory and a second walk writing the running sums). Given θ, the channel kernels (mamba3_prep_forward,
// mamba3_prep_backward) take one (row, head, channel) per thread, and the rotation kernels one state column of
// Bn, Cn per thread walking the heads of its group (mamba3_prep_rotate; mamba3_prep_rotate_backward, which also
// sums the turned-back dq, dk over the group's heads (∂Bn, ∂Cn) and over blocks of rows (∂B_bias, ∂C_bias
// partials), so the per-head gradients before the rotation [M, H, R, N] are never stored). The ∂angle and
// ∂dd_dt columns, sums over heads / angles of the ∂θ running sum, are mamba3_prep_reduce's. Fixed order, no
// atomics.
// finish: y_r = ys_r + D v_r (SISO: the SSD core adds D v, y = ys); yn = RMSNorm over P per (head, rank) times
// norm.weight (with NORM) or y; o_r = yn_r ⊙ silu(zr_r); out = Σ_r mimo_o_r ⊙ o_r (SISO: out = o). A workgroup
// per (row, head, rank).
// SISO has zr = z (mimo_z = 1), so no zr is stored: the finish reads z in place from proj's columns and writes dz
// into dproj's (FinishParams' zstride / dzstride: the row strides of zr_in / dzr_out); v = x is read in place by
// the scan (mamba3_prep_forward copies it only for decoding) and its dx written into dproj's x columns by the
// scan's backward, so mamba3_prep_backward is MIMO's alone.

const MAX_S: u32 = 64u;  // mirrored by mambactl/ops/mamba3_prep.py
const PI: f32 = 3.14159265358979;
// θ walks: a workgroup of TC columns × TL time lanes (mirrored by THETA_LANES in mambactl/ops/mamba3_prep.py).
// 16 × 16 measured best on the H200 (32 × 8 and 64 × 4 slower; 4 × 64 too).
const TC: u32 = 16u;
const TL: u32 = 16u;

override NORM: bool = false;
override MIMO: bool = true;  // finish backward: mimo_o read and ∂mimo_o partials (false for SISO)
// finish: the skip D v is added here (MIMO); SISO's scan adds it in the SSD core, so y = ys and no y is stored
override SKIP: bool = true;

// The θ walks cover steps [seg_begin, seg_end) (the wrapper splits them into dispatches on Mesa llvmpipe, whose
// per-invocation loop budget is 65,535 iterations): the forward's running θ enters from theta at step
// seg_begin − 1, the backward's running ∂θ sum from dth at step seg_end (both written by the previous dispatch).
struct PrepParams { batch: u32, len: u32, heads: u32, rank: u32, ngroups: u32, nstate: u32, headdim: u32,
                    angles: u32, mimo: u32, cols: u32, a_floor: f32, norm_eps: f32, splits: u32, seg_begin: u32,
                    seg_end: u32 }
// zstride, dzstride: floats between rows of zr_in and of dzr_out (H·R·P for [M, H, R, P] tensors; proj's columns
// for SISO's z and dz in place, whose (head, channel) then starts at h·P of the row)
struct FinishParams { frows: u32, fheads: u32, frank: u32, fheaddim: u32, eps: f32, zstride: u32, dzstride: u32 }

@group(0) @binding(0) var<uniform> p: PrepParams;
@group(0) @binding(1) var<storage, read> proj: array<f32>;
@group(0) @binding(2) var<storage, read> B_norm_w: array<f32>;  // [N]
@group(0) @binding(3) var<storage, read> C_norm_w: array<f32>;
@group(0) @binding(4) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(5) var<storage, read> B_bias: array<f32>;   // [H, R, N]
@group(0) @binding(6) var<storage, read> C_bias: array<f32>;
@group(0) @binding(7) var<storage, read> mimo_x: array<f32>;   // [H, R, P]
@group(0) @binding(8) var<storage, read> mimo_z: array<f32>;
@group(0) @binding(9) var<storage, read_write> q: array<f32>;  // [M, H, R, N]
@group(0) @binding(10) var<storage, read_write> k: array<f32>;
@group(0) @binding(11) var<storage, read_write> v: array<f32>;  // [M, H, R, P]
@group(0) @binding(12) var<storage, read_write> zr: array<f32>;
@group(0) @binding(13) var<storage, read_write> adt: array<f32>;  // [M, H]
@group(0) @binding(14) var<storage, read_write> dt: array<f32>;
@group(0) @binding(15) var<storage, read_write> lam: array<f32>;
@group(0) @binding(16) var<storage, read_write> theta: array<f32>;  // [M, H, S]
// backward
@group(0) @binding(19) var<storage, read> theta_in: array<f32>;
@group(0) @binding(20) var<storage, read> dq: array<f32>;
@group(0) @binding(21) var<storage, read> dk: array<f32>;
@group(0) @binding(22) var<storage, read> dv: array<f32>;
@group(0) @binding(23) var<storage, read> dzr: array<f32>;
@group(0) @binding(24) var<storage, read> dadt: array<f32>;
@group(0) @binding(25) var<storage, read> ddt: array<f32>;
@group(0) @binding(26) var<storage, read> dlam: array<f32>;
@group(0) @binding(27) var<storage, read_write> dproj: array<f32>;  // [M, cols]
@group(0) @binding(28) var<storage, read_write> dC_bias_part: array<f32>;  // [blocks, H, R, N]
@group(0) @binding(29) var<storage, read_write> dB_bias_part: array<f32>;
@group(0) @binding(30) var<storage, read_write> dth: array<f32>;    // [M, H, S]: ∂loss/∂θ_t, then Σ_{t' >= t}
@group(0) @binding(31) var<storage, read_write> dvx: array<f32>;   // [M, H, R, P]: dv ⊙ x (-> ∂mimo_x)
@group(0) @binding(32) var<storage, read_write> dzz: array<f32>;   // dzr ⊙ z (-> ∂mimo_z)
// reduce
@group(0) @binding(33) var<storage, read> dt_in: array<f32>;      // [M, H]: Δ
@group(0) @binding(36) var<storage, read> dcum_in: array<f32>;    // [M, H, S]: Σ_{t' >= t} ∂loss/∂θ_{t'}
@group(0) @binding(37) var<storage, read_write> dBn: array<f32>;  // [M, R, G, N]
@group(0) @binding(38) var<storage, read_write> dCn: array<f32>;
@group(0) @binding(39) var<storage, read_write> dproj_out: array<f32>;
// finish
@group(0) @binding(40) var<uniform> fp: FinishParams;
@group(0) @binding(41) var<storage, read> ys: array<f32>;     // [M, H, R, P]
@group(0) @binding(42) var<storage, read> v_in: array<f32>;
@group(0) @binding(43) var<storage, read> zr_in: array<f32>;
@group(0) @binding(44) var<storage, read> D: array<f32>;      // [H]
@group(0) @binding(45) var<storage, read> norm_w: array<f32>; // [H·P]
@group(0) @binding(46) var<storage, read> mimo_o: array<f32>; // [H, R, P]
@group(0) @binding(47) var<storage, read_write> y: array<f32>;    // [M, H, R, P]: ys + D v
@group(0) @binding(48) var<storage, read_write> rstd: array<f32>; // [M, H, R]
@group(0) @binding(49) var<storage, read_write> o: array<f32>;    // [M, H, R, P]
@group(0) @binding(50) var<storage, read_write> out: array<f32>;  // [M, H·P]
@group(0) @binding(51) var<storage, read> y_in: array<f32>;
@group(0) @binding(52) var<storage, read> rstd_in: array<f32>;
@group(0) @binding(53) var<storage, read> o_in: array<f32>;
@group(0) @binding(54) var<storage, read> dout: array<f32>;       // [M, H·P]
@group(0) @binding(55) var<storage, read_write> dys: array<f32>;  // [M, H, R, P]
@group(0) @binding(56) var<storage, read_write> dzr_out: array<f32>;
@group(0) @binding(57) var<storage, read_write> dnw_part: array<f32>;  // [M·R, H·P]: ∂norm.weight per (row, rank)
@group(0) @binding(58) var<storage, read_write> dmo_part: array<f32>;  // [M, H, R, P]: dout ⊙ o (-> ∂mimo_o)
@group(0) @binding(59) var<storage, read_write> dD_part: array<f32>;   // [M·R, H]: Σ_p dys ⊙ v
@group(0) @binding(60) var<storage, read> dys_in: array<f32>;          // prep backward: dv += D dys
@group(0) @binding(61) var<storage, read_write> ddt_rows: array<f32>;  // [M, H]: dproj's dd_dt columns
@group(0) @binding(62) var<storage, read_write> dB_norm_part: array<f32>;  // [blocks, N]: ∂B_norm.weight per block
@group(0) @binding(63) var<storage, read_write> dC_norm_part: array<f32>;
@group(0) @binding(64) var<storage, read_write> Bn: array<f32>;  // [M, R, G, N]
@group(0) @binding(65) var<storage, read_write> Cn: array<f32>;

var<workgroup> lane_sum: array<f32, 256>;  // TC · TL: the θ walks' per-lane totals

fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }

// log(1 + e) for e >= 0. WGSL only promises log an absolute error of 2^-21 on [0.5, 2] (llvmpipe uses that
// freedom), a large relative error when 1 + e is near 1, so below e = 1/4 the series e − e²/2 + … − e¹²/12 is
// summed instead (truncation < 5e-9 relative); above it log(1 + e) >= 0.22 keeps the error below 3e-6.
fn log1p_of(e: f32) -> f32 {
    if (e >= 0.25) { return log(1.0 + e); }
    return e * (1.0 - e * (0.5 - e * (1.0 / 3.0 - e * (0.25 - e * (0.2 - e * (1.0 / 6.0 - e * (1.0 / 7.0 - e * (0.125 - e * (1.0 / 9.0 - e * (0.1 - e * (1.0 / 11.0 - e / 12.0)))))))))));
}

fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    return log1p_of(exp(x));
}

fn heavy_tail(x: f32) -> f32 { return select(1.0 / (1.0 - x), 1.0 + x, x >= 0.0); }

fn safe_tanh(x: f32) -> f32 { return tanh(clamp(x, -15.0, 15.0)); }

fn flat_id(gid: vec3<u32>, nwg: vec3<u32>, wg: u32) -> u32 { return gid.y * nwg.x * wg + gid.x; }

// Δ_t π tanh(angle_t) for (batch b, step t, head h, angle j): θ's increment.
fn theta_inc(b: u32, t: u32, h: u32, j: u32) -> f32 {
    let pr = (b * p.len + t) * p.cols;
    let off = 2u * p.heads * p.headdim + 2u * p.rank * p.ngroups * p.nstate;  // dd_dt
    let dtv = softplus(proj[pr + off + h] + dt_bias[h]);
    return dtv * PI * safe_tanh(proj[pr + off + 3u * p.heads + j]);
}

// θ's increments at steps t .. t + 3, loaded together (the walk is latency-bound).
fn theta_inc4(b: u32, t: u32, h: u32, j: u32) -> vec4<f32> {
    return vec4<f32>(theta_inc(b, t, h, j), theta_inc(b, t + 1u, h, j), theta_inc(b, t + 2u, h, j),
                     theta_inc(b, t + 3u, h, j));
}

// The θ walks' layout: workgroup w -> (batch b, column c = h·S + j, or c >= H·S past the end) for local thread
// l = lane·TC + (c mod TC), and lane's steps [x, y) of [seg_begin, seg_end).
struct Walk { b: u32, c: u32, ok: bool, t0: u32, t1: u32 }

fn walk_of(wid: vec3<u32>, nwg: vec3<u32>, l: u32) -> Walk {
    let w = wid.y * nwg.x + wid.x;
    let width = p.heads * p.angles;
    let blocks = (width + TC - 1u) / TC;
    let b = w / blocks;
    let c = (w % blocks) * TC + l % TC;
    let n = p.seg_end - p.seg_begin;
    let per = (n + TL - 1u) / TL;
    let lane = l / TC;
    let t0 = min(p.seg_end, p.seg_begin + lane * per);
    let t1 = min(p.seg_end, t0 + per);
    return Walk(b, c, b < p.batch && c < width, t0, t1);
}

// θ [M, H, S], the running sum over time. Grid grid_1d(B · ceil(H·S / TC) · 256, 256).
@compute @workgroup_size(256)
fn mamba3_prep_theta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) l: u32) {
    let wk = walk_of(wid, nwg, l);
    let S = p.angles;
    let h = wk.c / max(S, 1u);
    let j = wk.c % max(S, 1u);
    var sum = 0.0;
    if (wk.ok) {
        var t = wk.t0;
        for (; t + 4u <= wk.t1; t += 4u) {
            let v = theta_inc4(wk.b, t, h, j);
            sum += v.x;
            sum += v.y;
            sum += v.z;
            sum += v.w;
        }
        for (; t < wk.t1; t++) { sum += theta_inc(wk.b, t, h, j); }
    }
    lane_sum[l] = sum;
    workgroupBarrier();
    if (!wk.ok) { return; }
    var acc = 0.0;
    if (p.seg_begin > 0u) { acc = theta[((wk.b * p.len + p.seg_begin - 1u) * p.heads + h) * S + j]; }
    for (var e = l % TC; e < l - l % TC; e += TC) { acc += lane_sum[e]; }
    let at = (wk.b * p.len * p.heads + h) * S + j;  // θ's index at t = 0; a step is H·S further
    let step = p.heads * S;
    var t = wk.t0;
    for (; t + 4u <= wk.t1; t += 4u) {
        let v = theta_inc4(wk.b, t, h, j);
        acc += v.x;
        theta[at + t * step] = acc;
        acc += v.y;
        theta[at + (t + 1u) * step] = acc;
        acc += v.z;
        theta[at + (t + 2u) * step] = acc;
        acc += v.w;
        theta[at + (t + 3u) * step] = acc;
    }
    for (; t < wk.t1; t++) {
        acc += theta_inc(wk.b, t, h, j);
        theta[at + t * step] = acc;
    }
}

// The channel kernels' items: (row, head h, channel c < P), flat index i = (row·H + h)·P + c, so consecutive
// threads touch consecutive addresses across heads and rows. Each thread takes items i, i + stride, ... (stride:
// the threads launched): one on GPUs, up to 64 on Mesa llvmpipe, where each workgroup costs microseconds.
// Grid grid_1d(ceil(M·H·P / per-thread), 256).
struct Item { row: u32, h: u32, c: u32 }

fn item_of(i: u32) -> Item {
    let rh = i / p.headdim;
    return Item(rh / p.heads, rh % p.heads, i % p.headdim);
}

fn item_count() -> u32 { return p.batch * p.len * p.heads * p.headdim; }

// Pair slot j < ⌈N/2⌉ -> its two state dims (first, second): (2j, 2j + 1) SISO, (j, j + N/2) MIMO; slot j < S
// is turned by angle j (first' = first cos θ − second sin θ, second' = second cos θ + first sin θ), the rest are
// not. The last slot of an odd N holds one dim, (N − 1, N − 1).
fn pair_dims(j: u32) -> vec2<u32> {
    let N = p.nstate;
    if (p.mimo == 0u) { return vec2<u32>(2u * j, min(2u * j + 1u, N - 1u)); }
    if (j < N / 2u) { return vec2<u32>(j, j + N / 2u); }
    return vec2<u32>(N - 1u, N - 1u);
}

// A pair (first, second) turned by θ (cs = cos θ, sn = sin θ): (first cos θ − second sin θ, second cos θ + first
// sin θ); sn = −sin θ turns it back. The forward's q, k, the backward's rebuilt ones and its turned-back gradients
// all come from here, so the rebuilt pairs are the forward's values.
fn turned(x: vec2<f32>, cs: f32, sn: f32) -> vec2<f32> { return vec2<f32>(x.x * cs + x.y * -sn, x.y * cs + x.x * sn); }

// Channel c of (row, h): v, zr over the ranks (SISO: v = x; zr = z is read in place).
@compute @workgroup_size(256)
fn mamba3_prep_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let H = p.heads;
    let R = p.rank;
    let P = p.headdim;
    let di = H * P;
    let stride = nwg.x * nwg.y * 256u;
    let total = item_count();
    for (var i = flat_id(gid, nwg, 256u); i < total; i += stride) {
        let it = item_of(i);
        let h = it.h;
        let c = it.c;
        let rh = it.row * H + h;
        let pr = it.row * p.cols;
        let xv = proj[pr + di + h * P + c];
        if (p.mimo == 0u) {  // SISO: v = x (the scan reads it as its x), zr = z is read in place
            v[rh * P + c] = xv;
            continue;
        }
        let zv = proj[pr + h * P + c];
        for (var r = 0u; r < R; r++) {
            let mi = (h * R + r) * P + c;
            v[(rh * R + r) * P + c] = xv * mimo_x[mi];
            zr[(rh * R + r) * P + c] = zv * mimo_z[mi];
        }
    }
}

// k = rot(θ, Bn + B_bias), q = rot(θ, Cn + C_bias): thread (x, z) is pair slot x = (r·G + g)·⌈N/2⌉ + j
// (`pair_dims`) for rows z, z + rows, ... (grid (ceil(R·G·⌈N/2⌉ / 64), 1, row blocks)), reading its row's two dims
// of Bn, Cn once, taking each head's cos and sin once and walking the heads of group g. Slot x < H also writes
// head x's dt, adt, lam (x, x + slots, ... when there are more heads than slots): here, not in the channel kernel,
// where one thread in 64 doing them held up its whole warp.
@compute @workgroup_size(64)
fn mamba3_prep_rotate(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let H = p.heads;
    let R = p.rank;
    let N = p.nstate;
    let S = p.angles;
    let G = p.ngroups;
    let rgn = R * G * N;
    let slots = (N + 1u) / 2u;
    let width = R * G * slots;
    let slot = gid.x;
    if (slot >= width) { return; }
    let r = slot / (G * slots);
    let g = (slot / slots) % G;
    let j = slot % slots;
    let pd = pair_dims(j);
    let paired = pd.y != pd.x;
    let is_turned = j < S;
    let per = H / G;
    let M = p.batch * p.len;
    let off = 2u * H * p.headdim + 2u * rgn;  // dd_dt
    for (var row = gid.z; row < M; row += nwg.z) {
        for (var hh = slot; hh < H; hh += width) {
            let pr = row * p.cols;
            let dtv = softplus(proj[pr + off + hh] + dt_bias[hh]);
            let a = -max(heavy_tail(proj[pr + off + H + hh]), p.a_floor);
            dt[row * H + hh] = dtv;
            adt[row * H + hh] = a * dtv;
            lam[row * H + hh] = sigmoid(proj[pr + off + 2u * H + hh]);
        }
        let src = row * rgn + (r * G + g) * N;
        let b0 = Bn[src + pd.x];
        let b1 = Bn[src + pd.y];
        let c0 = Cn[src + pd.x];
        let c1 = Cn[src + pd.y];
        for (var e = 0u; e < per; e++) {
            let h = g * per + e;
            let rh = row * H + h;
            let bias = (h * R + r) * N;
            let dst = (rh * R + r) * N;
            var kp = vec2<f32>(b0 + B_bias[bias + pd.x], b1 + B_bias[bias + pd.y]);
            var qp = vec2<f32>(c0 + C_bias[bias + pd.x], c1 + C_bias[bias + pd.y]);
            if (is_turned) {
                let th = theta[rh * S + j];
                let cs = cos(th);
                let sn = sin(th);
                kp = turned(kp, cs, sn);
                qp = turned(qp, cs, sn);
            }
            k[dst + pd.x] = kp.x;
            q[dst + pd.x] = qp.x;
            if (paired) {
                k[dst + pd.y] = kp.y;
                q[dst + pd.y] = qp.y;
            }
        }
    }
}

// Channel c of (row, h), MIMO: dproj's x and z columns, dvx, dzz. (SISO's are written in place by the scan's
// backward, dx, and mamba3_finish_backward, dz.)
@compute @workgroup_size(256)
fn mamba3_prep_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let H = p.heads;
    let R = p.rank;
    let P = p.headdim;
    let di = H * P;
    let stride = nwg.x * nwg.y * 256u;
    let total = item_count();
    for (var i = flat_id(gid, nwg, 256u); i < total; i += stride) {
        let it = item_of(i);
        let h = it.h;
        let c = it.c;
        let rh = it.row * H + h;
        let pr = it.row * p.cols;
        let xv = proj[pr + di + h * P + c];
        let zv = proj[pr + h * P + c];
        var dx = 0.0;
        var dz = 0.0;
        for (var r = 0u; r < R; r++) {
            let vi = (rh * R + r) * P + c;
            let dvt = dv[vi] + D[h] * dys_in[vi];
            let dzv = dzr[vi];
            let mi = (h * R + r) * P + c;
            dx += dvt * mimo_x[mi];
            dz += dzv * mimo_z[mi];
            dvx[vi] = dvt * xv;
            dzz[vi] = dzv * zv;
        }
        dproj[pr + di + h * P + c] = dx;
        dproj[pr + h * P + c] = dz;
    }
}

// The rotation's backward with its sums over heads and rows: thread (x, y, z) is (group g, pair slot j) =
// x < G·⌈N/2⌉ and split y < p.splits of the group's heads, for the blocks of RB rows z, z + blocks, ... (grid
// (ceil(G·⌈N/2⌉ / 64), splits, blocks)). Slot j holds both dims of pair j (`pair_dims`), so each dq, dk element is
// read once and each angle's cos and sin are taken once, with no lane of a warp idle while its partner works out
// dθ. Per rank r and head h of its split it turns dq, dk back by θ (the bias gradient's rows, never stored): their
// sums over the split's heads, in order, are dCn, dBn [splits, M, R, G, N] (mamba3_prep_norm_backward adds the
// splits in order); their sums over the block's rows, in order, are the block's partials dC_bias_part,
// dB_bias_part [blocks, H, R, N] (the wrapper sums them over blocks); a turned pair also writes ∂loss/∂θ =
// Σ_r d1·out0 − d0·out1 over q and k into dth (rank 0 stores, later ranks add), with the rotated pair out0, out1
// rebuilt from Bn, Cn and the biases as the forward made it: reading the stored q, k [M, H, R, N] instead was 200
// of the ~540 MB this kernel moved at the mamba3-130m shape.
const RB: u32 = 8u;  // rows per block, mirrored by ROTATE_ROWS in mambactl/ops/mamba3_prep.py
@compute @workgroup_size(64)
fn mamba3_prep_rotate_backward(@builtin(global_invocation_id) gid: vec3<u32>,
                               @builtin(num_workgroups) nwg: vec3<u32>) {
    let H = p.heads;
    let R = p.rank;
    let N = p.nstate;
    let S = p.angles;
    let G = p.ngroups;
    let rgn = R * G * N;
    let M = p.batch * p.len;
    let slots = (N + 1u) / 2u;
    if (gid.x >= G * slots) { return; }
    let g = gid.x / slots;
    let j = gid.x % slots;
    let pd = pair_dims(j);
    let n0 = pd.x;
    let n1 = pd.y;  // == n0 for the unpaired last dim of an odd state: its values are computed and not stored
    let paired = n1 != n0;
    let is_turned = j < S;
    let per = H / G;
    let hs = (per + p.splits - 1u) / p.splits;  // heads per split
    let e0 = min(per, gid.y * hs);
    let e1 = min(per, e0 + hs);
    let part = gid.y * M * rgn;  // this split's dBn, dCn
    let blocks = (M + RB - 1u) / RB;
    for (var blk = gid.z; blk < blocks; blk += nwg.z) {
        let row0 = blk * RB;
        let rows = min(RB, M - row0);
        for (var r = 0u; r < R; r++) {
            var aq0 = array<f32, RB>();  // zeros for each rank (explicit: the loop re-enters it)
            var aq1 = array<f32, RB>();
            var ak0 = array<f32, RB>();
            var ak1 = array<f32, RB>();
            for (var e = e0; e < e1; e++) {
                let h = g * per + e;
                var bq = vec2<f32>(0.0);
                var bk = vec2<f32>(0.0);
                // a fixed trip count, unrollable: the rows past the end (the last block) read the last row and
                // add nothing
                for (var i = 0u; i < RB; i++) {
                    let live = i < rows;
                    let rh = min(row0 + i, M - 1u) * H + h;
                    let base = (rh * R + r) * N;
                    var xq = vec2<f32>(dq[base + n0], dq[base + n1]);
                    var xk = vec2<f32>(dk[base + n0], dk[base + n1]);
                    if (is_turned) {
                        let th = theta_in[rh * S + j];
                        let cs = cos(th);
                        let sn = sin(th);
                        if (live) {
                            // the forward's q, k pair (mamba3_prep_rotate)
                            let src = (row0 + i) * rgn + (r * G + g) * N;
                            let bias = (h * R + r) * N;
                            let oq = turned(vec2<f32>(Cn[src + n0] + C_bias[bias + n0],
                                                      Cn[src + n1] + C_bias[bias + n1]), cs, sn);
                            let ok = turned(vec2<f32>(Bn[src + n0] + B_bias[bias + n0],
                                                      Bn[src + n1] + B_bias[bias + n1]), cs, sn);
                            let t = xq.y * oq.x - xq.x * oq.y + xk.y * ok.x - xk.x * ok.y;
                            if (r == 0u) { dth[rh * S + j] = t; } else { dth[rh * S + j] += t; }
                        }
                        xq = turned(xq, cs, -sn);
                        xk = turned(xk, cs, -sn);
                    }
                    xq = select(vec2<f32>(0.0), xq, live);
                    xk = select(vec2<f32>(0.0), xk, live);
                    aq0[i] += xq.x;
                    aq1[i] += xq.y;
                    ak0[i] += xk.x;
                    ak1[i] += xk.y;
                    bq += xq;
                    bk += xk;
                }
                let bi = ((blk * H + h) * R + r) * N;
                dC_bias_part[bi + n0] = bq.x;
                dB_bias_part[bi + n0] = bk.x;
                if (paired) {
                    dC_bias_part[bi + n1] = bq.y;
                    dB_bias_part[bi + n1] = bk.y;
                }
            }
            for (var i = 0u; i < rows; i++) {
                let dst = part + (row0 + i) * rgn + (r * G + g) * N;
                dCn[dst + n0] = aq0[i];
                dBn[dst + n0] = ak0[i];
                if (paired) {
                    dCn[dst + n1] = aq1[i];
                    dBn[dst + n1] = ak1[i];
                }
            }
        }
    }
}

// The B / C RMSNorm: a workgroup of NW >= N threads per row (rows z, z + rows, ...; grid (1, 1, rows)), thread t
// the state dim t of each of the row's 2·R·G (B or C, rank, group)s in turn, Σ x² by a fixed-order tree in
// workgroup memory. Uniform control flow (every thread reaches every barrier; those past N add zeros).
override NW: u32 = 128u;  // a power of two >= N (mambactl/ops/mamba3_prep.py `norm_threads`)
var<workgroup> norm_red: array<vec2<f32>, NW>;

// proj's index of state dim 0 of row `row`'s u-th (B or C, rank, group): u < R·G are B's, then C's (after z, x).
fn bc_column(row: u32, u: u32) -> u32 { return row * p.cols + 2u * p.heads * p.headdim + u * p.nstate; }

// 1 / sqrt(mean(x²) + eps) from Σ x² over the N state dims.
fn norm_rstd(sum_sq: f32) -> f32 { return 1.0 / sqrt(sum_sq / f32(p.nstate) + p.norm_eps); }

// Σ over the workgroup's threads of `part`, in a fixed order; each thread gets it.
fn norm_sum(t: u32, part: vec2<f32>) -> vec2<f32> {
    norm_red[t] = part;
    workgroupBarrier();
    for (var s = NW / 2u; s > 0u; s = s / 2u) {
        if (t < s) { norm_red[t] += norm_red[t + s]; }
        workgroupBarrier();
    }
    let total = norm_red[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(NW)
fn mamba3_prep_norm(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wid: vec3<u32>,
                    @builtin(num_workgroups) nwg: vec3<u32>) {
    let N = p.nstate;
    let rg = p.rank * p.ngroups;
    let live = t < N;
    let M = p.batch * p.len;
    for (var row = wid.z; row < M; row += nwg.z) {
        for (var u = 0u; u < 2u * rg; u++) {  // B's (rank, group)s, then C's: adjacent in proj
            let base = bc_column(row, u);
            var x = 0.0;
            if (live) { x = proj[base + t]; }
            let rs = norm_rstd(norm_sum(t, vec2<f32>(x * x, 0.0)).x);
            if (live && u < rg) { Bn[(row * rg + u) * N + t] = x * rs * B_norm_w[t]; }
            if (live && u >= rg) { Cn[(row * rg + u - rg) * N + t] = x * rs * C_norm_w[t]; }
        }
    }
}

// ∂Bn (is_b) or ∂Cn at flat index i of [M, R, G, N]: the rotation backward's head splits added in order.
fn normed_grad(i: u32, is_b: bool) -> f32 {
    let stride = p.batch * p.len * p.rank * p.ngroups * p.nstate;
    var acc = 0.0;
    for (var sp = 0u; sp < p.splits; sp++) {
        if (is_b) { acc += dBn[sp * stride + i]; } else { acc += dCn[sp * stride + i]; }
    }
    return acc;
}

// Its backward, dBn, dCn -> dproj's B and C columns, and ∂B_norm.weight, ∂C_norm.weight partials per block of RB
// rows: a workgroup per block (blocks z, z + blocks, ...; grid (1, 1, blocks)), threads as mamba3_prep_norm,
// walking the block's rows in order. With x̂ = x · rstd and g = dBn ⊙ w:
//   dB = rstd · g − x̂ · rstd · Σ_m g_m x̂_m / N,  ∂w = Σ dBn ⊙ x̂  (Σ x² and Σ g x by one tree).
@compute @workgroup_size(NW)
fn mamba3_prep_norm_backward(@builtin(local_invocation_index) t: u32, @builtin(workgroup_id) wid: vec3<u32>,
                             @builtin(num_workgroups) nwg: vec3<u32>) {
    let N = p.nstate;
    let rg = p.rank * p.ngroups;
    let live = t < N;
    let M = p.batch * p.len;
    let blocks = (M + RB - 1u) / RB;
    for (var blk = wid.z; blk < blocks; blk += nwg.z) {
        var wb = 0.0;
        var wc = 0.0;
        for (var row = blk * RB; row < min(M, blk * RB + RB); row++) {
            for (var u = 0u; u < 2u * rg; u++) {
                let is_b = u < rg;
                let base = bc_column(row, u);  // in proj and dproj
                let di = (row * rg + select(u - rg, u, is_b)) * N + t;        // in dBn / dCn
                var x = 0.0;
                var gw = 0.0;
                var dy = 0.0;
                if (live) {
                    x = proj[base + t];
                    dy = normed_grad(di, is_b);
                    gw = dy * select(C_norm_w[t], B_norm_w[t], is_b);
                }
                let sums = norm_sum(t, vec2<f32>(x * x, gw * x));
                let rs = norm_rstd(sums.x);
                if (live) { dproj[base + t] = rs * (gw - x * rs * rs * sums.y / f32(N)); }
                // x, dy are 0 past N
                if (is_b) { wb += dy * x * rs; } else { wc += dy * x * rs; }
            }
        }
        if (live) {
            dB_norm_part[blk * N + t] = wb;
            dC_norm_part[blk * N + t] = wc;
        }
    }
}

// dth [M, H, S] in place: ∂loss/∂θ_t -> Σ_{t' >= t} ∂loss/∂θ_{t'} (θ is a running sum).
// Grid as mamba3_prep_theta.
@compute @workgroup_size(256)
fn mamba3_prep_dtheta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                      @builtin(local_invocation_index) l: u32) {
    let wk = walk_of(wid, nwg, l);
    let S = p.angles;
    let h = wk.c / max(S, 1u);
    let j = wk.c % max(S, 1u);
    let at = (wk.b * p.len * p.heads + h) * S + j;  // dth's index at t = 0; a step is H·S further
    let step = p.heads * S;
    var sum = 0.0;
    if (wk.ok) {
        var t = wk.t0;
        for (; t + 4u <= wk.t1; t += 4u) {  // four loads in flight at once (the walk is latency-bound)
            let v = vec4<f32>(dth[at + t * step], dth[at + (t + 1u) * step], dth[at + (t + 2u) * step],
                              dth[at + (t + 3u) * step]);
            sum += v.x;
            sum += v.y;
            sum += v.z;
            sum += v.w;
        }
        for (; t < wk.t1; t++) { sum += dth[at + t * step]; }
    }
    lane_sum[l] = sum;
    workgroupBarrier();
    if (!wk.ok) { return; }
    var acc = 0.0;
    if (p.seg_end < p.len) { acc = dth[at + p.seg_end * step]; }
    for (var e = l + TC; e < TC * TL; e += TC) { acc += lane_sum[e]; }
    var t = wk.t1;
    for (; t >= wk.t0 + 4u; t -= 4u) {  // steps t − 1 down to t − 4: loaded before any is stored
        let v = vec4<f32>(dth[at + (t - 1u) * step], dth[at + (t - 2u) * step], dth[at + (t - 3u) * step],
                          dth[at + (t - 4u) * step]);
        acc += v.x;
        dth[at + (t - 1u) * step] = acc;
        acc += v.y;
        dth[at + (t - 2u) * step] = acc;
        acc += v.z;
        dth[at + (t - 3u) * step] = acc;
        acc += v.w;
        dth[at + (t - 4u) * step] = acc;
    }
    for (; t > wk.t0; t--) {
        acc += dth[at + (t - 1u) * step];
        dth[at + (t - 1u) * step] = acc;
    }
}

// Sums over heads and angles in fixed order, per row. Grid (ceil((S + H) / 64), 1, rows), thread (x, z) for rows
// z, z + rows, ...: x < S angle x's column of dproj (π (1 − tanh²) Σ_h dcum·Δ), S <= x < S + H head h = x − S's
// dd_dt column (∂Δ from dt, A·Δ and π Σ_j dcum_j tanh(angle_j), through the softplus), also into ddt_rows
// [M, H] (contiguous: ∂dt_bias is its column sums), and its dd_A and trap columns.
@compute @workgroup_size(64)
fn mamba3_prep_reduce(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let H = p.heads;
    let S = p.angles;
    let M = p.batch * p.len;
    let x = gid.x;
    let off = p.cols - S - 3u * H;  // dd_dt
    if (x >= S + H) { return; }
    for (var row = gid.z; row < M; row += nwg.z) {
        let pr = row * p.cols;
        if (x < S) {
            var acc = 0.0;
            for (var h = 0u; h < H; h++) { acc += dcum_in[(row * H + h) * S + x] * dt_in[row * H + h]; }
            let th = safe_tanh(proj[pr + off + 3u * H + x]);
            dproj_out[pr + off + 3u * H + x] = PI * (1.0 - th * th) * acc;
            continue;
        }
        let h = x - S;
        let rh = row * H + h;
        let pre = proj[pr + off + h] + dt_bias[h];
        let a = -max(heavy_tail(proj[pr + off + H + h]), p.a_floor);
        var dd = ddt[rh] + dadt[rh] * a;
        for (var j = 0u; j < S; j++) { dd += PI * dcum_in[rh * S + j] * safe_tanh(proj[pr + off + 3u * H + j]); }
        let dpre = dd * select(sigmoid(pre), 1.0, pre > 20.0);
        dproj_out[pr + off + h] = dpre;
        ddt_rows[rh] = dpre;
        let dda = proj[pr + off + H + h];
        var dA = 0.0;
        if (heavy_tail(dda) >= p.a_floor) {
            dA = -dadt[rh] * dt_in[rh] * select(1.0 / ((1.0 - dda) * (1.0 - dda)), 1.0, dda >= 0.0);
        }
        dproj_out[pr + off + H + h] = dA;
        let lv = lam[rh];
        dproj_out[pr + off + 2u * H + h] = dlam[rh] * lv * (1.0 - lv);
    }
}

// finish: FL lanes per (row, head, rank) item (FW / FL items per workgroup of FW), the lanes over its P channels
// (consecutive lanes on consecutive addresses), the sums over P (the norm's Σ y², the backward's Σ dyn·w·ŷ and
// Σ dys·v) by a fixed-order tree in workgroup memory (deterministic). FL = 16 on GPUs (the H200 at P = 64: half
// the time of FL = 64, 4 channels per lane, 4 items per workgroup, 2 fewer tree rounds); FL = 1 on CPU adapters,
// where a barrier and a workgroup cost more than a strided walk: one invocation per item, no barrier. Items past
// the end (the last workgroup) run with empty channel loops so that every lane reaches every barrier.
const FW: u32 = 64u;  // workgroup size of the finish kernels
override FL: u32 = 16u;  // lanes per item, dividing FW (mambactl/ops/mamba3_prep.py picks it)
var<workgroup> finish_red: array<f32, FW>;

struct FinishLane { item: u32, lane: u32, live: bool }

fn finish_lane(local: u32, wid: vec3<u32>, nwg: vec3<u32>) -> FinishLane {
    let item = (wid.y * nwg.x + wid.x) * (FW / FL) + local / FL;
    return FinishLane(item, local % FL, item < fp.frows * fp.fheads * fp.frank);
}

// Σ over the FL lanes of an item of `part`, in a fixed order; each of them gets it. Uniform control flow only.
fn finish_sum(local: u32, lane: u32, part: f32) -> f32 {
    if (FL == 1u) { return part; }
    finish_red[local] = part;
    workgroupBarrier();
    for (var s = FL / 2u; s > 0u; s = s / 2u) {
        if (lane < s) { finish_red[local] += finish_red[local + s]; }
        workgroupBarrier();
    }
    let total = finish_red[local - lane];
    workgroupBarrier();
    return total;
}

// y = ys + D v (SKIP; else y = ys, not stored), yn = RMSNorm(y) ⊙ w (NORM) or y, o = yn ⊙ silu(zr). With SISO o
// is already out (R = 1, mimo_o = 1).
fn finish_y(i: u32) -> f32 {
    if (SKIP) { return y[i]; }
    return ys[i];
}

@compute @workgroup_size(64)
fn mamba3_finish_forward(@builtin(local_invocation_index) local: u32, @builtin(workgroup_id) wid: vec3<u32>,
                         @builtin(num_workgroups) nwg: vec3<u32>) {
    let it = finish_lane(local, wid, nwg);
    let i = it.item;
    let P = fp.fheaddim;
    let walk = select(0u, P, it.live);  // channels this lane walks: none past the end
    let h = (i / fp.frank) % fp.fheads;
    let base = i * P;
    let zbase = (i / (fp.frank * fp.fheads)) * fp.zstride + (i % (fp.frank * fp.fheads)) * P;
    var ss = 0.0;
    for (var c = it.lane; c < walk; c += FL) {
        var yv = ys[base + c];
        if (SKIP) {
            yv += D[h] * v_in[base + c];
            y[base + c] = yv;
        }
        if (NORM) {
            ss += yv * yv;
        } else {  // one pass: o from the y in hand
            let zv = zr_in[zbase + c];
            o[base + c] = yv * zv * sigmoid(zv);
        }
    }
    var rs = 1.0;
    if (NORM) { rs = inverseSqrt(finish_sum(local, it.lane, ss) / f32(P) + fp.eps); }
    if (it.live && it.lane == 0u) { rstd[i] = rs; }
    if (!NORM) { return; }
    for (var c = it.lane; c < walk; c += FL) {
        let zv = zr_in[zbase + c];
        o[base + c] = finish_y(base + c) * rs * norm_w[h * P + c] * zv * sigmoid(zv);
    }
}

// out[row, h·P + c] = Σ_r mimo_o[h, r, c] o[row, h, r, c] (r in order); MIMO only. Grid grid_1d(M·H·P).
@compute @workgroup_size(256)
fn mamba3_finish_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let P = fp.fheaddim;
    if (i >= fp.frows * fp.fheads * P) { return; }
    let c = i % P;
    let h = (i / P) % fp.fheads;
    let row = i / (P * fp.fheads);
    var acc = 0.0;
    for (var r = 0u; r < fp.frank; r++) {
        acc += mimo_o[(h * fp.frank + r) * P + c] * o_in[((row * fp.fheads + h) * fp.frank + r) * P + c];
    }
    out[i] = acc;
}

// dys (gradient reaching the scan output and, times D, v), dzr and the per-item parameter partials (∂D's with
// SKIP); MIMO also dout ⊙ o (-> ∂mimo_o) and reads mimo_o (SISO: 1). Workgroups as mamba3_finish_forward.
@compute @workgroup_size(64)
fn mamba3_finish_backward(@builtin(local_invocation_index) local: u32, @builtin(workgroup_id) wid: vec3<u32>,
                          @builtin(num_workgroups) nwg: vec3<u32>) {
    let it = finish_lane(local, wid, nwg);
    let i = it.item;
    let P = fp.fheaddim;
    let walk = select(0u, P, it.live);
    let r = i % fp.frank;
    let h = (i / fp.frank) % fp.fheads;
    let row = i / (fp.frank * fp.fheads);
    let base = i * P;
    let item_in_row = i % (fp.frank * fp.fheads);
    let zbase = row * fp.zstride + item_in_row * P;
    let dzbase = row * fp.dzstride + item_in_row * P;
    var rs = 1.0;
    if (it.live) { rs = rstd_in[i]; }
    var dot = 0.0;  // Σ_c dyn·w·ŷ (RMSNorm backward)
    var dd = 0.0;   // Σ_c dys·v (∂D)
    for (var c = it.lane; c < walk; c += FL) {
        let dout_v = dout[row * fp.fheads * P + h * P + c];
        var do_ = dout_v;
        if (MIMO) {
            do_ = dout_v * mimo_o[(h * fp.frank + r) * P + c];
            dmo_part[base + c] = dout_v * o_in[base + c];
        }
        let zv = zr_in[zbase + c];
        let sg = sigmoid(zv);
        var yn = y_in[base + c];
        if (NORM) { yn = yn * rs * norm_w[h * P + c]; }
        dzr_out[dzbase + c] = do_ * yn * sg * (1.0 + zv * (1.0 - sg));
        let dyn = do_ * zv * sg;
        dys[base + c] = dyn;  // with NORM: before the norm, finished below (by the same lane)
        if (NORM) {
            dot += dyn * norm_w[h * P + c] * y_in[base + c] * rs;
            dnw_part[(row * fp.frank + r) * fp.fheads * P + h * P + c] = dyn * y_in[base + c] * rs;
        } else if (SKIP) {
            dd += dyn * v_in[base + c];
        }
    }
    if (NORM) {
        dot = finish_sum(local, it.lane, dot);
        for (var c = it.lane; c < walk; c += FL) {
            let g = rs * (dys[base + c] * norm_w[h * P + c] - y_in[base + c] * rs * dot / f32(P));
            dys[base + c] = g;
            if (SKIP) { dd += g * v_in[base + c]; }
        }
    }
    if (!SKIP) { return; }
    dd = finish_sum(local, it.lane, dd);
    if (it.live && it.lane == 0u) { dD_part[(row * fp.frank + r) * fp.fheads + h] = dd; }
}
