// Fused softmax cross-entropy over logits [M, V] with targets [M] (i32; ignore_index rows count 0).
// Forward: one 256-thread workgroup per row writes lse[row] and loss[row] = lse − logit[target]
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

var<workgroup> red: array<f32, 256>;

fn reduce_max(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (t < s) { red[t] = max(red[t], red[t + s]); }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(v: f32, t: u32) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (t < s) { red[t] += red[t + s]; }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn cross_entropy_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                         @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = wid.y * nwg.x + wid.x;
    if (row >= p.rows) { return; }  // uniform per workgroup
    let base = row * p.vocab;
    var m = -3.0e38;
    for (var i = lid.x; i < p.vocab; i += 256u) { m = max(m, logits[base + i]); }
    m = reduce_max(m, lid.x);
    var s = 0.0;
    for (var i = lid.x; i < p.vocab; i += 256u) { s += exp(logits[base + i] - m); }
    s = reduce_sum(s, lid.x);
    if (lid.x == 0u) {
        let l = m + log(s);
        lse[row] = l;
        let tgt = targets[row];
        if (tgt == p.ignore_index) { loss[row] = 0.0; } else { loss[row] = l - logits[base + u32(tgt)]; }
    }
}

@compute @workgroup_size(256)
fn cross_entropy_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.rows * p.vocab) { return; }
    let row = i / p.vocab;
    let col = i % p.vocab;
    let tgt = targets[row];
    if (tgt == p.ignore_index) { dlogits[i] = 0.0; return; }
    var g = exp(logits[i] - lse_in[row]);
    if (i32(col) == tgt) { g -= 1.0; }
    dlogits[i] = g * p.scale;
}

// CPU adapters (Mesa llvmpipe runs a workgroup as SIMD loops on one thread and every barrier is a coroutine
// switch: the two tree reductions above cost ~28 µs per row there): one invocation per row walks it once with
// an online softmax (running max m and Σ exp(x − m), rescaled when m grows). Grid grid_1d(rows, 64).
@compute @workgroup_size(64)
fn cross_entropy_forward_rows(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = gid.y * nwg.x * 64u + gid.x;
    if (row >= p.rows) { return; }
    let base = row * p.vocab;
    var m = -3.0e38;
    var s = 0.0;
    for (var i = 0u; i < p.vocab; i++) {
        let v = logits[base + i];
        let grown = max(m, v);
        s = s * exp(m - grown) + exp(v - grown);
        m = grown;
    }
    let l = m + log(s);
    lse[row] = l;
    let tgt = targets[row];
    if (tgt == p.ignore_index) { loss[row] = 0.0; } else { loss[row] = l - logits[base + u32(tgt)]; }
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
        var g = exp(logits[base + i] - l);
        if (i32(i) == tgt) { g -= 1.0; }
        dlogits[base + i] = select(0.0, g * p.scale, counted);
    }
}
