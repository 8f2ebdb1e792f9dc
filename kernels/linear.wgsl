// Tiled GEMM for linear layers: C[M, N] (+)= A[M, K] · B[K, N] (+ bias[N]).
// Transposes are pipeline constants, so one kernel gives the forward Y = X Wᵀ (TRANS_B),
// dX = dY W (none) and dW = dYᵀ X (TRANS_A). ACCUMULATE adds into C (gradient accumulation).
// Each 16×16 workgroup computes a 64×64 tile; each thread a 4×4 register block held in four vec4s
// (no dynamically indexed arrays: they spill). K is walked in slices of 16 through workgroup memory.
// Any M, N, K: out-of-range loads read 0 and out-of-range stores are skipped.

override TRANS_A: bool = false;
override TRANS_B: bool = false;
override HAS_BIAS: bool = false;
override ACCUMULATE: bool = false;

struct Params { m: u32, n: u32, k: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> c: array<f32>;

const TILE: u32 = 64u;
const KTILE: u32 = 16u;

var<workgroup> a_tile: array<f32, 1024>;  // [KTILE][TILE], k-major so a thread reads 4 rows as one vec4
var<workgroup> b_tile: array<f32, 1024>;  // [KTILE][TILE]

fn load_a(row: u32, kk: u32) -> f32 {
    if (row >= p.m || kk >= p.k) { return 0.0; }
    if (TRANS_A) { return a[kk * p.m + row]; }
    return a[row * p.k + kk];
}

fn load_b(kk: u32, col: u32) -> f32 {
    if (kk >= p.k || col >= p.n) { return 0.0; }
    if (TRANS_B) { return b[col * p.k + kk]; }
    return b[kk * p.n + col];
}

fn a4(base: u32) -> vec4<f32> { return vec4<f32>(a_tile[base], a_tile[base + 1u], a_tile[base + 2u], a_tile[base + 3u]); }
fn b4(base: u32) -> vec4<f32> { return vec4<f32>(b_tile[base], b_tile[base + 1u], b_tile[base + 2u], b_tile[base + 3u]); }

fn store_row(row: u32, col0: u32, v: vec4<f32>) {
    if (row >= p.m) { return; }
    for (var j = 0u; j < 4u; j++) {
        let col = col0 + j;
        if (col < p.n) {
            var out = v[j];
            if (HAS_BIAS) { out += bias[col]; }
            if (ACCUMULATE) { out += c[row * p.n + col]; }
            c[row * p.n + col] = out;
        }
    }
}

@compute @workgroup_size(16, 16)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row0 = wid.y * TILE;
    let col0 = wid.x * TILE;
    let t = lid.y * 16u + lid.x;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < p.k; k0 += KTILE) {
        for (var r = 0u; r < 4u; r++) {
            let i = t + r * 256u;
            // Read along whichever index is contiguous in memory, so loads coalesce.
            var kk: u32; var mm: u32;
            if (TRANS_A) { kk = i / TILE; mm = i % TILE; } else { mm = i / KTILE; kk = i % KTILE; }
            a_tile[kk * TILE + mm] = load_a(row0 + mm, k0 + kk);
            var kb: u32; var nn: u32;
            if (TRANS_B) { nn = i / KTILE; kb = i % KTILE; } else { kb = i / TILE; nn = i % TILE; }
            b_tile[kb * TILE + nn] = load_b(k0 + kb, col0 + nn);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KTILE; kk++) {
            let av = a4(kk * TILE + lid.y * 4u);
            let bv = b4(kk * TILE + lid.x * 4u);
            acc0 += av.x * bv;
            acc1 += av.y * bv;
            acc2 += av.z * bv;
            acc3 += av.w * bv;
        }
        workgroupBarrier();
    }
    let r0 = row0 + lid.y * 4u;
    let c0 = col0 + lid.x * 4u;
    store_row(r0, c0, acc0);
    store_row(r0 + 1u, c0, acc1);
    store_row(r0 + 2u, c0, acc2);
    store_row(r0 + 3u, c0, acc3);
}

// The same product without workgroup memory or barriers: each thread reads its 4 rows and 4 columns
// straight from memory. On CPU adapters (llvmpipe/lavapipe run a workgroup's invocations as loops and
// every barrier is a context switch) the caches do the tiling's job and this is several times faster.
@compute @workgroup_size(16, 16)
fn matmul_direct(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r0 = wid.y * TILE + lid.y * 4u;
    let c0 = wid.x * TILE + lid.x * 4u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var kk = 0u; kk < p.k; kk++) {
        let bv = vec4<f32>(load_b(kk, c0), load_b(kk, c0 + 1u), load_b(kk, c0 + 2u), load_b(kk, c0 + 3u));
        acc0 += load_a(r0, kk) * bv;
        acc1 += load_a(r0 + 1u, kk) * bv;
        acc2 += load_a(r0 + 2u, kk) * bv;
        acc3 += load_a(r0 + 3u, kk) * bv;
    }
    store_row(r0, c0, acc0);
    store_row(r0 + 1u, c0, acc1);
    store_row(r0 + 2u, c0, acc2);
    store_row(r0 + 3u, c0, acc3);
}
