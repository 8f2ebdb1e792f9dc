// GEMM for linear layers: C[M, N] (+)= A[M, K] · B[K, N] (+ bias[N]).
// Transposes are pipeline constants, so one kernel gives the forward Y = X Wᵀ (TRANS_B),
// dX = dY W (none) and dW = dYᵀ X (TRANS_A). ACCUMULATE adds into C (gradient accumulation).
// Split-K: workgroup z takes K range [z·k_split, (z+1)·k_split) and writes plane z of C ([S, M, N]);
// ops/linear.py sums the planes (so a short, wide product like dW of a small projection still fills
// the GPU). Any M, N, K: out-of-range loads read 0 and out-of-range stores are skipped.
//
// Two entry points:
//   matmul         the tiled GEMM. 256 threads compute a 16·T × 16·T tile of C, each thread a T × T register
//                  block (T = 8: 128² tiles, the default; T = 4: 64² tiles for small outputs), stepping K by
//                  BK = 16 (so every thread stages whole vec4s of both operands).
//   matmul_direct  no workgroup memory or barriers, for CPU adapters.
// (linear_f16.wgsl compiles this file in front of its matmul_f16, the opt-in f16 mode, which reuses the
// bindings, fetch_a/fetch_b, the accumulators and the stores below.)
//
// How `matmul` is fast (on an H200 through Vulkan: 30-43 TFLOP/s at the model's shapes, was 10-17):
// - VEC4 (chosen by ops/linear.py when the contiguous dimensions are multiples of 4): every global load
//   and store moves a vec4; edge tiles clamp the address and select 0, so there are no branches in the
//   load path. Without VEC4 the same staging reads 4 scalars with a check each (ragged shapes).
// - Shared tiles are vec4 arrays, k-major ([buffer][k][row/4]), so a thread reads 4 rows (or columns)
//   with one 16-byte load; a warp is laid out 8 columns × 4 rows of threads, so each of its shared
//   reads touches 4 or 8 consecutive vec4s (one wavefront, no bank conflicts). Rows are padded to 33
//   vec4s so the transposed stores of a K-contiguous operand collide at most 2-way on banks.
//   The forward (both operands K-contiguous, staged by transposed scalar stores) stays ~15% slower
//   than dX and dW on the H200.
// - Double buffering: tile t+1 is loaded from memory into registers before tile t is multiplied, then
//   written to the other shared buffer: one barrier per K step, and the loads' latency hides behind
//   16·T² FMAs.
// - The BK steps of a tile are written out (kstep(buf, 0u) ...): naga bounds every loop with a counter
//   (so drivers may not unroll it) and clamps each dynamic workgroup-array index; with literal k every
//   index but the per-thread row/column is a constant, and the driver folds the clamps.
// - Accumulators are 4×4 blocks held in private mat4x4 variables and only ever indexed by constants
//   (a dynamically indexed accumulator array spills to memory).
// - RASTER: resident workgroups cover whole lines of the grid's x dimension, so ops/linear.py lets x walk
//   the dimension with fewer tiles (the tied head's forward, 64 row × 393 column tiles, then reads each
//   weight panel once instead of once per row tile: +7% there).

override TRANS_A: bool = false;
override TRANS_B: bool = false;
override HAS_BIAS: bool = false;
override ACCUMULATE: bool = false;
override VEC4: bool = false;  // M/N/K allow 16-byte loads and stores (see ops/linear.py)
override T: u32 = 8u;         // rows and columns per thread: 8 (128² tile) or 4 (64² tile)
override RASTER: bool = false;  // workgroup x walks row tiles (y column tiles) instead of the reverse

const BK = 16u;       // K per shared tile
const BM_MAX4 = 33u;  // 128 rows / 4 + 1 vec4 of padding

struct Params { m: u32, n: u32, k: u32, k_split: u32 }

// Buffers are bound as vec4 arrays (the buffer pool rounds every buffer to 256 bytes); scalar access
// goes through a component: x[e >> 2u][e & 3u].
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> bias: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> c: array<vec4<f32>>;

var<workgroup> a_sh: array<array<array<vec4<f32>, BM_MAX4>, 16>, 2>;  // [buffer][k][row / 4]
var<workgroup> b_sh: array<array<array<vec4<f32>, BM_MAX4>, 16>, 2>;  // [buffer][k][col / 4]

// Per-thread state of `matmul` (private, so the helpers below can share it without pointers).
var<private> tx: u32;    // column block: columns cg·64 + tx·4 .. + 3
var<private> ty: u32;    // row block: rows rg·64 + ty·4 .. + 3
var<private> row0: u32;  // the tile's first row and column
var<private> col0: u32;
var<private> kend: u32;  // end of this split's K range
var<private> acc00: mat4x4<f32>;  // [row group][column group] (acc00 only when T = 4); column i of the matrix is row i
var<private> acc01: mat4x4<f32>;
var<private> acc10: mat4x4<f32>;
var<private> acc11: mat4x4<f32>;
var<private> la0: vec4<f32>;  // the next tile, in flight from memory to shared
var<private> la1: vec4<f32>;
var<private> lb0: vec4<f32>;
var<private> lb1: vec4<f32>;

fn bm() -> u32 { return 16u * T; }  // tile rows = tile columns

// Four consecutive elements of A (or B) from flat index e, of which the first `valid` exist.
fn load4_a(e: u32, valid: u32) -> vec4<f32> {
    if (VEC4) {  // valid is 0 or 4
        return select(vec4<f32>(0.0), a[select(0u, e >> 2u, valid > 0u)], valid > 0u);
    }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        if (j < valid) { v[j] = a[(e + j) >> 2u][(e + j) & 3u]; }
    }
    return v;
}

fn load4_b(e: u32, valid: u32) -> vec4<f32> {
    if (VEC4) {
        return select(vec4<f32>(0.0), b[select(0u, e >> 2u, valid > 0u)], valid > 0u);
    }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        if (j < valid) { v[j] = b[(e + j) >> 2u][(e + j) & 3u]; }
    }
    return v;
}

fn count4(ok: bool, start: u32, limit: u32) -> u32 {
    return select(0u, min(4u, limit - min(start, limit)), ok);
}

// Slot i of a K-contiguous operand's tile -> (row in the tile, k offset in the tile): four threads read
// the 64 bytes of a row. (Tried on the H200: two threads per row, 32 bytes, so that the transposed shared
// stores are free of bank conflicts; or one thread per row: both slower.)
fn kslot(i: u32) -> vec2<u32> { return vec2<u32>(i / (BK / 4u), (i % (BK / 4u)) * 4u); }

// Slot i (0 .. BM·BK/4) of the A tile at K offset k0: four elements along A's contiguous dimension,
// so consecutive threads read consecutive memory.
fn fetch_a(i: u32, k0: u32) -> vec4<f32> {
    if (TRANS_A) {  // A is [K, M]: along m
        let kk = k0 + i / (bm() / 4u);
        let row = row0 + (i % (bm() / 4u)) * 4u;
        return load4_a(kk * p.m + row, count4(kk < kend, row, p.m));
    }
    let sl = kslot(i);  // A is [M, K]: along k
    let row = row0 + sl.x;
    let kk = k0 + sl.y;
    return load4_a(row * p.k + kk, count4(row < p.m, kk, kend));
}

fn fetch_b(i: u32, k0: u32) -> vec4<f32> {
    if (TRANS_B) {  // B is [N, K]: along k
        let sl = kslot(i);
        let col = col0 + sl.x;
        let kk = k0 + sl.y;
        return load4_b(col * p.k + kk, count4(col < p.n, kk, kend));
    }
    let kk = k0 + i / (bm() / 4u);  // B is [K, N]: along n
    let col = col0 + (i % (bm() / 4u)) * 4u;
    return load4_b(kk * p.n + col, count4(kk < kend, col, p.n));
}

fn put_a(buf: u32, i: u32, v: vec4<f32>) {
    if (TRANS_A) {
        a_sh[buf][i / (bm() / 4u)][i % (bm() / 4u)] = v;
        return;
    }
    let sl = kslot(i);  // transpose: the four k values go to four rows of the k-major tile
    let m = sl.x;
    let k = sl.y;
    a_sh[buf][k][m >> 2u][m & 3u] = v.x;
    a_sh[buf][k + 1u][m >> 2u][m & 3u] = v.y;
    a_sh[buf][k + 2u][m >> 2u][m & 3u] = v.z;
    a_sh[buf][k + 3u][m >> 2u][m & 3u] = v.w;
}

fn put_b(buf: u32, i: u32, v: vec4<f32>) {
    if (!TRANS_B) {
        b_sh[buf][i / (bm() / 4u)][i % (bm() / 4u)] = v;
        return;
    }
    let sl = kslot(i);
    let n = sl.x;
    let k = sl.y;
    b_sh[buf][k][n >> 2u][n & 3u] = v.x;
    b_sh[buf][k + 1u][n >> 2u][n & 3u] = v.y;
    b_sh[buf][k + 2u][n >> 2u][n & 3u] = v.z;
    b_sh[buf][k + 3u][n >> 2u][n & 3u] = v.w;
}

// Each thread stages T/4 (1 or 2) vec4s of A and as many of B.
fn fetch(t: u32, k0: u32) {
    la0 = fetch_a(t, k0);
    lb0 = fetch_b(t, k0);
    if (T == 8u) {
        la1 = fetch_a(t + 256u, k0);
        lb1 = fetch_b(t + 256u, k0);
    }
}

fn commit(t: u32, buf: u32) {
    put_a(buf, t, la0);
    put_b(buf, t, lb0);
    if (T == 8u) {
        put_a(buf, t + 256u, la1);
        put_b(buf, t + 256u, lb1);
    }
}

// acc += x ⊗ y for a 4×4 block: row i of the block (column i of the matrix) gains x[i] · y.
fn outer(acc: mat4x4<f32>, x: vec4<f32>, y: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(fma(vec4<f32>(x.x), y, acc[0]), fma(vec4<f32>(x.y), y, acc[1]),
                       fma(vec4<f32>(x.z), y, acc[2]), fma(vec4<f32>(x.w), y, acc[3]));
}

fn kstep(buf: u32, k: u32) {
    let a0 = a_sh[buf][k][ty];
    let b0 = b_sh[buf][k][tx];
    acc00 = outer(acc00, a0, b0);
    if (T == 8u) {  // rows and columns 64 .. 127 of the tile
        let a1 = a_sh[buf][k][ty + 16u];
        let b1 = b_sh[buf][k][tx + 16u];
        acc01 = outer(acc01, a0, b1);
        acc10 = outer(acc10, a1, b0);
        acc11 = outer(acc11, a1, b1);
    }
}

fn multiply_tile(buf: u32) {
    kstep(buf, 0u); kstep(buf, 1u); kstep(buf, 2u); kstep(buf, 3u);
    kstep(buf, 4u); kstep(buf, 5u); kstep(buf, 6u); kstep(buf, 7u);
    kstep(buf, 8u); kstep(buf, 9u); kstep(buf, 10u); kstep(buf, 11u);
    kstep(buf, 12u); kstep(buf, 13u); kstep(buf, 14u); kstep(buf, 15u);
}

// Four consecutive elements of row `row` of C plane z from column col (a multiple of 4).
fn store4(z: u32, row: u32, col: u32, v: vec4<f32>) {
    if (row >= p.m) { return; }
    let e = z * p.m * p.n + row * p.n + col;
    if (VEC4) {  // N is a multiple of 4: the vec4 is all in or all out
        if (col < p.n) {
            var out = v;
            if (HAS_BIAS) { out += bias[col >> 2u]; }
            if (ACCUMULATE) { out += c[e >> 2u]; }
            c[e >> 2u] = out;
        }
        return;
    }
    for (var j = 0u; j < 4u; j++) {
        if (col + j < p.n) {
            let f = e + j;
            var out = v[j];
            if (HAS_BIAS) { out += bias[(col + j) >> 2u][(col + j) & 3u]; }
            if (ACCUMULATE) { out += c[f >> 2u][f & 3u]; }
            c[f >> 2u][f & 3u] = out;
        }
    }
}

fn store_block(z: u32, row: u32, col: u32, acc: mat4x4<f32>) {
    store4(z, row, col, acc[0]);
    store4(z, row + 1u, col, acc[1]);
    store4(z, row + 2u, col, acc[2]);
    store4(z, row + 3u, col, acc[3]);
}

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    // A warp is 8 column blocks × 4 row blocks; the 8 warps tile 2 × 4 of those.
    let warp = t >> 5u;
    let lane = t & 31u;
    tx = (warp & 1u) * 8u + (lane & 7u);
    ty = (warp >> 1u) * 4u + (lane >> 3u);
    row0 = select(wid.y, wid.x, RASTER) * bm();
    col0 = select(wid.x, wid.y, RASTER) * bm();
    let kbeg = wid.z * p.k_split;
    let kz = min(p.k, kbeg + p.k_split);
    kend = kz;
    let tiles = (kz - kbeg + BK - 1u) / BK;  // from uniform values: the barriers stay in uniform control flow
    fetch(t, kbeg);
    commit(t, 0u);
    workgroupBarrier();
    var buf = 0u;
    for (var s = 1u; s < tiles; s++) {
        fetch(t, kbeg + s * BK);  // in flight while this tile is multiplied
        multiply_tile(buf);
        commit(t, buf ^ 1u);
        workgroupBarrier();
        buf ^= 1u;
    }
    multiply_tile(buf);
    let r = row0 + ty * 4u;
    let q = col0 + tx * 4u;
    store_block(wid.z, r, q, acc00);
    if (T == 8u) {
        store_block(wid.z, r, q + 64u, acc01);
        store_block(wid.z, r + 64u, q, acc10);
        store_block(wid.z, r + 64u, q + 64u, acc11);
    }
}

// ---- matmul_direct ------------------------------------------------------------------------------
// No workgroup memory or barriers, for CPU adapters (llvmpipe/lavapipe run a workgroup's invocations as SIMD
// loops on one thread; every barrier is a context switch). One workgroup of 4 × 2 invocations (one 8-lane
// SIMD group on AVX2) computes a 64 × 64 tile of C; each invocation a 32-row × 16-column block, held in
// 8 × 4 accumulators of 4 × 4.
//
// Why so large a block (Mesa 22.3 lavapipe, issue #9): there every storage-buffer load is a loop over the
// SIMD lanes with one scalar load and a dynamic vector insert per lane and component: ~9-13 ns per lane per
// component, whether the address is uniform or not and whether it loads a vec4 or a scalar (a vec4 costs four
// scalars; measured with bench-style micro-kernels). The FMAs are nearly free beside that, so the speed is set
// by the loads per FMA: (R + C) / (R · C) per k. The old 4 × 4 block with scalar loads (0.5) ran at 0.46
// GFLOP/s per CPU second at 512×64×256; 8 × 8 (0.25) at ~0.9; 32 × 16 (0.09) at ~1.6-1.7 (blocks wider in
// columns than rows were slower; 64 × 16 was no faster). Loads are branch-free: rows and columns past the
// edge read the last row or column (clamped address; those results are never stored) and k never leaves
// the range, so there is no per-element bounds branch in the loop. The stores check bounds (store4, whose
// VEC4 path ops/linear.py picks where N allows it).

// A[row][kk] (row clamped to the last row).
fn elem_a(row: u32, kk: u32) -> f32 {
    let r = min(row, p.m - 1u);
    var e = r * p.k + kk;
    if (TRANS_A) { e = kk * p.m + r; }
    return a[e >> 2u][e & 3u];
}

// B[kk][col] (column clamped to the last column).
fn elem_b(kk: u32, col: u32) -> f32 {
    let c = min(col, p.n - 1u);
    var e = kk * p.n + c;
    if (TRANS_B) { e = c * p.k + kk; }
    return b[e >> 2u][e & 3u];
}

// Rows r .. r+3 of A at k, and columns c .. c+3 of B at k.
fn col4_a(r: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(elem_a(r, k), elem_a(r + 1u, k), elem_a(r + 2u, k), elem_a(r + 3u, k));
}

fn row4_b(c: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(elem_b(k, c), elem_b(k, c + 1u), elem_b(k, c + 2u), elem_b(k, c + 3u));
}

// acc += x ⊗ y: row i of the block gains x[i] · y (multiply and add, as the kernel before).
fn outer_mul(acc: mat4x4<f32>, x: vec4<f32>, y: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(acc[0] + x.x * y, acc[1] + x.y * y, acc[2] + x.z * y, acc[3] + x.w * y);
}

@compute @workgroup_size(4, 2)
fn matmul_direct(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r0 = wid.y * 64u + lid.y * 32u;
    let c0 = wid.x * 64u + lid.x * 16u;
    let kz = min(p.k, (wid.z + 1u) * p.k_split);
    var d0_0 = mat4x4<f32>();
    var d0_1 = mat4x4<f32>();
    var d0_2 = mat4x4<f32>();
    var d0_3 = mat4x4<f32>();
    var d1_0 = mat4x4<f32>();
    var d1_1 = mat4x4<f32>();
    var d1_2 = mat4x4<f32>();
    var d1_3 = mat4x4<f32>();
    var d2_0 = mat4x4<f32>();
    var d2_1 = mat4x4<f32>();
    var d2_2 = mat4x4<f32>();
    var d2_3 = mat4x4<f32>();
    var d3_0 = mat4x4<f32>();
    var d3_1 = mat4x4<f32>();
    var d3_2 = mat4x4<f32>();
    var d3_3 = mat4x4<f32>();
    var d4_0 = mat4x4<f32>();
    var d4_1 = mat4x4<f32>();
    var d4_2 = mat4x4<f32>();
    var d4_3 = mat4x4<f32>();
    var d5_0 = mat4x4<f32>();
    var d5_1 = mat4x4<f32>();
    var d5_2 = mat4x4<f32>();
    var d5_3 = mat4x4<f32>();
    var d6_0 = mat4x4<f32>();
    var d6_1 = mat4x4<f32>();
    var d6_2 = mat4x4<f32>();
    var d6_3 = mat4x4<f32>();
    var d7_0 = mat4x4<f32>();
    var d7_1 = mat4x4<f32>();
    var d7_2 = mat4x4<f32>();
    var d7_3 = mat4x4<f32>();
    for (var kk = wid.z * p.k_split; kk < kz; kk++) {  // one loop iteration per k
        let x0 = col4_a(r0 + 0u, kk);
        let x1 = col4_a(r0 + 4u, kk);
        let x2 = col4_a(r0 + 8u, kk);
        let x3 = col4_a(r0 + 12u, kk);
        let x4 = col4_a(r0 + 16u, kk);
        let x5 = col4_a(r0 + 20u, kk);
        let x6 = col4_a(r0 + 24u, kk);
        let x7 = col4_a(r0 + 28u, kk);
        let y0 = row4_b(c0 + 0u, kk);
        let y1 = row4_b(c0 + 4u, kk);
        let y2 = row4_b(c0 + 8u, kk);
        let y3 = row4_b(c0 + 12u, kk);
        d0_0 = outer_mul(d0_0, x0, y0); d0_1 = outer_mul(d0_1, x0, y1); d0_2 = outer_mul(d0_2, x0, y2); d0_3 = outer_mul(d0_3, x0, y3);
        d1_0 = outer_mul(d1_0, x1, y0); d1_1 = outer_mul(d1_1, x1, y1); d1_2 = outer_mul(d1_2, x1, y2); d1_3 = outer_mul(d1_3, x1, y3);
        d2_0 = outer_mul(d2_0, x2, y0); d2_1 = outer_mul(d2_1, x2, y1); d2_2 = outer_mul(d2_2, x2, y2); d2_3 = outer_mul(d2_3, x2, y3);
        d3_0 = outer_mul(d3_0, x3, y0); d3_1 = outer_mul(d3_1, x3, y1); d3_2 = outer_mul(d3_2, x3, y2); d3_3 = outer_mul(d3_3, x3, y3);
        d4_0 = outer_mul(d4_0, x4, y0); d4_1 = outer_mul(d4_1, x4, y1); d4_2 = outer_mul(d4_2, x4, y2); d4_3 = outer_mul(d4_3, x4, y3);
        d5_0 = outer_mul(d5_0, x5, y0); d5_1 = outer_mul(d5_1, x5, y1); d5_2 = outer_mul(d5_2, x5, y2); d5_3 = outer_mul(d5_3, x5, y3);
        d6_0 = outer_mul(d6_0, x6, y0); d6_1 = outer_mul(d6_1, x6, y1); d6_2 = outer_mul(d6_2, x6, y2); d6_3 = outer_mul(d6_3, x6, y3);
        d7_0 = outer_mul(d7_0, x7, y0); d7_1 = outer_mul(d7_1, x7, y1); d7_2 = outer_mul(d7_2, x7, y2); d7_3 = outer_mul(d7_3, x7, y3);
    }
    store_block(wid.z, r0 + 0u, c0 + 0u, d0_0); store_block(wid.z, r0 + 0u, c0 + 4u, d0_1); store_block(wid.z, r0 + 0u, c0 + 8u, d0_2); store_block(wid.z, r0 + 0u, c0 + 12u, d0_3);
    store_block(wid.z, r0 + 4u, c0 + 0u, d1_0); store_block(wid.z, r0 + 4u, c0 + 4u, d1_1); store_block(wid.z, r0 + 4u, c0 + 8u, d1_2); store_block(wid.z, r0 + 4u, c0 + 12u, d1_3);
    store_block(wid.z, r0 + 8u, c0 + 0u, d2_0); store_block(wid.z, r0 + 8u, c0 + 4u, d2_1); store_block(wid.z, r0 + 8u, c0 + 8u, d2_2); store_block(wid.z, r0 + 8u, c0 + 12u, d2_3);
    store_block(wid.z, r0 + 12u, c0 + 0u, d3_0); store_block(wid.z, r0 + 12u, c0 + 4u, d3_1); store_block(wid.z, r0 + 12u, c0 + 8u, d3_2); store_block(wid.z, r0 + 12u, c0 + 12u, d3_3);
    store_block(wid.z, r0 + 16u, c0 + 0u, d4_0); store_block(wid.z, r0 + 16u, c0 + 4u, d4_1); store_block(wid.z, r0 + 16u, c0 + 8u, d4_2); store_block(wid.z, r0 + 16u, c0 + 12u, d4_3);
    store_block(wid.z, r0 + 20u, c0 + 0u, d5_0); store_block(wid.z, r0 + 20u, c0 + 4u, d5_1); store_block(wid.z, r0 + 20u, c0 + 8u, d5_2); store_block(wid.z, r0 + 20u, c0 + 12u, d5_3);
    store_block(wid.z, r0 + 24u, c0 + 0u, d6_0); store_block(wid.z, r0 + 24u, c0 + 4u, d6_1); store_block(wid.z, r0 + 24u, c0 + 8u, d6_2); store_block(wid.z, r0 + 24u, c0 + 12u, d6_3);
    store_block(wid.z, r0 + 28u, c0 + 0u, d7_0); store_block(wid.z, r0 + 28u, c0 + 4u, d7_1); store_block(wid.z, r0 + 28u, c0 + 8u, d7_2); store_block(wid.z, r0 + 28u, c0 + 12u, d7_3);
}
