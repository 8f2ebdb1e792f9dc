enable f16;
//! extends linear
// The opt-in f16 GEMM (`[train] matmul_precision = "f16"`): C[M, N] (+)= A · B (+ bias) like `matmul` of
// linear.wgsl, whose bindings, tiling, global loads (fetch_a/fetch_b), f32 accumulators and stores this module
// reuses (kernels.py compiles linear.wgsl in front of this file; a separate module because `enable f16` would
// make every kernel of linear.wgsl need shader-f16). The fp32 tensors stay fp32 in memory; what changes is
// what happens between the global loads and the f32 accumulators:
//
// - Staging: each loaded fp32 vec4 is multiplied by its operand's power-of-two scale and converted to
//   vec4<f16> on its way into workgroup memory (half the shared bytes and shared loads of the fp32 kernel).
// - Products: a T×T register block of f16 partial sums, updated with vec4<f16> FMAs (two HFMA2 each, twice
//   the fp32 FMA rate on Hopper).
// - Flush: every FLUSH k steps the partial sums are converted and added into the f32 accumulators and
//   restarted at 0, so no f16 sum holds more than FLUSH products (the error bound in ops/linear.py's
//   f16_error_bound is derived from that).
// - Scales (gradients are ~1e-6..1e-9 here, below f16's normal range 2^-14): operand_amax (below) writes
//   max |x| of each operand as u32 bits (non-negative floats order like their bits); the GEMM turns that into
//   s = 2^(OPERAND_EXP - e) with max|x| < 2^e, so every staged value is below 2^OPERAND_EXP. ops/linear.py
//   picks OPERAND_EXP with FLUSH · 2^(2·OPERAND_EXP) <= 2^15, so a partial sum can never overflow f16
//   (65504). The output is multiplied by 1/(s_a·s_b) (exact: powers of two) before bias and accumulate.
//
// Why it is only ~1.0-1.2× the fp32 kernel (kernel alone, H200, bench/gemm.py --gpu-times, 2026-12-01
// batches 20:33-22:10; vec4<f16> FMAs themselves run at 2.04× vec4<f32>, bench/fma_rate.py): not the FMAs,
// the flushes or the registers — with no flush inside the K loop (no f32 accumulator live there) in_proj
// ran 40.5/40.3/35.0 TFLOP/s fwd/dX/dW against 39.7/40.9/38.0, and loading the next tile after the multiply
// (fewer live registers) 40.1/41.0/38.2. Also no faster (variants deleted): 16-byte shared loads feeding two k
// steps (mat2x4<f16> tiles: 40.4/41.0/37.1), with a k-contiguous A staged by two 4-byte stores instead of four
// 2-byte ones (mat4x2<f16> A tiles: 40.2/40.7 fwd/dX, 4096³ 39.4/41.5/44.7 against 38.4/41.3/45.5); eight
// threads per k-contiguous row (128-byte reads: 4096³ 39.0/40.8/44.3 against 38.1/41.4/45.8);
// operands pre-converted to scaled f16 in memory, so the GEMM reads half the bytes and converts nothing
// (4096³ 30.0/41.3/43.5). Skipping a k-contiguous operand's loads and stores altogether (a timing-only
// diagnostic, wrong results) gave 53.3/51.1/38.0 at in_proj: the fwd/dX cost is in staging k-contiguous
// operands, but neither their bytes, their read pattern nor their store width alone. (dW, with no
// k-contiguous operand, is 1.2× fp32 at most: what bounds the whole kernel near 40-47 TFLOP/s is open.)

override FLUSH: u32 = 32u;  // k steps per f16 partial sum: 8, 16 or a multiple of 16 (ops/linear.py's FLUSH)
override OPERAND_EXP: i32 = 5;  // staged operands are scaled below 2^OPERAND_EXP
override SUBTILES: u32 = 2u;  // 16-k slices per shared tile (1 or 2: K steps of 16 or 32 per barrier)
const BK_MAX = 32u;

@group(0) @binding(5) var<storage, read> a_amax: array<u32>;  // [0]: bits of max |A|
@group(0) @binding(6) var<storage, read> b_amax: array<u32>;  // [0]: bits of max |B|

var<workgroup> a_h: array<array<array<vec4<f16>, BM_MAX4>, BK_MAX>, 2>;  // [buffer][k][row / 4], as a_sh
var<workgroup> b_h: array<array<array<vec4<f16>, BM_MAX4>, BK_MAX>, 2>;  // [buffer][k][col / 4]

var<private> a_scale: f32;
var<private> b_scale: f32;
var<private> ha0: vec4<f16>;  // the next tile, scaled and converted, in flight to shared: [slice][slot]
var<private> ha1: vec4<f16>;
var<private> hb0: vec4<f16>;
var<private> hb1: vec4<f16>;
var<private> ha2: vec4<f16>;  // second 16-k slice (SUBTILES = 2)
var<private> ha3: vec4<f16>;
var<private> hb2: vec4<f16>;
var<private> hb3: vec4<f16>;
var<private> part00: mat4x4<f16>;  // f16 partial sums, laid out as acc00 .. acc11
var<private> part01: mat4x4<f16>;
var<private> part10: mat4x4<f16>;
var<private> part11: mat4x4<f16>;

// 2^n for n in [-126, 127], built from the exponent field (exact; no exp2 approximation).
fn pow2(n: i32) -> f32 { return bitcast<f32>(u32(clamp(n, -126, 127) + 127) << 23u); }

// log2 of an operand's scale from the bits of its max |x|: OPERAND_EXP - e where max|x| < 2^e (e read from
// the exponent field). All zeros or a non-finite max: 0 (scale 1; an inf or NaN then shows in the output).
fn scale_exp(bits: u32) -> i32 {
    if (bits == 0u || bits >= 0x7f800000u) { return 0; }
    return clamp(OPERAND_EXP - (i32(bits >> 23u) - 126), -126, 126);
}

fn fetch_h(t: u32, k0: u32) {
    ha0 = vec4<f16>(fetch_a(t, k0) * a_scale);
    hb0 = vec4<f16>(fetch_b(t, k0) * b_scale);
    if (T == 8u) {
        ha1 = vec4<f16>(fetch_a(t + 256u, k0) * a_scale);
        hb1 = vec4<f16>(fetch_b(t + 256u, k0) * b_scale);
    }
    if (SUBTILES == 2u) {
        ha2 = vec4<f16>(fetch_a(t, k0 + BK) * a_scale);
        hb2 = vec4<f16>(fetch_b(t, k0 + BK) * b_scale);
        if (T == 8u) {
            ha3 = vec4<f16>(fetch_a(t + 256u, k0 + BK) * a_scale);
            hb3 = vec4<f16>(fetch_b(t + 256u, k0 + BK) * b_scale);
        }
    }
}

// put_a / put_b of linear.wgsl into the f16 tiles (slice k0 = 0 or 16 of the tile): slot i's four values
// along the operand's contiguous dimension; a K-contiguous operand's go to four k rows (transposed), the others
// to one vec4.
fn put_ah(buf: u32, k0: u32, i: u32, v: vec4<f16>) {
    if (TRANS_A) {
        a_h[buf][k0 + i / (bm() / 4u)][i % (bm() / 4u)] = v;
        return;
    }
    let sl = kslot(i);
    let m = sl.x;
    let k = k0 + sl.y;
    a_h[buf][k][m >> 2u][m & 3u] = v.x;
    a_h[buf][k + 1u][m >> 2u][m & 3u] = v.y;
    a_h[buf][k + 2u][m >> 2u][m & 3u] = v.z;
    a_h[buf][k + 3u][m >> 2u][m & 3u] = v.w;
}

fn put_bh(buf: u32, k0: u32, i: u32, v: vec4<f16>) {
    if (!TRANS_B) {
        b_h[buf][k0 + i / (bm() / 4u)][i % (bm() / 4u)] = v;
        return;
    }
    let sl = kslot(i);
    let n = sl.x;
    let k = k0 + sl.y;
    b_h[buf][k][n >> 2u][n & 3u] = v.x;
    b_h[buf][k + 1u][n >> 2u][n & 3u] = v.y;
    b_h[buf][k + 2u][n >> 2u][n & 3u] = v.z;
    b_h[buf][k + 3u][n >> 2u][n & 3u] = v.w;
}

fn commit_h(t: u32, buf: u32) {
    put_ah(buf, 0u, t, ha0);
    put_bh(buf, 0u, t, hb0);
    if (T == 8u) {
        put_ah(buf, 0u, t + 256u, ha1);
        put_bh(buf, 0u, t + 256u, hb1);
    }
    if (SUBTILES == 2u) {
        put_ah(buf, BK, t, ha2);
        put_bh(buf, BK, t, hb2);
        if (T == 8u) {
            put_ah(buf, BK, t + 256u, ha3);
            put_bh(buf, BK, t + 256u, hb3);
        }
    }
}

fn outer_h(acc: mat4x4<f16>, x: vec4<f16>, y: vec4<f16>) -> mat4x4<f16> {
    return mat4x4<f16>(fma(vec4<f16>(x.x), y, acc[0]), fma(vec4<f16>(x.y), y, acc[1]),
                       fma(vec4<f16>(x.z), y, acc[2]), fma(vec4<f16>(x.w), y, acc[3]));
}

fn kstep_h(buf: u32, k: u32) {
    let a0 = a_h[buf][k][ty];
    let b0 = b_h[buf][k][tx];
    part00 = outer_h(part00, a0, b0);
    if (T == 8u) {
        let a1 = a_h[buf][k][ty + 16u];
        let b1 = b_h[buf][k][tx + 16u];
        part01 = outer_h(part01, a0, b1);
        part10 = outer_h(part10, a1, b0);
        part11 = outer_h(part11, a1, b1);
    }
}

// The f16 partial sums into the f32 accumulators (f16 -> f32 is exact), and restart them.
fn flush() {
    acc00 += mat4x4<f32>(part00);
    part00 = mat4x4<f16>();
    if (T == 8u) {
        acc01 += mat4x4<f32>(part01);
        acc10 += mat4x4<f32>(part10);
        acc11 += mat4x4<f32>(part11);
        part01 = mat4x4<f16>();
        part10 = mat4x4<f16>();
        part11 = mat4x4<f16>();
    }
}

// The flushes inside a tile: after every FLUSH (8, 16 or 32 <= the tile's K) k steps; longer FLUSH: the loop.
fn multiply_tile_h(buf: u32) {
    kstep_h(buf, 0u); kstep_h(buf, 1u); kstep_h(buf, 2u); kstep_h(buf, 3u);
    kstep_h(buf, 4u); kstep_h(buf, 5u); kstep_h(buf, 6u); kstep_h(buf, 7u);
    if (FLUSH == 8u) { flush(); }
    kstep_h(buf, 8u); kstep_h(buf, 9u); kstep_h(buf, 10u); kstep_h(buf, 11u);
    kstep_h(buf, 12u); kstep_h(buf, 13u); kstep_h(buf, 14u); kstep_h(buf, 15u);
    if (FLUSH <= 16u) { flush(); }
    if (SUBTILES == 2u) {
        kstep_h(buf, 16u); kstep_h(buf, 17u); kstep_h(buf, 18u); kstep_h(buf, 19u);
        kstep_h(buf, 20u); kstep_h(buf, 21u); kstep_h(buf, 22u); kstep_h(buf, 23u);
        if (FLUSH == 8u) { flush(); }
        kstep_h(buf, 24u); kstep_h(buf, 25u); kstep_h(buf, 26u); kstep_h(buf, 27u);
        kstep_h(buf, 28u); kstep_h(buf, 29u); kstep_h(buf, 30u); kstep_h(buf, 31u);
        if (FLUSH == 32u) { flush(); }  // (8 and 16 flushed just above)
        if (FLUSH <= 16u) { flush(); }
    }
}

@compute @workgroup_size(256)
fn matmul_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let warp = t >> 5u;  // the thread layout of `matmul`
    let lane = t & 31u;
    tx = (warp & 1u) * 8u + (lane & 7u);
    ty = (warp >> 1u) * 4u + (lane >> 3u);
    row0 = select(wid.y, wid.x, RASTER) * bm();
    col0 = select(wid.x, wid.y, RASTER) * bm();
    let kbeg = wid.z * p.k_split;
    let kz = min(p.k, kbeg + p.k_split);
    kend = kz;
    let ea = scale_exp(a_amax[0]);
    let eb = scale_exp(b_amax[0]);
    a_scale = pow2(ea);
    b_scale = pow2(eb);
    let bk = BK * SUBTILES;
    let tiles = (kz - kbeg + bk - 1u) / bk;
    let tiles_per_flush = max(FLUSH / bk, 1u);
    fetch_h(t, kbeg);
    commit_h(t, 0u);
    workgroupBarrier();
    var buf = 0u;
    for (var s = 1u; s < tiles; s++) {
        multiply_tile_h(buf);  // then the next tile's loads (as matmul: fewer live registers, no slower)
        fetch_h(t, kbeg + s * bk);
        if (FLUSH > bk && s % tiles_per_flush == 0u) { flush(); }  // tiles 0 .. s-1 are summed
        commit_h(t, buf ^ 1u);
        workgroupBarrier();
        buf ^= 1u;
    }
    multiply_tile_h(buf);
    flush();
    let unscale = pow2(-ea) * pow2(-eb);  // at most 2^252 apart from 1: two factors, each in f32's range
    acc00 *= unscale;
    acc01 *= unscale;
    acc10 *= unscale;
    acc11 *= unscale;
    let r = row0 + ty * 4u;
    let q = col0 + tx * 4u;
    store_block(wid.z, r, q, acc00);
    if (T == 8u) {
        store_block(wid.z, r, q + 64u, acc01);
        store_block(wid.z, r + 64u, q, acc10);
        store_block(wid.z, r + 64u, q + 64u, acc11);
    }
}

// ---- operand_amax -------------------------------------------------------------------------------
// amax_out[0] = max(amax_out[0], bits of max |x| over x[0 .. amax_p.count)): each workgroup reduces AMAX_VEC4S
// vec4s per thread (coalesced: consecutive threads, consecutive vec4s), then one atomicMax. The caller zeroes
// amax_out first. |x| as bits: the sign bit cleared, so NaN (above inf) wins and disables the scale.

const AMAX_VEC4S = 16u;

struct AmaxParams { count: u32, groups_x: u32 }

@group(0) @binding(7) var<uniform> amax_p: AmaxParams;
@group(0) @binding(8) var<storage, read_write> amax_out: array<atomic<u32>>;

var<workgroup> amax_sh: array<u32, 256>;

@compute @workgroup_size(256)
fn operand_amax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let g = wid.y * amax_p.groups_x + wid.x;
    var m = 0u;
    for (var j = 0u; j < AMAX_VEC4S; j++) {
        let i = (g * AMAX_VEC4S + j) * 256u + t;
        if (i * 4u < amax_p.count) {
            let bits = bitcast<vec4<u32>>(a[i]) & vec4<u32>(0x7fffffffu);
            let valid = vec4<u32>(i * 4u) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(amax_p.count);
            let v = select(vec4<u32>(0u), bits, valid);
            m = max(m, max(max(v.x, v.y), max(v.z, v.w)));
        }
    }
    amax_sh[t] = m;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if (t < w) { amax_sh[t] = max(amax_sh[t], amax_sh[t + w]); }
        workgroupBarrier();
    }
    if (t == 0u) { atomicMax(&amax_out[0], amax_sh[0]); }
}
