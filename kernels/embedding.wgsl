// Embedding lookup and its backward. The backward is a deterministic scatter-add with no atomics:
// the host sorts token positions by id (CSR: unique ids, segment starts, positions), and one thread
// per (unique id, dim) sums its segment, then adds into d_table (which may already hold the tied
// head's gradient).

// The backward sums positions [seg_begin, seg_begin + seg_len) of each id's segment per dispatch (all at once on
// GPUs; Mesa llvmpipe stops an invocation's loops after 65,535 iterations in total, so there a token repeated more
// often than that takes several dispatches, each adding its partial sum in order).
struct Params { tokens: u32, dim: u32, unique: u32, seg_begin: u32, seg_len: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> dy: array<f32>;
@group(0) @binding(5) var<storage, read> unique_ids: array<u32>;
@group(0) @binding(6) var<storage, read> starts: array<u32>;
@group(0) @binding(7) var<storage, read> positions: array<u32>;
@group(0) @binding(8) var<storage, read_write> d_table: array<f32>;

@compute @workgroup_size(256)
fn embedding_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.tokens * p.dim) { return; }
    let t = i / p.dim;
    let d = i % p.dim;
    out[i] = table[ids[t] * p.dim + d];
}

@compute @workgroup_size(256)
fn embedding_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.unique * p.dim) { return; }
    let u = i / p.dim;
    let d = i % p.dim;
    let lo = starts[u] + p.seg_begin;
    let hi = min(starts[u + 1u], lo + p.seg_len);
    if (p.seg_begin > 0u && lo >= hi) { return; }  // this id's positions ended in an earlier dispatch
    var s = 0.0;
    for (var j = lo; j < hi; j++) { s += dy[positions[j] * p.dim + d]; }
    let dst = unique_ids[u] * p.dim + d;
    d_table[dst] = d_table[dst] + s;
}
