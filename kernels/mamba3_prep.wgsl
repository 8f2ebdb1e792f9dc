// Mamba-3 mixer pieces around the scan (mambactl/reference/mamba3.py `_prepare` / `_finish` and their backward).
// proj [M = B·L, cols] is in_proj's output, columns [z | x | B | C | dd_dt | dd_A | trap | angle] with widths
// [di, di, R·G·N, R·G·N, H, H, H, S] (di = H·P). Bn, Cn [M, R, G, N] are B, C after their RMSNorm.
//   Δ = softplus(dd_dt + dt_bias),  A = −max(heavy_tail(dd_A), A_floor),  λ = sigmoid(trap),
//   θ_t = θ_{t−1} + Δ_t π tanh(angle_t),  k = rot(θ, Bn[group of h] + B_bias),  q = rot(θ, Cn + C_bias),
//   v_r = mimo_x_r ⊙ x,  zr_r = mimo_z_r ⊙ z.
// prep threads: one per (batch b, head h), walking time in order (θ is a running sum over time).
// The backward walks time backwards with the reverse running sum of ∂loss/∂θ; sums over heads (∂angle, and
// ∂Bn, ∂Cn over the heads of a group) go out per head and mamba3_prep_reduce adds them in order.
// finish: y_r = ys_r + D v_r; yn = RMSNorm over P per (head, rank) times norm.weight (with NORM) or y;
// o_r = yn_r ⊙ silu(zr_r); out = Σ_r mimo_o_r ⊙ o_r. One thread per (row, head, rank).

const MAX_S: u32 = 64u;  // mirrored by mambactl/ops/mamba3_prep.py
const PI: f32 = 3.14159265358979;

override NORM: bool = false;

// prep forward and backward walk steps [seg_begin, seg_end) (the wrapper splits the walk into dispatches on Mesa
// llvmpipe, whose per-invocation loop budget is 65,535 iterations): the forward's running θ enters from theta at
// step seg_begin − 1; the backward's running ∂θ sum enters from dcum_carry when seg_end < len and leaves there.
struct PrepParams { batch: u32, len: u32, heads: u32, rank: u32, ngroups: u32, nstate: u32, headdim: u32,
                    angles: u32, mimo: u32, cols: u32, a_floor: f32, seg_begin: u32, seg_end: u32 }
struct ReduceParams { rrows: u32, rheads: u32, rrank: u32, rgroups: u32, rnstate: u32, rangles: u32, rcols: u32 }
struct FinishParams { frows: u32, fheads: u32, frank: u32, fheaddim: u32, eps: f32 }

@group(0) @binding(0) var<uniform> p: PrepParams;
@group(0) @binding(1) var<storage, read> proj: array<f32>;
@group(0) @binding(2) var<storage, read> Bn: array<f32>;
@group(0) @binding(3) var<storage, read> Cn: array<f32>;
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
@group(0) @binding(17) var<storage, read> q_in: array<f32>;
@group(0) @binding(18) var<storage, read> k_in: array<f32>;
@group(0) @binding(19) var<storage, read> theta_in: array<f32>;
@group(0) @binding(20) var<storage, read> dq: array<f32>;
@group(0) @binding(21) var<storage, read> dk: array<f32>;
@group(0) @binding(22) var<storage, read> dv: array<f32>;
@group(0) @binding(23) var<storage, read> dzr: array<f32>;
@group(0) @binding(24) var<storage, read> dadt: array<f32>;
@group(0) @binding(25) var<storage, read> ddt: array<f32>;
@group(0) @binding(26) var<storage, read> dlam: array<f32>;
@group(0) @binding(27) var<storage, read_write> dproj: array<f32>;  // [M, cols]
@group(0) @binding(28) var<storage, read_write> dqb: array<f32>;    // [M, H, R, N] before the rotation
@group(0) @binding(29) var<storage, read_write> dkb: array<f32>;
@group(0) @binding(30) var<storage, read_write> dang_part: array<f32>;  // [M, H, S]
@group(0) @binding(31) var<storage, read_write> dvx: array<f32>;   // [M, H, R, P]: dv ⊙ x (-> ∂mimo_x)
@group(0) @binding(32) var<storage, read_write> dzz: array<f32>;   // dzr ⊙ z (-> ∂mimo_z)
// reduce
@group(0) @binding(33) var<uniform> rp: ReduceParams;
@group(0) @binding(34) var<storage, read> dqb_in: array<f32>;
@group(0) @binding(35) var<storage, read> dkb_in: array<f32>;
@group(0) @binding(36) var<storage, read> dang_in: array<f32>;
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
@group(0) @binding(61) var<storage, read_write> dcum_carry: array<f32>; // [B, H, S]: between backward segments

fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }

fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    let e = exp(x);
    let one_plus = 1.0 + e;
    if (one_plus == 1.0) { return e; }
    return log(one_plus) * e / (one_plus - 1.0);
}

fn heavy_tail(x: f32) -> f32 { return select(1.0 / (1.0 - x), 1.0 + x, x >= 0.0); }

fn safe_tanh(x: f32) -> f32 { return tanh(clamp(x, -15.0, 15.0)); }

// The angle that turns state dim n and whether n is the second of its pair; j = angles when n is not turned.
fn pair_of(n: u32) -> vec2<u32> {
    if (p.mimo != 0u) {
        let half = p.nstate / 2u;
        if (n < p.angles) { return vec2<u32>(n, 0u); }
        if (n >= half && n - half < p.angles) { return vec2<u32>(n - half, 1u); }
        return vec2<u32>(p.angles, 0u);
    }
    if (n / 2u < p.angles) { return vec2<u32>(n / 2u, n % 2u); }
    return vec2<u32>(p.angles, 0u);
}

fn partner(n: u32, second: u32) -> u32 {
    if (p.mimo != 0u) { return select(n + p.nstate / 2u, n - p.nstate / 2u, second == 1u); }
    return select(n + 1u, n - 1u, second == 1u);
}

// Grid grid_1d(B·H, 64).
@compute @workgroup_size(64)
fn mamba3_prep_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= p.batch * p.heads) { return; }
    let h = i % p.heads;
    let b = i / p.heads;
    let H = p.heads;
    let R = p.rank;
    let N = p.nstate;
    let P = p.headdim;
    let S = p.angles;
    let di = H * P;
    let rgn = R * p.ngroups * N;
    let off = 2u * di + 2u * rgn;  // dd_dt
    let g = h / (H / p.ngroups);
    var th: array<f32, MAX_S>;
    if (p.seg_begin == 0u) {
        for (var j = 0u; j < S; j++) { th[j] = 0.0; }
    } else {
        let prev = (b * p.len + p.seg_begin - 1u) * H + h;
        for (var j = 0u; j < S; j++) { th[j] = theta[prev * S + j]; }
    }
    for (var t = p.seg_begin; t < p.seg_end; t++) {
        let row = b * p.len + t;
        let pr = row * p.cols;
        let dtv = softplus(proj[pr + off + h] + dt_bias[h]);
        let a = -max(heavy_tail(proj[pr + off + H + h]), p.a_floor);
        let rh = row * H + h;
        dt[rh] = dtv;
        adt[rh] = a * dtv;
        lam[rh] = sigmoid(proj[pr + off + 2u * H + h]);
        for (var j = 0u; j < S; j++) {
            th[j] += dtv * PI * safe_tanh(proj[pr + off + 3u * H + j]);
            theta[rh * S + j] = th[j];
        }
        for (var r = 0u; r < R; r++) {
            let src = row * rgn + (r * p.ngroups + g) * N;
            let bias = (h * R + r) * N;
            let dst = (rh * R + r) * N;
            for (var n = 0u; n < N; n++) {
                let pj = pair_of(n);
                let kb = Bn[src + n] + B_bias[bias + n];
                let qb = Cn[src + n] + C_bias[bias + n];
                if (pj.x >= S) { k[dst + n] = kb; q[dst + n] = qb; continue; }
                let m = partner(n, pj.y);
                let ko = Bn[src + m] + B_bias[bias + m];
                let qo = Cn[src + m] + C_bias[bias + m];
                let c = cos(th[pj.x]);
                let s = sin(th[pj.x]);
                if (pj.y == 0u) {  // x0 c − x1 s
                    k[dst + n] = kb * c - ko * s;
                    q[dst + n] = qb * c - qo * s;
                } else {           // x0 s + x1 c
                    k[dst + n] = ko * s + kb * c;
                    q[dst + n] = qo * s + qb * c;
                }
            }
            for (var c = 0u; c < P; c++) {
                let mi = (h * R + r) * P + c;
                v[(rh * R + r) * P + c] = proj[pr + di + h * P + c] * mimo_x[mi];
                zr[(rh * R + r) * P + c] = proj[pr + h * P + c] * mimo_z[mi];
            }
        }
    }
}

// Grid grid_1d(B·H, 64). Writes dproj's z, x, dd_dt, dd_A and trap columns, dqb, dkb, dang_part, dvx, dzz.
@compute @workgroup_size(64)
fn mamba3_prep_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= p.batch * p.heads) { return; }
    let h = i % p.heads;
    let b = i / p.heads;
    let H = p.heads;
    let R = p.rank;
    let N = p.nstate;
    let P = p.headdim;
    let S = p.angles;
    let di = H * P;
    let rgn = R * p.ngroups * N;
    let off = 2u * di + 2u * rgn;
    var dcum: array<f32, MAX_S>;  // Σ_{t' >= t} ∂loss/∂θ_{t'}
    if (p.seg_end >= p.len) {
        for (var j = 0u; j < S; j++) { dcum[j] = 0.0; }
    } else {
        for (var j = 0u; j < S; j++) { dcum[j] = dcum_carry[i * S + j]; }
    }
    for (var tt = p.seg_end; tt > p.seg_begin; tt--) {
        let t = tt - 1u;
        let row = b * p.len + t;
        let pr = row * p.cols;
        let rh = row * H + h;
        for (var r = 0u; r < R; r++) {
            let base = (rh * R + r) * N;
            for (var n = 0u; n < N; n++) {
                let pj = pair_of(n);
                if (pj.x >= S) { dqb[base + n] = dq[base + n]; dkb[base + n] = dk[base + n]; continue; }
                let m = partner(n, pj.y);
                let c = cos(theta_in[rh * S + pj.x]);
                let s = sin(theta_in[rh * S + pj.x]);
                if (pj.y == 0u) {  // dx0 = d0 c + d1 s; dθ += d1 out0 − d0 out1
                    dqb[base + n] = dq[base + n] * c + dq[base + m] * s;
                    dkb[base + n] = dk[base + n] * c + dk[base + m] * s;
                    dcum[pj.x] += dq[base + m] * q_in[base + n] - dq[base + n] * q_in[base + m]
                                + dk[base + m] * k_in[base + n] - dk[base + n] * k_in[base + m];
                } else {           // dx1 = d1 c − d0 s
                    dqb[base + n] = dq[base + n] * c - dq[base + m] * s;
                    dkb[base + n] = dk[base + n] * c - dk[base + m] * s;
                }
            }
        }
        let pre = proj[pr + off + h] + dt_bias[h];
        let dtv = softplus(pre);
        let dda = proj[pr + off + H + h];
        let ht = heavy_tail(dda);
        let a = -max(ht, p.a_floor);
        var dd = ddt[rh] + dadt[rh] * a;
        for (var j = 0u; j < S; j++) {
            let th = safe_tanh(proj[pr + off + 3u * H + j]);
            dd += PI * dcum[j] * th;
            dang_part[rh * S + j] = PI * (1.0 - th * th) * dcum[j] * dtv;
        }
        dproj[pr + off + h] = dd * select(sigmoid(pre), 1.0, pre > 20.0);
        var dA = 0.0;
        if (ht >= p.a_floor) {
            dA = -dadt[rh] * dtv * select(1.0 / ((1.0 - dda) * (1.0 - dda)), 1.0, dda >= 0.0);
        }
        dproj[pr + off + H + h] = dA;
        let l = lam[rh];
        dproj[pr + off + 2u * H + h] = dlam[rh] * l * (1.0 - l);
        for (var c = 0u; c < P; c++) {
            let xv = proj[pr + di + h * P + c];
            let zv = proj[pr + h * P + c];
            var dx = 0.0;
            var dz = 0.0;
            for (var r = 0u; r < R; r++) {
                let vi = (rh * R + r) * P + c;
                let mi = (h * R + r) * P + c;
                let dvt = dv[vi] + D[h] * dys_in[vi];
                dx += dvt * mimo_x[mi];
                dz += dzr[vi] * mimo_z[mi];
                dvx[vi] = dvt * xv;
                dzz[vi] = dzr[vi] * zv;
            }
            dproj[pr + di + h * P + c] = dx;
            dproj[pr + h * P + c] = dz;
        }
    }
    if (p.seg_begin > 0u) {
        for (var j = 0u; j < S; j++) { dcum_carry[i * S + j] = dcum[j]; }
    }
}

// Per row: Σ over heads of dang_part into dproj's angle columns, and Σ over the heads of each group of dqb, dkb
// into dCn, dBn [M, R, G, N]. Grid grid_1d(M·(S + R·G·N)).
@compute @workgroup_size(256)
fn mamba3_prep_reduce(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let rgn = rp.rrank * rp.rgroups * rp.rnstate;
    let width = rp.rangles + rgn;
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= rp.rrows * width) { return; }
    let row = i / width;
    let x = i % width;
    if (x < rp.rangles) {
        var acc = 0.0;
        for (var h = 0u; h < rp.rheads; h++) { acc += dang_in[(row * rp.rheads + h) * rp.rangles + x]; }
        dproj_out[row * rp.rcols + rp.rcols - rp.rangles + x] = acc;
        return;
    }
    let y_ = x - rp.rangles;  // (r, g, n)
    let n = y_ % rp.rnstate;
    let g = (y_ / rp.rnstate) % rp.rgroups;
    let r = y_ / (rp.rnstate * rp.rgroups);
    let per = rp.rheads / rp.rgroups;
    var aq = 0.0;
    var ak = 0.0;
    for (var e = 0u; e < per; e++) {
        let idx = (((row * rp.rheads + g * per + e) * rp.rrank) + r) * rp.rnstate + n;
        aq += dqb_in[idx];
        ak += dkb_in[idx];
    }
    dCn[row * rgn + y_] = aq;
    dBn[row * rgn + y_] = ak;
}

// One thread per (row, head, rank). Grid grid_1d(M·H·R, 64).
@compute @workgroup_size(64)
fn mamba3_finish_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= fp.frows * fp.fheads * fp.frank) { return; }
    let P = fp.fheaddim;
    let h = (i / fp.frank) % fp.fheads;
    let base = i * P;
    var ss = 0.0;
    for (var c = 0u; c < P; c++) {
        let yv = ys[base + c] + D[h] * v_in[base + c];
        y[base + c] = yv;
        ss += yv * yv;
    }
    var rs = 1.0;
    if (NORM) { rs = inverseSqrt(ss / f32(P) + fp.eps); }
    rstd[i] = rs;
    for (var c = 0u; c < P; c++) {
        var yn = y[base + c];
        if (NORM) { yn = yn * rs * norm_w[h * P + c]; }
        let zv = zr_in[base + c];
        o[base + c] = yn * zv * sigmoid(zv);
    }
}

// out[row, h·P + c] = Σ_r mimo_o[h, r, c] o[row, h, r, c] (r in order). Grid grid_1d(M·H·P).
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

// One thread per (row, head, rank): dys (gradient reaching the scan output and, times D, v), dzr and the
// per-item parameter partials. Grid grid_1d(M·H·R, 64).
@compute @workgroup_size(64)
fn mamba3_finish_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= fp.frows * fp.fheads * fp.frank) { return; }
    let P = fp.fheaddim;
    let r = i % fp.frank;
    let h = (i / fp.frank) % fp.fheads;
    let row = i / (fp.frank * fp.fheads);
    let base = i * P;
    let rs = rstd_in[i];
    var dot = 0.0;  // Σ_c dyn·w·ŷ (RMSNorm backward)
    for (var c = 0u; c < P; c++) {
        let dout_v = dout[row * fp.fheads * P + h * P + c];
        let do_ = dout_v * mimo_o[(h * fp.frank + r) * P + c];
        dmo_part[base + c] = dout_v * o_in[base + c];
        let zv = zr_in[base + c];
        let sg = sigmoid(zv);
        var yn = y_in[base + c];
        if (NORM) { yn = yn * rs * norm_w[h * P + c]; }
        dzr_out[base + c] = do_ * yn * sg * (1.0 + zv * (1.0 - sg));
        let dyn = do_ * zv * sg;
        dys[base + c] = dyn;  // before the norm; finished below
        if (NORM) {
            dot += dyn * norm_w[h * P + c] * y_in[base + c] * rs;
            dnw_part[(row * fp.frank + r) * fp.fheads * P + h * P + c] = dyn * y_in[base + c] * rs;
        }
    }
    var dd = 0.0;
    for (var c = 0u; c < P; c++) {
        var g = dys[base + c];
        if (NORM) { g = rs * (g * norm_w[h * P + c] - y_in[base + c] * rs * dot / f32(P)); }
        dys[base + c] = g;
        dd += g * v_in[base + c];
    }
    dD_part[(row * fp.frank + r) * fp.fheads + h] = dd;
}
