//! include texture
// Column slices of row-major matrices. A column range of [M, P] is a strided gather from every row
// (a contiguous byte copy is right only for M = 1). Scatter is the backward and builds concatenations.
// Both move up to three consecutive column ranges in one pass (widths width, width1, width2; 0 for unused parts):
// a slice into dst, dst1, dst2, a scatter from src, src1, src2 (a Mamba mixer splits x_proj's output into dt, B, C
// and concatenates their gradients this way: one dispatch instead of three).

override ACCUMULATE: bool = false;
override PARTS: u32 = 3u;  // parts used (1-3): a constant, so a plain slice or scatter compiles without the branches

struct Params { rows: u32, src_cols: u32, dst_cols: u32, start: u32, width: u32, width1: u32, width2: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst1: array<f32>;
@group(0) @binding(4) var<storage, read_write> dst2: array<f32>;
@group(0) @binding(5) var<storage, read> src1: array<f32>;
@group(0) @binding(6) var<storage, read> src2: array<f32>;
@group(0) @binding(13) var src_tex: texture_2d<f32>;  // the *_rows entry points read their sources through textures
@group(0) @binding(14) var src1_tex: texture_2d<f32>;
@group(0) @binding(15) var src2_tex: texture_2d<f32>;

// dst_k [M, width_k] = src[:, start + offset_k : start + offset_k + width_k], the parts side by side
@compute @workgroup_size(256)
fn column_slice(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let total = p.width + p.width1 + p.width2;
    if (i >= p.rows * total) { return; }
    let r = i / total;
    let c = i % total;
    let v = src[r * p.src_cols + p.start + c];
    if (PARTS == 1u || c < p.width) {
        dst[r * p.width + c] = v;
    } else if (PARTS == 2u || c < p.width + p.width1) {
        dst1[r * p.width1 + c - p.width] = v;
    } else {
        dst2[r * p.width2 + c - p.width - p.width1] = v;
    }
}

// dst[:, start + offset_k : start + offset_k + width_k] (+)= src_k [M, width_k]
@compute @workgroup_size(256)
fn column_scatter(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let total = p.width + p.width1 + p.width2;
    if (i >= p.rows * total) { return; }
    let r = i / total;
    let c = i % total;
    var v: f32;
    if (PARTS == 1u || c < p.width) {
        v = src[r * p.width + c];
    } else if (PARTS == 2u || c < p.width + p.width1) {
        v = src1[r * p.width1 + c - p.width];
    } else {
        v = src2[r * p.width2 + c - p.width - p.width1];
    }
    let j = r * p.dst_cols + p.start + c;
    if (ACCUMULATE) { v += dst[j]; }
    dst[j] = v;
}

// The same with four columns per thread as vec4 loads and stores, where every width, the start and the row
// lengths are multiples of 4 (ops/slice.py checks; Mamba-1's z and dz, 1536 columns at 1536 of 3072, are): a quarter
// of the threads and of the index arithmetic. Widths and offsets are in vec4s (p.* / 4) here.
@group(0) @binding(7) var<storage, read> src4: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> dst4: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read_write> dst4_1: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> dst4_2: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read> src4_1: array<vec4<f32>>;
@group(0) @binding(12) var<storage, read> src4_2: array<vec4<f32>>;

@compute @workgroup_size(256)
fn column_slice_vec4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let w0 = p.width / 4u;
    let w1 = p.width1 / 4u;
    let w2 = p.width2 / 4u;
    let total = w0 + w1 + w2;
    if (i >= p.rows * total) { return; }
    let r = i / total;
    let c = i % total;
    let v = src4[r * (p.src_cols / 4u) + p.start / 4u + c];
    if (PARTS == 1u || c < w0) {
        dst4[r * w0 + c] = v;
    } else if (PARTS == 2u || c < w0 + w1) {
        dst4_1[r * w1 + c - w0] = v;
    } else {
        dst4_2[r * w2 + c - w0 - w1] = v;
    }
}

@compute @workgroup_size(256)
fn column_scatter_vec4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let w0 = p.width / 4u;
    let w1 = p.width1 / 4u;
    let w2 = p.width2 / 4u;
    let total = w0 + w1 + w2;
    if (i >= p.rows * total) { return; }
    let r = i / total;
    let c = i % total;
    var v: vec4<f32>;
    if (PARTS == 1u || c < w0) {
        v = src4[r * w0 + c];
    } else if (PARTS == 2u || c < w0 + w1) {
        v = src4_1[r * w1 + c - w0];
    } else {
        v = src4_2[r * w2 + c - w0 - w1];
    }
    let j = r * (p.dst_cols / 4u) + p.start / 4u + c;
    if (ACCUMULATE) { v += dst4[j]; }
    dst4[j] = v;
}

// CPU adapters (Mesa lavapipe, where a division per element is a scalar loop over the SIMD lanes): one invocation
// per row walks its columns, 40% faster than one per element there (measured, 512 × 128 of 256 columns). The
// part of column c is found by comparing, as above. Grid grid_1d(rows, 64).
@compute @workgroup_size(64)
fn column_slice_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = gid.y * nwg.x * 64u + gid.x;
    if (r >= p.rows) { return; }
    let first = r * p.src_cols + p.start;
    for (var c = 0u; c < p.width; c++) { dst[r * p.width + c] = texture_elem(src_tex, first + c); }
    if (PARTS >= 2u) {
        for (var c = 0u; c < p.width1; c++) { dst1[r * p.width1 + c] = texture_elem(src_tex, first + p.width + c); }
    }
    if (PARTS >= 3u) {
        for (var c = 0u; c < p.width2; c++) {
            dst2[r * p.width2 + c] = texture_elem(src_tex, first + p.width + p.width1 + c);
        }
    }
}

fn put_rows(j: u32, v: f32) {
    var o = v;
    if (ACCUMULATE) { o += dst[j]; }
    dst[j] = o;
}

@compute @workgroup_size(64)
fn column_scatter_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = gid.y * nwg.x * 64u + gid.x;
    if (r >= p.rows) { return; }
    let first = r * p.dst_cols + p.start;
    for (var c = 0u; c < p.width; c++) { put_rows(first + c, texture_elem(src_tex, r * p.width + c)); }
    if (PARTS >= 2u) {
        for (var c = 0u; c < p.width1; c++) { put_rows(first + p.width + c, texture_elem(src1_tex, r * p.width1 + c)); }
    }
    if (PARTS >= 3u) {
        for (var c = 0u; c < p.width2; c++) {
            put_rows(first + p.width + p.width1 + c, texture_elem(src2_tex, r * p.width2 + c));
        }
    }
}
