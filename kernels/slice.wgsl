// Column slices of row-major matrices. A column range of [M, P] is a strided gather from every row
// (a contiguous byte copy is right only for M = 1). Scatter is the backward and builds concatenations.

override ACCUMULATE: bool = false;

struct Params { rows: u32, src_cols: u32, dst_cols: u32, start: u32, width: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

// dst [M, width] = src[:, start : start + width]
@compute @workgroup_size(256)
fn column_slice(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.rows * p.width) { return; }
    let r = i / p.width;
    let c = i % p.width;
    dst[i] = src[r * p.src_cols + p.start + c];
}

// dst[:, start : start + width] (+)= src [M, width]
@compute @workgroup_size(256)
fn column_scatter(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.rows * p.width) { return; }
    let r = i / p.width;
    let c = i % p.width;
    let j = r * p.dst_cols + p.start + c;
    var v = src[i];
    if (ACCUMULATE) { v += dst[j]; }
    dst[j] = v;
}
