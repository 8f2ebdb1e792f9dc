//! include texture
// Fused softmax cross-entropy over logits [M, V] with targets [M] (i32; ignore_index rows count 0).
// Forward: one 256-thread workgroup per row reads it once (online softmax) and writes lse[row] and
// loss[row] = lse − logit[target]
// (cross_entropy_forward_rows, for CPU adapters: one invocation per row, no barriers).
// Backward: dlogits = (softmax − onehot) · scale on counted rows, 0 on ignored rows, where scale is
// 1 / (number of counted rows) for the mean (cross_entropy_backward_rows: one invocation per row, CPU adapters).

struct Params { rows: u32, vocab: u32, ignore_index: i32, scale: f32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<i32>;
@group(0) @binding(3) var<storage, read> lse_in: array<f32>;
@group(0) @binding(4) var<storage, read_write> lse: array<f32>;
@group(0) @binding(5) var<storage, read_write> loss: array<f32>;
@group(0) @binding(6) var<storage, read_write> dlogits: array<f32>;
@group(0) @binding(7) var logits_tex: texture_2d<f32>;  // the *_rows entry points read the logits as a texture (texture.wgsl)

var<workgroup> red_max: array<f32, 256>;
var<workgroup> red_sum: array<f32, 256>;

// Online softmax: a running max m and s = Σ exp(x − m), rescaled when m grows, so a row is read once.
fn online_add(ms: vec2<f32>, v: f32) -> vec2<f32> {
    if (v > ms.x) { return vec2<f32>(v, ms.y * exp(ms.x - v) + 1.0); }
    return vec2<f32>(ms.x, ms.y + exp(v - ms.x));
}

fn online_merge(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = max(a.x, b.x);
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

// Tree merge of one (max, sum) pair per thread; thread 0 gets the row's.
fn reduce_online(v: vec2<f32>, t: u32) -> vec2<f32> {
    red_max[t] = v.x;
    red_sum[t] = v.y;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (t < s) {
            let merged = online_merge(vec2<f32>(red_max[t], red_sum[t]), vec2<f32>(red_max[t + s], red_sum[t + s]));
            red_max[t] = merged.x;
            red_sum[t] = merged.y;
        }
        workgroupBarrier();
    }
    return vec2<f32>(red_max[0], red_sum[0]);
}

// One pass over the row (it was a max pass, then an exp-sum pass: twice the logits' 1.6 GB at the 130m shape).
@compute @workgroup_size(256)
fn cross_entropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) { return; }  // uniform per workgroup
    let base = row * p.vocab;
    var ms = vec2<f32>(-3.0e38, 0.0);
    for (var i = lid.x; i < p.vocab; i += 256u) { ms = online_add(ms, logits[base + i]); }
    ms = reduce_online(ms, lid.x);
    if (lid.x == 0u) {
        let l = ms.x + log(ms.y);
        lse[row] = l;
        let tgt = targets[row];
        if (tgt == p.ignore_index) { loss[row] = 0.0; } else { loss[row] = l - logits[base + u32(tgt)]; }
    }
}

// (softmax − onehot) · scale at one logit of a counted row
fn dlogit(v: f32, col: u32, tgt: i32, l: f32) -> f32 {
    var g = exp(v - l);
    if (i32(col) == tgt) { g -= 1.0; }
    return g * p.scale;
}

@compute @workgroup_size(256)
fn cross_entropy_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.rows * p.vocab) { return; }
    let row = i / p.vocab;
    let tgt = targets[row];
    if (tgt == p.ignore_index) { dlogits[i] = 0.0; return; }
    dlogits[i] = dlogit(logits[i], i % p.vocab, tgt, lse_in[row]);
}

// The same four logits per thread as vec4 loads and stores where vocab % 4 == 0 (the 130m vocab, 50280, is):
// a quarter of the threads, each row's target and lse loaded once per four.
@group(0) @binding(7) var<storage, read> logits4: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read_write> dlogits4: array<vec4<f32>>;

@compute @workgroup_size(256)
fn cross_entropy_backward_vec4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i * 4u >= p.rows * p.vocab) { return; }
    let row = i * 4u / p.vocab;
    let col = i * 4u % p.vocab;
    let tgt = targets[row];
    if (tgt == p.ignore_index) { dlogits4[i] = vec4<f32>(0.0); return; }
    let l = lse_in[row];
    let v = logits4[i];
    dlogits4[i] = vec4<f32>(dlogit(v.x, col, tgt, l), dlogit(v.y, col + 1u, tgt, l), dlogit(v.z, col + 2u, tgt, l),
                            dlogit(v.w, col + 3u, tgt, l));
}

// CPU adapters (Mesa llvmpipe runs a workgroup as SIMD loops on one thread and every barrier is a coroutine
// switch: a tree reduction costs ~14 µs per row there): one invocation per row walks it once with the same online
// softmax. Grid grid_1d(rows, 64).
@compute @workgroup_size(64)
fn cross_entropy_forward_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = gid.y * nwg.x * 64u + gid.x;
    if (row >= p.rows) { return; }
    let base = row * p.vocab;
    var ms = vec2<f32>(-3.0e38, 0.0);
    for (var i = 0u; i < p.vocab; i++) { ms = online_add(ms, texture_elem(logits_tex, base + i)); }
    let m = ms.x;
    let s = ms.y;
    let l = m + log(s);
    lse[row] = l;
    let tgt = targets[row];
    if (tgt == p.ignore_index) { loss[row] = 0.0; } else { loss[row] = l - texture_elem(logits_tex, base + u32(tgt)); }
}

// The backward as a walk too (CPU adapters): one invocation per row reads its target and lse once, then
// 1 load and 1 store per logit (the per-element kernel above reads 3 words per element). Grid grid_1d(rows, 64).
@compute @workgroup_size(64)
fn cross_entropy_backward_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = gid.y * nwg.x * 64u + gid.x;
    if (row >= p.rows) { return; }
    let base = row * p.vocab;
    let tgt = targets[row];
    let counted = tgt != p.ignore_index;
    let l = lse_in[row];
    for (var i = 0u; i < p.vocab; i++) {
        var g = exp(texture_elem(logits_tex, base + i) - l);
        if (i32(i) == tgt) { g -= 1.0; }
        dlogits[base + i] = select(0.0, g * p.scale, counted);
    }
}
