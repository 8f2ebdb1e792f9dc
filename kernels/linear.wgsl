// GEMM for linear layers: C[M, N] (+)= A[M, K] · B[K, N] (+ bias[N]).
// Transposes are pipeline constants, so one kernel gives the forward Y = X Wᵀ (TRANS_B),
// dX = dY W (none) and dW = dYᵀ X (TRANS_A). ACCUMULATE adds into C (gradient accumulation).
// Split-K: workgroup z takes K range [z·k_split, (z+1)·k_split) and writes plane z of C ([S, M, N]);
// ops/linear.py sums the planes (so a short, wide product like dW of a small projection still fills
// the GPU). Any M, N, K: out-of-range loads read 0 and out-of-range stores are skipped.
// Three kernels share the loads and stores:
//   matmul        64×64 tile per 16×16 workgroup, 4×4 register block per thread (four vec4s)
//   matmul_large  128×128 tile, 8×8 per thread (sixteen vec4s): twice the arithmetic per shared load
//   matmul_direct no workgroup memory or barriers, for CPU adapters
// Accumulators are named vec4 variables, never dynamically indexed arrays (those spill to memory).

override TRANS_A: bool = false;
override TRANS_B: bool = false;
override HAS_BIAS: bool = false;
override ACCUMULATE: bool = false;

struct Params { m: u32, n: u32, k: u32, k_split: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> c: array<f32>;

var<workgroup> a_tile: array<f32, 1024>;  // [k][rows of the tile], k-major so 4 rows read as one vec4
var<workgroup> b_tile: array<f32, 1024>;  // [k][cols of the tile]

fn k_end(z: u32) -> u32 { return min(p.k, (z + 1u) * p.k_split); }

fn load_a(row: u32, kk: u32, kend: u32) -> f32 {
    if (row >= p.m || kk >= kend) { return 0.0; }
    if (TRANS_A) { return a[kk * p.m + row]; }
    return a[row * p.k + kk];
}

fn load_b(kk: u32, col: u32, kend: u32) -> f32 {
    if (kk >= kend || col >= p.n) { return 0.0; }
    if (TRANS_B) { return b[col * p.k + kk]; }
    return b[kk * p.n + col];
}

// Stage a [ktile × rows] slice of A and a [ktile × cols] slice of B (rows = cols = 1024 / ktile),
// reading along whichever index is contiguous in memory so loads coalesce.
fn stage(t: u32, row0: u32, col0: u32, k0: u32, kend: u32, ktile: u32) {
    let width = 1024u / ktile;
    for (var r = 0u; r < 4u; r++) {
        let i = t + r * 256u;
        var kk: u32; var mm: u32;
        if (TRANS_A) { kk = i / width; mm = i % width; } else { mm = i / ktile; kk = i % ktile; }
        a_tile[kk * width + mm] = load_a(row0 + mm, k0 + kk, kend);
        var kb: u32; var nn: u32;
        if (TRANS_B) { nn = i / ktile; kb = i % ktile; } else { kb = i / width; nn = i % width; }
        b_tile[kb * width + nn] = load_b(k0 + kb, col0 + nn, kend);
    }
}

fn a4(base: u32) -> vec4<f32> { return vec4<f32>(a_tile[base], a_tile[base + 1u], a_tile[base + 2u], a_tile[base + 3u]); }
fn b4(base: u32) -> vec4<f32> { return vec4<f32>(b_tile[base], b_tile[base + 1u], b_tile[base + 2u], b_tile[base + 3u]); }

fn store_row(z: u32, row: u32, col0: u32, v: vec4<f32>) {
    if (row >= p.m) { return; }
    let plane = z * p.m * p.n;
    for (var j = 0u; j < 4u; j++) {
        let col = col0 + j;
        if (col < p.n) {
            let i = plane + row * p.n + col;
            var out = v[j];
            if (HAS_BIAS) { out += bias[col]; }
            if (ACCUMULATE) { out += c[i]; }
            c[i] = out;
        }
    }
}

@compute @workgroup_size(16, 16)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row0 = wid.y * 64u;
    let col0 = wid.x * 64u;
    let t = lid.y * 16u + lid.x;
    let kend = k_end(wid.z);
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = wid.z * p.k_split; k0 < kend; k0 += 16u) {
        stage(t, row0, col0, k0, kend, 16u);
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            let av = a4(kk * 64u + lid.y * 4u);
            let bv = b4(kk * 64u + lid.x * 4u);
            acc0 += av.x * bv;
            acc1 += av.y * bv;
            acc2 += av.z * bv;
            acc3 += av.w * bv;
        }
        workgroupBarrier();
    }
    let r0 = row0 + lid.y * 4u;
    let c0 = col0 + lid.x * 4u;
    store_row(wid.z, r0, c0, acc0);
    store_row(wid.z, r0 + 1u, c0, acc1);
    store_row(wid.z, r0 + 2u, c0, acc2);
    store_row(wid.z, r0 + 3u, c0, acc3);
}

// Rows ty·4 + i and 64 + ty·4 + i, columns tx·4 + j and 64 + tx·4 + j: the two halves keep a warp's
// shared-memory reads on distinct banks.
@compute @workgroup_size(16, 16)
fn matmul_large(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row0 = wid.y * 128u;
    let col0 = wid.x * 128u;
    let t = lid.y * 16u + lid.x;
    let kend = k_end(wid.z);
    var c00 = vec4<f32>(0.0); var c01 = vec4<f32>(0.0); var c02 = vec4<f32>(0.0); var c03 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0); var c11 = vec4<f32>(0.0); var c12 = vec4<f32>(0.0); var c13 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0); var c21 = vec4<f32>(0.0); var c22 = vec4<f32>(0.0); var c23 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0); var c31 = vec4<f32>(0.0); var c32 = vec4<f32>(0.0); var c33 = vec4<f32>(0.0);
    for (var k0 = wid.z * p.k_split; k0 < kend; k0 += 8u) {
        stage(t, row0, col0, k0, kend, 8u);
        workgroupBarrier();
        for (var kk = 0u; kk < 8u; kk++) {
            let a0 = a4(kk * 128u + lid.y * 4u);       // rows ty·4 ..
            let a1 = a4(kk * 128u + 64u + lid.y * 4u); // rows 64 + ty·4 ..
            let b0 = b4(kk * 128u + lid.x * 4u);
            let b1 = b4(kk * 128u + 64u + lid.x * 4u);
            c00 += a0.x * b0; c01 += a0.y * b0; c02 += a0.z * b0; c03 += a0.w * b0;
            c10 += a0.x * b1; c11 += a0.y * b1; c12 += a0.z * b1; c13 += a0.w * b1;
            c20 += a1.x * b0; c21 += a1.y * b0; c22 += a1.z * b0; c23 += a1.w * b0;
            c30 += a1.x * b1; c31 += a1.y * b1; c32 += a1.z * b1; c33 += a1.w * b1;
        }
        workgroupBarrier();
    }
    let r0 = row0 + lid.y * 4u;
    let r1 = r0 + 64u;
    let q0 = col0 + lid.x * 4u;
    let q1 = q0 + 64u;
    store_row(wid.z, r0, q0, c00); store_row(wid.z, r0 + 1u, q0, c01); store_row(wid.z, r0 + 2u, q0, c02); store_row(wid.z, r0 + 3u, q0, c03);
    store_row(wid.z, r0, q1, c10); store_row(wid.z, r0 + 1u, q1, c11); store_row(wid.z, r0 + 2u, q1, c12); store_row(wid.z, r0 + 3u, q1, c13);
    store_row(wid.z, r1, q0, c20); store_row(wid.z, r1 + 1u, q0, c21); store_row(wid.z, r1 + 2u, q0, c22); store_row(wid.z, r1 + 3u, q0, c23);
    store_row(wid.z, r1, q1, c30); store_row(wid.z, r1 + 1u, q1, c31); store_row(wid.z, r1 + 2u, q1, c32); store_row(wid.z, r1 + 3u, q1, c33);
}

// No workgroup memory or barriers: each thread reads its 4 rows and 4 columns straight from memory.
// On CPU adapters (llvmpipe/lavapipe run a workgroup's invocations as loops and every barrier is a
// context switch) the caches do the tiling's job.
@compute @workgroup_size(16, 16)
fn matmul_direct(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r0 = wid.y * 64u + lid.y * 4u;
    let c0 = wid.x * 64u + lid.x * 4u;
    let kend = k_end(wid.z);
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var kk = wid.z * p.k_split; kk < kend; kk++) {
        let bv = vec4<f32>(load_b(kk, c0, kend), load_b(kk, c0 + 1u, kend), load_b(kk, c0 + 2u, kend), load_b(kk, c0 + 3u, kend));
        acc0 += load_a(r0, kk, kend) * bv;
        acc1 += load_a(r0 + 1u, kk, kend) * bv;
        acc2 += load_a(r0 + 2u, kk, kend) * bv;
        acc3 += load_a(r0 + 3u, kk, kend) * bv;
    }
    store_row(wid.z, r0, c0, acc0);
    store_row(wid.z, r0 + 1u, c0, acc1);
    store_row(wid.z, r0 + 2u, c0, acc2);
    store_row(wid.z, r0 + 3u, c0, acc3);
}
