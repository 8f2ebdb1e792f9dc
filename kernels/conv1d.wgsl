// Causal depthwise conv over the sequence with PyTorch's taps: x, y [B, L, C] (time-major rows),
// w [C, K] (a [C, 1, K] weight), bias [C]; y[b, t, c] = Σ_k w[c, k] · x[b, t − K + 1 + k, c] + bias[c].

struct Params { batch: u32, len: u32, channels: u32, taps: u32, block_rows: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read> dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;
@group(0) @binding(6) var<storage, read_write> dx: array<f32>;
@group(0) @binding(7) var<storage, read_write> dw_part: array<f32>;
@group(0) @binding(8) var<storage, read_write> db_part: array<f32>;
// Decode: conv_state [B, K − 1, C] holds the last K − 1 inputs, oldest first.
@group(0) @binding(9) var<storage, read_write> conv_state: array<f32>;
// The walks with SILU (ops/conv1d.py conv1d_silu, CPU adapters): the forward also writes act = SiLU(y); the
// backward takes the gradient of act as dy + dy2 (its two consumers) and the forward's y as pre, so the add and
// silu_backward kernels, each a pass over [B, L, C] loading two operands, are folded into the walk.
override SILU: bool = false;
@group(0) @binding(10) var<storage, read_write> act: array<f32>;
@group(0) @binding(11) var<storage, read> pre: array<f32>;
@group(0) @binding(12) var<storage, read> dy2: array<f32>;

// As activations.wgsl's sigmoid_of, so the fused walks compute SiLU and its derivative as those kernels do.
fn sigmoid_of(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }

@compute @workgroup_size(256)
fn conv1d_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.batch * p.len * p.channels) { return; }
    let c = i % p.channels;
    let t = (i / p.channels) % p.len;
    var s = bias[c];
    for (var k = 0u; k < p.taps; k++) {
        let lag = p.taps - 1u - k;
        if (t >= lag) { s += w[c * p.taps + k] * x[i - lag * p.channels]; }
    }
    y[i] = s;
}

// dx[b, t, c] = Σ_k w[c, k] · dy[b, t + K − 1 − k, c] over outputs inside the sequence.
@compute @workgroup_size(256)
fn conv1d_backward_input(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.batch * p.len * p.channels) { return; }
    let c = i % p.channels;
    let t = (i / p.channels) % p.len;
    var s = 0.0;
    for (var k = 0u; k < p.taps; k++) {
        let lead = p.taps - 1u - k;
        if (t + lead < p.len) { s += w[c * p.taps + k] * dy[i + lead * p.channels]; }
    }
    dx[i] = s;
}

// Per row block: dw_part[block, c·K + k] = Σ_{rows in block} dy[b, t, c] · x[b, t − K + 1 + k, c] and
// db_part[block, c] = Σ dy (the k = 0 thread). ops.reduce.column_sums then sums the blocks, so the
// reduction over B·L rows is spread across many threads and runs in a fixed order.
// One thread per (c, k, block): threads along c read consecutive addresses.
@compute @workgroup_size(64)
fn conv1d_backward_weight(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let k = gid.y;
    let block = gid.z;
    if (c >= p.channels || k >= p.taps) { return; }
    let lag = p.taps - 1u - k;
    let end = min(p.batch * p.len, (block + 1u) * p.block_rows);
    var s = 0.0;
    var sb = 0.0;
    for (var row = block * p.block_rows; row < end; row++) {
        let i = row * p.channels + c;
        let g = dy[i];
        if (row % p.len >= lag) { s += g * x[i - lag * p.channels]; }
        sb += g;
    }
    dw_part[block * p.channels * p.taps + c * p.taps + k] = s;
    if (k == 0u) { db_part[block * p.channels + c] = sb; }
}

// The decode state after a prefill of x [B, L, C]: its last K − 1 rows (zeros before t = 0).
@compute @workgroup_size(256)
fn conv1d_state(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let keep = p.taps - 1u;
    if (i >= p.batch * keep * p.channels) { return; }
    let c = i % p.channels;
    let j = (i / p.channels) % keep;
    let b = i / (p.channels * keep);
    let t = i32(p.len) - i32(keep) + i32(j);
    var v = 0.0;
    if (t >= 0) { v = x[(b * p.len + u32(t)) * p.channels + c]; }
    conv_state[i] = v;
}

// One decoding step for x [B, C] (len = 1): y = Σ_k w[c, k] · window[k] + bias with the window =
// conv_state then x; the state then shifts by one (each thread owns one (b, c) column).
@compute @workgroup_size(256)
fn conv1d_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.batch * p.channels) { return; }
    let c = i % p.channels;
    let b = i / p.channels;
    let keep = p.taps - 1u;
    let base = b * keep * p.channels + c;
    let xv = x[i];
    var s = bias[c] + w[c * p.taps + keep] * xv;
    for (var k = 0u; k < keep; k++) {
        s += w[c * p.taps + k] * conv_state[base + k * p.channels];
        if (k + 1u < keep) {
            conv_state[base + k * p.channels] = conv_state[base + (k + 1u) * p.channels];
        } else {
            conv_state[base + k * p.channels] = xv;
        }
    }
    y[i] = s;
}

// --- CPU adapters: walks over time, K ≤ 4 ------------------------------------------------------------------------
// On Mesa llvmpipe every storage load or store is a loop over the SIMD lanes (~1.5 ns per lane), so the kernels
// above, one thread per output re-reading K inputs and K weights, move 2K + 1 words per output. These give one
// invocation a (batch row, channel) that walks time with the last four inputs (or upcoming output gradients) in
// a vec4 window and its taps in a vec4 register: 2 words per output forward, 3 per step backward, where the
// backward also accumulates the weight and bias gradients of its column (dw_part [B, C·K], db_part [B, C],
// summed over the batch by ops.reduce.column_sums). Taps are right-aligned in the vec4: tap k at component
// k + 4 − K (the rest 0). Grid grid_1d(B·C, 64): invocation b·C + c.

// Component j of the window holds the input at lag 3 − j; tap k multiplies lag K − 1 − k.
fn taps4(c: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < p.taps; k++) { v[k + 4u - p.taps] = w[c * p.taps + k]; }
    return v;
}

@compute @workgroup_size(64)
fn conv1d_forward_walk(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= p.batch * p.channels) { return; }
    let c = i % p.channels;
    let b = i / p.channels;
    let tw = taps4(c);
    let bc = bias[c];
    var win = vec4<f32>(0.0);  // x[t − 3], x[t − 2], x[t − 1], x[t] (0 before t = 0)
    for (var t = 0u; t < p.len; t++) {
        let e = (b * p.len + t) * p.channels + c;
        win = vec4<f32>(win.yzw, x[e]);
        let v = dot(tw, win) + bc;
        y[e] = v;
        if (SILU) { act[e] = v * sigmoid_of(v); }
    }
}

@compute @workgroup_size(64)
fn conv1d_backward_walk(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= p.batch * p.channels) { return; }
    let c = i % p.channels;
    let b = i / p.channels;
    let tw = taps4(c);
    let back = vec4<f32>(tw.w, tw.z, tw.y, tw.x);  // dx[t] = Σ_j tap(K − 1 − j) · dy[t + j]
    let row0 = b * p.len;
    var ahead = vec4<f32>(0.0);  // dy[t], dy[t + 1], dy[t + 2], dy[t + 3] (0 past the end)
    var past = vec4<f32>(0.0);   // x[t − 3], x[t − 2], x[t − 1], x[t] (0 before t = 0)
    for (var j = 0u; j < 3u; j++) {  // x[L − 3], x[L − 2], x[L − 1], _: one shift before the window at t = L − 1
        let t = i32(p.len) - 3 + i32(j);
        if (t >= 0) { past[j] = x[(row0 + u32(t)) * p.channels + c]; }
    }
    var dw4 = vec4<f32>(0.0);
    var db = 0.0;
    for (var s = p.len; s > 0u; s--) {
        let t = s - 1u;
        let e = (row0 + t) * p.channels + c;
        var g = dy[e];
        if (SILU) {  // as add_forward then silu_backward (1 − σ(v) as σ(−v))
            let v = pre[e];
            g = (g + dy2[e]) * sigmoid_of(v) * (1.0 + v * sigmoid_of(-v));
        }
        ahead = vec4<f32>(g, ahead.xyz);
        var oldest = 0.0;
        if (t >= 3u) { oldest = x[(row0 + t - 3u) * p.channels + c]; }
        past = vec4<f32>(oldest, past.xyz);
        dx[e] = dot(back, ahead);
        dw4 += g * past;
        db += g;
    }
    for (var k = 0u; k < p.taps; k++) { dw_part[b * p.channels * p.taps + c * p.taps + k] = dw4[k + 4u - p.taps]; }
    db_part[b * p.channels + c] = db;
}
