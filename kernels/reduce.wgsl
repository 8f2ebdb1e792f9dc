//! include texture
// Two-pass reductions with no races: pass 1 writes one partial per workgroup (grid-stride over the
// input) into partials[offset + wid]; pass 2, one workgroup, sums all partials into out[out_index].
// SQUARE selects Σx² (gradient norms) instead of Σx (losses).

override SQUARE: bool = false;
override ACCUMULATE: bool = false;

struct Params { n: u32, offset: u32, out_index: u32, scale: f32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> partials: array<f32>;
@group(0) @binding(3) var<storage, read> partials_in: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, 256>;

fn tree_sum(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (t < s) { red[t] += red[t + s]; }
        workgroupBarrier();
    }
    return red[0];
}

@compute @workgroup_size(256)
fn reduce_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_id) lid: vec3<u32>) {
    var s = 0.0;
    for (var i = wid.x * 256u + lid.x; i < p.n; i += nwg.x * 256u) {
        let v = x[i];
        if (SQUARE) { s += v * v; } else { s += v; }
    }
    let total = tree_sum(s, lid.x);
    if (lid.x == 0u) { partials[p.offset + wid.x] = total; }
}

// reduce_partial for CPU adapters whose subgroups have 8 lanes (ops/reduce.py picks it there): a workgroup is one
// subgroup, so there is no workgroup memory and no barrier. On lavapipe each of tree_sum's 9 barriers is a switch
// between the workgroup's 32 SIMD batches, which made reduce_partial cost ~19 ns per element, several times its
// loads. Lanes add with the same grid stride, then a butterfly over lanes 4, 2, 1: float addition is
// commutative, so every lane ends with the same bits and lane 0's store is deterministic.
@compute @workgroup_size(8)
fn reduce_partial_subgroup(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(subgroup_invocation_id) lane: u32) {
    var s = 0.0;
    for (var i = wid.x * 8u + lane; i < p.n; i += nwg.x * 8u) {
        let v = x[i];
        if (SQUARE) { s += v * v; } else { s += v; }
    }
    let a = s + subgroupShuffleXor(s, 4u);
    let b = a + subgroupShuffleXor(a, 2u);
    let total = b + subgroupShuffleXor(b, 1u);
    if (lane == 0u) { partials[p.offset + wid.x] = total; }
}

// out[out_index] = scale · Σ partials_in[0 .. n)
@compute @workgroup_size(256)
fn reduce_final(@builtin(local_invocation_id) lid: vec3<u32>) {
    var s = 0.0;
    for (var i = lid.x; i < p.n; i += 256u) { s += partials_in[i]; }
    let total = tree_sum(s, lid.x);
    if (lid.x == 0u) { out[p.out_index] = total * p.scale; }
}

// Column sums of a row-major [rows, cols] matrix in row blocks: thread (col, block) adds rows
// [block·block_rows, (block+1)·block_rows) and writes sums[block, col] (ACCUMULATE: adds into it).
// Called twice — blocks of rows, then the block partials — so every column sum is spread over many
// threads and still summed in a fixed order (no atomics). Sixteen independent running sums (rows 16j .. 16j + 15,
// as four vec4s; then one step of 8 rows, steps of 4, single rows) keep sixteen loads in flight per thread: with
// one sum each load waited for the previous add, and a block of 128 rows took ~50 µs on an H200 whatever its
// width; with four sums an 8192 × 24 matrix's 91-row blocks took 15.1 µs, with sixteen 10.4 (2026-12-03).
struct ColumnParams { rows: u32, cols: u32, block_rows: u32 }

@group(0) @binding(5) var<uniform> cp: ColumnParams;
@group(0) @binding(6) var<storage, read> matrix: array<f32>;
@group(0) @binding(7) var<storage, read_write> sums: array<f32>;

fn column_rows4(r: u32, col: u32) -> vec4<f32> {
    return vec4<f32>(matrix[r * cp.cols + col], matrix[(r + 1u) * cp.cols + col],
                     matrix[(r + 2u) * cp.cols + col], matrix[(r + 3u) * cp.cols + col]);
}

@compute @workgroup_size(64)
fn column_sums(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let block = gid.y;
    if (col >= cp.cols) { return; }
    let start = block * cp.block_rows;
    let end = min(cp.rows, start + cp.block_rows);
    var s0 = vec4<f32>(0.0);
    var s1 = vec4<f32>(0.0);
    var s2 = vec4<f32>(0.0);
    var s3 = vec4<f32>(0.0);
    var r = start;
    for (; r + 16u <= end; r += 16u) {
        s0 += column_rows4(r, col);
        s1 += column_rows4(r + 4u, col);
        s2 += column_rows4(r + 8u, col);
        s3 += column_rows4(r + 12u, col);
    }
    if (r + 8u <= end) {  // split-K planes come 8 rows at a time (their sums were slower as two 4-row steps)
        s0 += column_rows4(r, col);
        s1 += column_rows4(r + 4u, col);
        r += 8u;
    }
    for (; r + 4u <= end; r += 4u) { s0 += column_rows4(r, col); }
    let s4 = (s0 + s1) + (s2 + s3);
    var s = (s4.x + s4.y) + (s4.z + s4.w);
    for (; r < end; r++) { s += matrix[r * cp.cols + col]; }
    let i = block * cp.cols + col;
    if (ACCUMULATE) { s += sums[i]; }
    sums[i] = s;
}

// column_sums on CPU adapters (ops/reduce.py takes it where cols is a multiple of 4 and the matrix fits a texture):
// thread (c, block) sums columns 4c .. 4c + 3 over the block's rows as texels of matrix_tex, in four running vec4
// sums over rows ≡ 0, 1, 2, 3 (mod 4) added as (t0 + t1) + (t2 + t3), and stores a vec4 of sums4 (the same buffer
// as sums). A texel fetch is a gather on lavapipe where a buffer load is a loop over the lanes per component.
@group(0) @binding(8) var matrix_tex: texture_2d<f32>;
@group(0) @binding(9) var<storage, read_write> sums4: array<vec4<f32>>;

@compute @workgroup_size(64)
fn column_sums_texels(@builtin(global_invocation_id) gid: vec3<u32>) {
    let cols4 = hidden(matrix_tex, cp.cols) / 4u;
    let c = gid.x;
    let block = gid.y;
    if (c >= cols4) { return; }
    let start = block * hidden(matrix_tex, cp.block_rows);
    let end = min(hidden(matrix_tex, cp.rows), start + hidden(matrix_tex, cp.block_rows));
    var t0 = vec4<f32>(0.0);
    var t1 = vec4<f32>(0.0);
    var t2 = vec4<f32>(0.0);
    var t3 = vec4<f32>(0.0);
    var r = start;
    for (; r + 4u <= end; r += 4u) {
        t0 += texel(matrix_tex, r * cols4 + c);
        t1 += texel(matrix_tex, (r + 1u) * cols4 + c);
        t2 += texel(matrix_tex, (r + 2u) * cols4 + c);
        t3 += texel(matrix_tex, (r + 3u) * cols4 + c);
    }
    if (r < end) { t0 += texel(matrix_tex, r * cols4 + c); }
    if (r + 1u < end) { t1 += texel(matrix_tex, (r + 1u) * cols4 + c); }
    if (r + 2u < end) { t2 += texel(matrix_tex, (r + 2u) * cols4 + c); }
    var s = (t0 + t1) + (t2 + t3);
    let i = block * cols4 + c;
    if (ACCUMULATE) { s += sums4[i]; }
    sums4[i] = s;
}
