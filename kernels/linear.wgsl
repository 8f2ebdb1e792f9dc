//! include texture
// GEMM for linear layers: C[M, N] (+)= A[M, K] · B[K, N] (+ bias[N]).
// Transposes are pipeline constants, so one kernel gives the forward Y = X Wᵀ (TRANS_B),
// dX = dY W (none) and dW = dYᵀ X (TRANS_A). ACCUMULATE adds into C (gradient accumulation).
// Split-K: workgroup z takes K range [z·k_split, (z+1)·k_split) and writes plane z of C ([S, M, N]);
// ops/linear.py sums the planes (so a short, wide product like dW of a small projection still fills
// the GPU). Any M, N, K: out-of-range loads read 0 and out-of-range stores are skipped.
//
// Entry points:
//   matmul         the tiled GEMM. 256 threads compute a 16·T × 16·T tile of C, each thread a T × T register
//                  block (T = 8: 128² tiles, the default; T = 4: 64² tiles for small outputs), stepping K by
//                  BK = 16 (so every thread stages whole vec4s of both operands).
//   matvec         C = A Bᵀ for at most 4 rows of A (decoding): 32 threads a column, reading the weight once.
//   matmul_direct  no workgroup memory or barriers, for CPU adapters.
//   matmul_subgroup  matmul_direct sharing B loads through 8-lane subgroups and reading A and B through textures
//                  (lavapipe); compiled only where the device has the subgroup feature (runtime/kernels.py strips
//                  it elsewhere).
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
//   vec4s so the transposed stores of a K-contiguous operand collide at most 2-way on banks. (An XOR
//   swizzle of k rows 8-15 that made them conflict-free measured no faster on the H200, 2026-12-01.)
//   The forward (both operands K-contiguous, staged by transposed scalar stores) stays ~20% slower
//   than dX on the H200; a timing-only diagnostic that skipped the K-contiguous operands' loads and
//   stores ran the 4096³ forward at 47.7 TFLOP/s against 33.3, but 32-k tiles read by eight threads
//   per row (128-byte reads; single-buffered, two barriers) did not help (33.1; dX 41.5 -> 34.7).
//   Two other stagings of a K-contiguous operand measured slower on the H200 (kernel alone, in the same runs
//   as main's, 2026-12-01 23:17-23:55) and were deleted: as the rows it is in memory ([row][k], rows of 5
//   vec4s so a warp's reads at one k hit different banks; each thread reads 16-byte k vectors of its 8 rows
//   and transposes 4×4 blocks in registers): in_proj fwd/dX 31.7/37.0 TFLOP/s against 34.9/38.8, out_proj
//   30.2/35.6 against 33.4/37.3, the tied head 33.4/37.3 against 38.9/42.4 (a thread holds 4 k of 12-16
//   rows at once instead of one k of 4, so more live registers); and threads 0-127 staging A, 128-255 B,
//   four vec4s each, a K-contiguous one as 4 rows × 4 k transposed in registers and stored as 4 vec4s
//   instead of 16 scalars: in_proj fwd/dX/dW 31.7/30.9/27.1 against 34.6/41.6/33.8.
// - Double buffering: tile t+1 is loaded from memory into registers after tile t is multiplied, then
//   written to the other shared buffer: one barrier per K step; the other resident workgroups hide the
//   loads. (Loading it before the multiply, to hide its latency behind the FMAs, ran dW 5-7% slower on
//   the H200 at 4096³ and at every model shape, 2026-12-01, four runs; fwd and dX equal within ~1%.
//   Issuing them after half the multiply: equal too, in_proj fwd/dX 34.1/41.3 against 34.4/41.2, out_proj
//   33.1/40.1 against 33.2/40.1, 2026-12-02 00:2x.)
// - The BK steps of a tile are written out (kstep(buf, 0u) ...), so every shared index but the per-thread
//   row/column is a constant. (Written when naga still bounded every loop with a counter and clamped dynamic
//   indices; the runtime now compiles without those checks, SHADER_RUNTIME_CHECKS, and the GEMM measured the
//   same either way.)
// - Accumulators are 4×4 blocks held in private mat4x4 variables and only ever indexed by constants
//   (a dynamically indexed accumulator array spills to memory).
// - Registers (H200, bench/pipeline_stats.py, 2026-12-02): T = 8 takes 147-151 a thread, so one 256-thread
//   workgroup a multiprocessor. Measured and dropped: 512 threads slicing each tile's K between two halves (the
//   driver then has 128 registers: it spilled 16 bytes, 30 against 41 TFLOP/s), 128 threads on 128 × 64 tiles
//   (163-169 registers, ~20), and shared-load addresses tied to the step before (145-149, within noise).
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
        multiply_tile(buf);
        fetch(t, kbeg + s * BK);
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

// ---- matvec -------------------------------------------------------------------------------------
// C[M, N] (+)= A[M, K] · B[N, K]ᵀ (+ bias) for a few rows (M ≤ 4: decoding a token per sequence), TRANS_B,
// K a multiple of 4. A tiled GEMM at M = 1 computes a 64-row tile for one row and walks K in 16-k steps with a
// barrier each: latency, not bandwidth (29-40 µs an in_proj on the H200). Here each 32-thread group of the
// workgroup takes one column n (one row of the weight, read as consecutive vec4s by its 32 threads, four loads
// in flight a thread) for all M rows of A, and a tree over the group's threads sums the partials in a fixed
// order: the weight is read once, at the memory's speed.
const MV_GROUP = 32u;  // threads per column
const MV_COLS = 8u;    // columns per 256-thread workgroup

fn mv_a(row: u32, i: u32) -> vec4<f32> { return a[row * (p.k / 4u) + i]; }

// The group's partial sums for rows 0..3 of A (components), in a_sh's first 256 vec4 slots.
fn mv_slot(t: u32) -> vec2<u32> { return vec2<u32>(t / BM_MAX4, t % BM_MAX4); }

@compute @workgroup_size(256)
fn matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let col = wid.x * MV_COLS + t / MV_GROUP;
    let lane = t % MV_GROUP;
    let k4 = p.k / 4u;
    let rows = min(p.m, 4u);
    var acc = vec4<f32>(0.0);  // component r: row r of A
    if (col < p.n) {
        let w0 = col * k4;
        var i = lane;
        for (; i + 3u * MV_GROUP < k4; i += 4u * MV_GROUP) {  // four independent weight loads in flight
            let wa = b[w0 + i];
            let wb = b[w0 + i + MV_GROUP];
            let wc = b[w0 + i + 2u * MV_GROUP];
            let wd = b[w0 + i + 3u * MV_GROUP];
            for (var r = 0u; r < 4u; r++) {
                if (r < rows) {
                    acc[r] += dot(mv_a(r, i), wa) + dot(mv_a(r, i + MV_GROUP), wb) + dot(mv_a(r, i + 2u * MV_GROUP), wc)
                              + dot(mv_a(r, i + 3u * MV_GROUP), wd);
                }
            }
        }
        for (; i < k4; i += MV_GROUP) {
            let w = b[w0 + i];
            for (var r = 0u; r < 4u; r++) {
                if (r < rows) { acc[r] += dot(mv_a(r, i), w); }
            }
        }
    }
    let at = mv_slot(t);
    a_sh[0][at.x][at.y] = acc;
    workgroupBarrier();
    for (var half = MV_GROUP / 2u; half > 0u; half /= 2u) {  // lanes [0, half) add lanes [half, 2·half)
        if (lane < half) {
            let other = mv_slot(t + half);
            a_sh[0][at.x][at.y] += a_sh[0][other.x][other.y];
        }
        workgroupBarrier();
    }
    if (lane < rows && col < p.n) {  // thread r of the group stores row r
        let total = mv_slot(t - lane);
        var v = a_sh[0][total.x][total.y][lane];
        if (HAS_BIAS) { v += bias[col >> 2u][col & 3u]; }
        let e = lane * p.n + col;
        if (ACCUMULATE) { v += c[e >> 2u][e & 3u]; }
        c[e >> 2u][e & 3u] = v;
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

// ---- matmul_subgroup ----------------------------------------------------------------------------
// matmul_direct with the B operand shared through the subgroup and both operands read through textures, for CPU
// adapters whose subgroups are 8 lanes (Mesa lavapipe on AVX2; ops/linear.py checks Runtime.subgroup_size). One
// workgroup is one subgroup of 8 invocations and computes a 64 × 64 tile of C; lane l the 8 rows r0 + 8l .. + 7
// and all 64 columns, in 2 × 16 accumulators of 4 × 4. Every lane needs the same 64 values of B per k, so lane l
// loads a 1/8 share of them and subgroupBroadcast hands each to all lanes (on lavapipe a broadcast from a
// constant lane is a vector shuffle). K goes in blocks of 8 whose operands are all loaded first, then each 4 × 4
// accumulator takes its 8 updates in a row (mul_k8): the 512 accumulators live in memory (16 vector registers),
// so this moves each one once per 8 k instead of once per k. The block's tail past K multiplies zeros.
// Why textures (the runtime copies A and B into them before the dispatch, runtime/gpu.py): lavapipe compiles a
// storage-buffer load into a loop over the lanes with a bounds check and a dynamic vector insert through memory
// per lane and component (~30 cycles each), a texel fetch into a gather unrolled over the lanes. With VEC4 (the
// contiguous dimensions of A and B multiples of 4) every load is a texel of 4 values along that dimension:
// 32 texels per lane per k-block at every transpose, instead of 128 scalar loads: 512×64×256 ran 4.6 -> 1.2 ms
// (2026-12-03, 2 cores). Without VEC4 (ragged shapes) each value is a texel fetch and a component pick.
// Rows and columns past the edge read the last row or column (their results are never stored); stores as in
// matmul_direct. COL_GROUPS (pipeline constant, 1-16) narrows the tile to 4 · COL_GROUPS columns: ops/linear.py
// takes the fewest groups that cover a narrow N (x_proj's 36, dt_proj's 4), so those outputs stop computing 64
// columns of which 28 or 60 are clamped copies; the accumulators, loads and stores of the groups past it are
// dead code under the constant.
override COL_GROUPS: u32 = 16u;
@group(0) @binding(5) var a_tex: texture_2d<f32>;  // A and B, copied into textures by the runtime (texture.wgsl)
@group(0) @binding(6) var b_tex: texture_2d<f32>;

// Values k .. k + 7 of row r of a row-major operand with rows of `len` values (A, or B when TRANS_B), k = kk the
// k-block's start; values past kz repeat the last ones in range (the caller zeroes A's).
fn row8(t: texture_2d<f32>, r: u32, len: u32, kk: u32, kz: u32) -> array<f32, 8> {
    let e = r * len;
    if (VEC4) {
        let lo = texel(t, (e + min(kk, kz - 4u)) >> 2u);
        let hi = texel(t, (e + min(kk + 4u, kz - 4u)) >> 2u);
        return array<f32, 8>(lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w);
    }
    return array<f32, 8>(texture_elem(t, e + min(kk, kz - 1u)), texture_elem(t, e + min(kk + 1u, kz - 1u)),
                         texture_elem(t, e + min(kk + 2u, kz - 1u)), texture_elem(t, e + min(kk + 3u, kz - 1u)),
                         texture_elem(t, e + min(kk + 4u, kz - 1u)), texture_elem(t, e + min(kk + 5u, kz - 1u)),
                         texture_elem(t, e + min(kk + 6u, kz - 1u)), texture_elem(t, e + min(kk + 7u, kz - 1u)));
}

// Values r .. r + 3 at k of an operand stored k-major with `len` values per k (A when TRANS_A, B otherwise);
// r past the end reads the last ones.
fn span4(t: texture_2d<f32>, k: u32, len: u32, r: u32) -> vec4<f32> {
    let e = k * len;
    if (VEC4) {  // r is a multiple of 4
        return texel(t, (e + min(r, len - 4u)) >> 2u);
    }
    return vec4<f32>(texture_elem(t, e + min(r, len - 1u)), texture_elem(t, e + min(r + 1u, len - 1u)),
                     texture_elem(t, e + min(r + 2u, len - 1u)), texture_elem(t, e + min(r + 3u, len - 1u)));
}

fn in_k(v: vec4<f32>, k: u32, kz: u32) -> vec4<f32> {
    return select(vec4<f32>(0.0), v, k < kz);
}

// A at a lane's rows r0 .. r0 + 7 for the k-block from kk, as [rows r0 + 4h .. + 3][k - kk] (0 past kz).
fn a_block(r0: u32, kk: u32, kz: u32) -> array<array<vec4<f32>, 8>, 2> {
    if (TRANS_A) {
        return array<array<vec4<f32>, 8>, 2>(a_cols8(r0, kk, kz), a_cols8(r0 + 4u, kk, kz));
    }
    let a0 = row8(a_tex, min(r0, p.m - 1u), p.k, kk, kz); let a1 = row8(a_tex, min(r0 + 1u, p.m - 1u), p.k, kk, kz);
    let a2 = row8(a_tex, min(r0 + 2u, p.m - 1u), p.k, kk, kz); let a3 = row8(a_tex, min(r0 + 3u, p.m - 1u), p.k, kk, kz);
    let a4 = row8(a_tex, min(r0 + 4u, p.m - 1u), p.k, kk, kz); let a5 = row8(a_tex, min(r0 + 5u, p.m - 1u), p.k, kk, kz);
    let a6 = row8(a_tex, min(r0 + 6u, p.m - 1u), p.k, kk, kz); let a7 = row8(a_tex, min(r0 + 7u, p.m - 1u), p.k, kk, kz);
    return array<array<vec4<f32>, 8>, 2>(
        array<vec4<f32>, 8>(in_k(vec4<f32>(a0[0], a1[0], a2[0], a3[0]), kk, kz), in_k(vec4<f32>(a0[1], a1[1], a2[1], a3[1]), kk + 1u, kz),
                            in_k(vec4<f32>(a0[2], a1[2], a2[2], a3[2]), kk + 2u, kz), in_k(vec4<f32>(a0[3], a1[3], a2[3], a3[3]), kk + 3u, kz),
                            in_k(vec4<f32>(a0[4], a1[4], a2[4], a3[4]), kk + 4u, kz), in_k(vec4<f32>(a0[5], a1[5], a2[5], a3[5]), kk + 5u, kz),
                            in_k(vec4<f32>(a0[6], a1[6], a2[6], a3[6]), kk + 6u, kz), in_k(vec4<f32>(a0[7], a1[7], a2[7], a3[7]), kk + 7u, kz)),
        array<vec4<f32>, 8>(in_k(vec4<f32>(a4[0], a5[0], a6[0], a7[0]), kk, kz), in_k(vec4<f32>(a4[1], a5[1], a6[1], a7[1]), kk + 1u, kz),
                            in_k(vec4<f32>(a4[2], a5[2], a6[2], a7[2]), kk + 2u, kz), in_k(vec4<f32>(a4[3], a5[3], a6[3], a7[3]), kk + 3u, kz),
                            in_k(vec4<f32>(a4[4], a5[4], a6[4], a7[4]), kk + 4u, kz), in_k(vec4<f32>(a4[5], a5[5], a6[5], a7[5]), kk + 5u, kz),
                            in_k(vec4<f32>(a4[6], a5[6], a6[6], a7[6]), kk + 6u, kz), in_k(vec4<f32>(a4[7], a5[7], a6[7], a7[7]), kk + 7u, kz)));
}

// TRANS_A: rows r .. r + 3 of A at k = kk .. kk + 7 (A is stored [K, M]).
fn a_cols8(r: u32, kk: u32, kz: u32) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(
        in_k(span4(a_tex, min(kk, kz - 1u), p.m, r), kk, kz), in_k(span4(a_tex, min(kk + 1u, kz - 1u), p.m, r), kk + 1u, kz),
        in_k(span4(a_tex, min(kk + 2u, kz - 1u), p.m, r), kk + 2u, kz), in_k(span4(a_tex, min(kk + 3u, kz - 1u), p.m, r), kk + 3u, kz),
        in_k(span4(a_tex, min(kk + 4u, kz - 1u), p.m, r), kk + 4u, kz), in_k(span4(a_tex, min(kk + 5u, kz - 1u), p.m, r), kk + 5u, kz),
        in_k(span4(a_tex, min(kk + 6u, kz - 1u), p.m, r), kk + 6u, kz), in_k(span4(a_tex, min(kk + 7u, kz - 1u), p.m, r), kk + 7u, kz));
}

// Lanes 0-3 (lo) or 4-7 (hi) of v as one vec4, in every lane.
fn lanes_lo4(v: f32) -> vec4<f32> {
    return vec4<f32>(subgroupBroadcast(v, 0u), subgroupBroadcast(v, 1u), subgroupBroadcast(v, 2u), subgroupBroadcast(v, 3u));
}

fn lanes_hi4(v: f32) -> vec4<f32> {
    return vec4<f32>(subgroupBroadcast(v, 4u), subgroupBroadcast(v, 5u), subgroupBroadcast(v, 6u), subgroupBroadcast(v, 7u));
}

// Each lane's v, in every lane.
fn lanes8(v: vec4<f32>) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(subgroupBroadcast(v, 0u), subgroupBroadcast(v, 1u), subgroupBroadcast(v, 2u), subgroupBroadcast(v, 3u),
                               subgroupBroadcast(v, 4u), subgroupBroadcast(v, 5u), subgroupBroadcast(v, 6u), subgroupBroadcast(v, 7u));
}

// B (stored [K, N]) at k, columns c0 .. c0 + 63 as 16 vec4, in every lane: lane l loads columns c0 + 4l .. + 3
// and c0 + 32 + 4l .. + 3 (the second only where COL_GROUPS passes 8; else 0).
fn cols64_b(k: u32, c0: u32, lane: u32) -> array<vec4<f32>, 16> {
    let v0 = lanes8(span4(b_tex, k, p.n, c0 + 4u * lane));
    var v1 = array<vec4<f32>, 8>();
    if (COL_GROUPS > 8u) { v1 = lanes8(span4(b_tex, k, p.n, c0 + 32u + 4u * lane)); }
    return array<vec4<f32>, 16>(v0[0], v0[1], v0[2], v0[3], v0[4], v0[5], v0[6], v0[7], v1[0], v1[1], v1[2], v1[3], v1[4], v1[5], v1[6], v1[7]);
}

// TRANS_B: lane l's columns c0 + 8j + l (j < 8) at k = kk + i: bt[j][i]; -> columns c0 .. c0 + 63 at kk + i.
fn cols64_bt(bt: array<array<f32, 8>, 8>, i: u32) -> array<vec4<f32>, 16> {
    return array<vec4<f32>, 16>(lanes_lo4(bt[0][i]), lanes_hi4(bt[0][i]), lanes_lo4(bt[1][i]), lanes_hi4(bt[1][i]),
                                lanes_lo4(bt[2][i]), lanes_hi4(bt[2][i]), lanes_lo4(bt[3][i]), lanes_hi4(bt[3][i]),
                                lanes_lo4(bt[4][i]), lanes_hi4(bt[4][i]), lanes_lo4(bt[5][i]), lanes_hi4(bt[5][i]),
                                lanes_lo4(bt[6][i]), lanes_hi4(bt[6][i]), lanes_lo4(bt[7][i]), lanes_hi4(bt[7][i]));
}

// B at columns c0 .. c0 + 63 for the k-block from kk, as [k - kk][column group], in every lane.
fn b_block(c0: u32, kk: u32, kz: u32, lane: u32) -> array<array<vec4<f32>, 16>, 8> {
    if (TRANS_B) {  // B stored [N, K]: lane l loads 8 k of its columns c0 + 8j + l (only those of the first COL_GROUPS vec4)
        let z = array<f32, 8>();
        let b0 = row8(b_tex, min(c0 + lane, p.n - 1u), p.k, kk, kz);
        var b1 = z; if (COL_GROUPS > 2u) { b1 = row8(b_tex, min(c0 + 8u + lane, p.n - 1u), p.k, kk, kz); }
        var b2 = z; if (COL_GROUPS > 4u) { b2 = row8(b_tex, min(c0 + 16u + lane, p.n - 1u), p.k, kk, kz); }
        var b3 = z; if (COL_GROUPS > 6u) { b3 = row8(b_tex, min(c0 + 24u + lane, p.n - 1u), p.k, kk, kz); }
        var b4 = z; if (COL_GROUPS > 8u) { b4 = row8(b_tex, min(c0 + 32u + lane, p.n - 1u), p.k, kk, kz); }
        var b5 = z; if (COL_GROUPS > 10u) { b5 = row8(b_tex, min(c0 + 40u + lane, p.n - 1u), p.k, kk, kz); }
        var b6 = z; if (COL_GROUPS > 12u) { b6 = row8(b_tex, min(c0 + 48u + lane, p.n - 1u), p.k, kk, kz); }
        var b7 = z; if (COL_GROUPS > 14u) { b7 = row8(b_tex, min(c0 + 56u + lane, p.n - 1u), p.k, kk, kz); }
        let bt = array<array<f32, 8>, 8>(b0, b1, b2, b3, b4, b5, b6, b7);
        return array<array<vec4<f32>, 16>, 8>(cols64_bt(bt, 0u), cols64_bt(bt, 1u), cols64_bt(bt, 2u), cols64_bt(bt, 3u),
                                              cols64_bt(bt, 4u), cols64_bt(bt, 5u), cols64_bt(bt, 6u), cols64_bt(bt, 7u));
    }
    return array<array<vec4<f32>, 16>, 8>(
        cols64_b(min(kk, kz - 1u), c0, lane), cols64_b(min(kk + 1u, kz - 1u), c0, lane), cols64_b(min(kk + 2u, kz - 1u), c0, lane),
        cols64_b(min(kk + 3u, kz - 1u), c0, lane), cols64_b(min(kk + 4u, kz - 1u), c0, lane), cols64_b(min(kk + 5u, kz - 1u), c0, lane),
        cols64_b(min(kk + 6u, kz - 1u), c0, lane), cols64_b(min(kk + 7u, kz - 1u), c0, lane));
}

// acc + Σ_j x[j] ⊗ y[j] over a k-block of 8.
fn mul_k8(acc: mat4x4<f32>, x: array<vec4<f32>, 8>, y: array<vec4<f32>, 8>) -> mat4x4<f32> {
    return outer_mul(outer_mul(outer_mul(outer_mul(outer_mul(outer_mul(outer_mul(outer_mul(
        acc, x[0], y[0]), x[1], y[1]), x[2], y[2]), x[3], y[3]), x[4], y[4]), x[5], y[5]), x[6], y[6]), x[7], y[7]);
}

@compute @workgroup_size(8)
fn matmul_subgroup(@builtin(workgroup_id) wid: vec3<u32>, @builtin(subgroup_invocation_id) lane: u32) {
    let r0 = wid.y * 64u + lane * 8u;
    let c0 = wid.x * 4u * COL_GROUPS;
    let kz = min(p.k, (wid.z + 1u) * p.k_split);
    var s0_0 = mat4x4<f32>(); var s0_1 = mat4x4<f32>(); var s0_2 = mat4x4<f32>(); var s0_3 = mat4x4<f32>(); var s0_4 = mat4x4<f32>(); var s0_5 = mat4x4<f32>(); var s0_6 = mat4x4<f32>(); var s0_7 = mat4x4<f32>();
    var s0_8 = mat4x4<f32>(); var s0_9 = mat4x4<f32>(); var s0_10 = mat4x4<f32>(); var s0_11 = mat4x4<f32>(); var s0_12 = mat4x4<f32>(); var s0_13 = mat4x4<f32>(); var s0_14 = mat4x4<f32>(); var s0_15 = mat4x4<f32>();
    var s1_0 = mat4x4<f32>(); var s1_1 = mat4x4<f32>(); var s1_2 = mat4x4<f32>(); var s1_3 = mat4x4<f32>(); var s1_4 = mat4x4<f32>(); var s1_5 = mat4x4<f32>(); var s1_6 = mat4x4<f32>(); var s1_7 = mat4x4<f32>();
    var s1_8 = mat4x4<f32>(); var s1_9 = mat4x4<f32>(); var s1_10 = mat4x4<f32>(); var s1_11 = mat4x4<f32>(); var s1_12 = mat4x4<f32>(); var s1_13 = mat4x4<f32>(); var s1_14 = mat4x4<f32>(); var s1_15 = mat4x4<f32>();
    for (var kk = wid.z * p.k_split; kk < kz; kk += 8u) {  // one loop iteration per k-block of 8
        let xs = a_block(r0, kk, kz);
        let ys = b_block(c0, kk, kz, lane);
        let xa0 = xs[0];
        let xa1 = xs[1];
        let y0 = ys[0]; let y1 = ys[1]; let y2 = ys[2]; let y3 = ys[3]; let y4 = ys[4]; let y5 = ys[5]; let y6 = ys[6]; let y7 = ys[7];
        let ya0 = array<vec4<f32>, 8>(y0[0], y1[0], y2[0], y3[0], y4[0], y5[0], y6[0], y7[0]);
        let ya1 = array<vec4<f32>, 8>(y0[1], y1[1], y2[1], y3[1], y4[1], y5[1], y6[1], y7[1]);
        let ya2 = array<vec4<f32>, 8>(y0[2], y1[2], y2[2], y3[2], y4[2], y5[2], y6[2], y7[2]);
        let ya3 = array<vec4<f32>, 8>(y0[3], y1[3], y2[3], y3[3], y4[3], y5[3], y6[3], y7[3]);
        let ya4 = array<vec4<f32>, 8>(y0[4], y1[4], y2[4], y3[4], y4[4], y5[4], y6[4], y7[4]);
        let ya5 = array<vec4<f32>, 8>(y0[5], y1[5], y2[5], y3[5], y4[5], y5[5], y6[5], y7[5]);
        let ya6 = array<vec4<f32>, 8>(y0[6], y1[6], y2[6], y3[6], y4[6], y5[6], y6[6], y7[6]);
        let ya7 = array<vec4<f32>, 8>(y0[7], y1[7], y2[7], y3[7], y4[7], y5[7], y6[7], y7[7]);
        let ya8 = array<vec4<f32>, 8>(y0[8], y1[8], y2[8], y3[8], y4[8], y5[8], y6[8], y7[8]);
        let ya9 = array<vec4<f32>, 8>(y0[9], y1[9], y2[9], y3[9], y4[9], y5[9], y6[9], y7[9]);
        let ya10 = array<vec4<f32>, 8>(y0[10], y1[10], y2[10], y3[10], y4[10], y5[10], y6[10], y7[10]);
        let ya11 = array<vec4<f32>, 8>(y0[11], y1[11], y2[11], y3[11], y4[11], y5[11], y6[11], y7[11]);
        let ya12 = array<vec4<f32>, 8>(y0[12], y1[12], y2[12], y3[12], y4[12], y5[12], y6[12], y7[12]);
        let ya13 = array<vec4<f32>, 8>(y0[13], y1[13], y2[13], y3[13], y4[13], y5[13], y6[13], y7[13]);
        let ya14 = array<vec4<f32>, 8>(y0[14], y1[14], y2[14], y3[14], y4[14], y5[14], y6[14], y7[14]);
        let ya15 = array<vec4<f32>, 8>(y0[15], y1[15], y2[15], y3[15], y4[15], y5[15], y6[15], y7[15]);
        s0_0 = mul_k8(s0_0, xa0, ya0); if (COL_GROUPS > 1u) { s0_1 = mul_k8(s0_1, xa0, ya1); } if (COL_GROUPS > 2u) { s0_2 = mul_k8(s0_2, xa0, ya2); } if (COL_GROUPS > 3u) { s0_3 = mul_k8(s0_3, xa0, ya3); }
        if (COL_GROUPS > 4u) { s0_4 = mul_k8(s0_4, xa0, ya4); } if (COL_GROUPS > 5u) { s0_5 = mul_k8(s0_5, xa0, ya5); } if (COL_GROUPS > 6u) { s0_6 = mul_k8(s0_6, xa0, ya6); } if (COL_GROUPS > 7u) { s0_7 = mul_k8(s0_7, xa0, ya7); }
        if (COL_GROUPS > 8u) { s0_8 = mul_k8(s0_8, xa0, ya8); } if (COL_GROUPS > 9u) { s0_9 = mul_k8(s0_9, xa0, ya9); } if (COL_GROUPS > 10u) { s0_10 = mul_k8(s0_10, xa0, ya10); } if (COL_GROUPS > 11u) { s0_11 = mul_k8(s0_11, xa0, ya11); }
        if (COL_GROUPS > 12u) { s0_12 = mul_k8(s0_12, xa0, ya12); } if (COL_GROUPS > 13u) { s0_13 = mul_k8(s0_13, xa0, ya13); } if (COL_GROUPS > 14u) { s0_14 = mul_k8(s0_14, xa0, ya14); } if (COL_GROUPS > 15u) { s0_15 = mul_k8(s0_15, xa0, ya15); }
        s1_0 = mul_k8(s1_0, xa1, ya0); if (COL_GROUPS > 1u) { s1_1 = mul_k8(s1_1, xa1, ya1); } if (COL_GROUPS > 2u) { s1_2 = mul_k8(s1_2, xa1, ya2); } if (COL_GROUPS > 3u) { s1_3 = mul_k8(s1_3, xa1, ya3); }
        if (COL_GROUPS > 4u) { s1_4 = mul_k8(s1_4, xa1, ya4); } if (COL_GROUPS > 5u) { s1_5 = mul_k8(s1_5, xa1, ya5); } if (COL_GROUPS > 6u) { s1_6 = mul_k8(s1_6, xa1, ya6); } if (COL_GROUPS > 7u) { s1_7 = mul_k8(s1_7, xa1, ya7); }
        if (COL_GROUPS > 8u) { s1_8 = mul_k8(s1_8, xa1, ya8); } if (COL_GROUPS > 9u) { s1_9 = mul_k8(s1_9, xa1, ya9); } if (COL_GROUPS > 10u) { s1_10 = mul_k8(s1_10, xa1, ya10); } if (COL_GROUPS > 11u) { s1_11 = mul_k8(s1_11, xa1, ya11); }
        if (COL_GROUPS > 12u) { s1_12 = mul_k8(s1_12, xa1, ya12); } if (COL_GROUPS > 13u) { s1_13 = mul_k8(s1_13, xa1, ya13); } if (COL_GROUPS > 14u) { s1_14 = mul_k8(s1_14, xa1, ya14); } if (COL_GROUPS > 15u) { s1_15 = mul_k8(s1_15, xa1, ya15); }
    }
    store_block(wid.z, r0 + 0u, c0 + 0u, s0_0); if (COL_GROUPS > 1u) { store_block(wid.z, r0 + 0u, c0 + 4u, s0_1); } if (COL_GROUPS > 2u) { store_block(wid.z, r0 + 0u, c0 + 8u, s0_2); } if (COL_GROUPS > 3u) { store_block(wid.z, r0 + 0u, c0 + 12u, s0_3); } if (COL_GROUPS > 4u) { store_block(wid.z, r0 + 0u, c0 + 16u, s0_4); } if (COL_GROUPS > 5u) { store_block(wid.z, r0 + 0u, c0 + 20u, s0_5); } if (COL_GROUPS > 6u) { store_block(wid.z, r0 + 0u, c0 + 24u, s0_6); } if (COL_GROUPS > 7u) { store_block(wid.z, r0 + 0u, c0 + 28u, s0_7); }
    if (COL_GROUPS > 8u) { store_block(wid.z, r0 + 0u, c0 + 32u, s0_8); } if (COL_GROUPS > 9u) { store_block(wid.z, r0 + 0u, c0 + 36u, s0_9); } if (COL_GROUPS > 10u) { store_block(wid.z, r0 + 0u, c0 + 40u, s0_10); } if (COL_GROUPS > 11u) { store_block(wid.z, r0 + 0u, c0 + 44u, s0_11); } if (COL_GROUPS > 12u) { store_block(wid.z, r0 + 0u, c0 + 48u, s0_12); } if (COL_GROUPS > 13u) { store_block(wid.z, r0 + 0u, c0 + 52u, s0_13); } if (COL_GROUPS > 14u) { store_block(wid.z, r0 + 0u, c0 + 56u, s0_14); } if (COL_GROUPS > 15u) { store_block(wid.z, r0 + 0u, c0 + 60u, s0_15); }
    store_block(wid.z, r0 + 4u, c0 + 0u, s1_0); if (COL_GROUPS > 1u) { store_block(wid.z, r0 + 4u, c0 + 4u, s1_1); } if (COL_GROUPS > 2u) { store_block(wid.z, r0 + 4u, c0 + 8u, s1_2); } if (COL_GROUPS > 3u) { store_block(wid.z, r0 + 4u, c0 + 12u, s1_3); } if (COL_GROUPS > 4u) { store_block(wid.z, r0 + 4u, c0 + 16u, s1_4); } if (COL_GROUPS > 5u) { store_block(wid.z, r0 + 4u, c0 + 20u, s1_5); } if (COL_GROUPS > 6u) { store_block(wid.z, r0 + 4u, c0 + 24u, s1_6); } if (COL_GROUPS > 7u) { store_block(wid.z, r0 + 4u, c0 + 28u, s1_7); }
    if (COL_GROUPS > 8u) { store_block(wid.z, r0 + 4u, c0 + 32u, s1_8); } if (COL_GROUPS > 9u) { store_block(wid.z, r0 + 4u, c0 + 36u, s1_9); } if (COL_GROUPS > 10u) { store_block(wid.z, r0 + 4u, c0 + 40u, s1_10); } if (COL_GROUPS > 11u) { store_block(wid.z, r0 + 4u, c0 + 44u, s1_11); } if (COL_GROUPS > 12u) { store_block(wid.z, r0 + 4u, c0 + 48u, s1_12); } if (COL_GROUPS > 13u) { store_block(wid.z, r0 + 4u, c0 + 52u, s1_13); } if (COL_GROUPS > 14u) { store_block(wid.z, r0 + 4u, c0 + 56u, s1_14); } if (COL_GROUPS > 15u) { store_block(wid.z, r0 + 4u, c0 + 60u, s1_15); }
}

// The subgroup size the adapter runs compute shaders with (Runtime.subgroup_size dispatches one invocation).
@compute @workgroup_size(1)
fn subgroup_size_probe(@builtin(subgroup_size) size: u32) {
    c[0] = vec4<f32>(f32(size));
}
