//! include texture
// Causal depthwise conv over the sequence with PyTorch's taps: x [B, L, ·] (time-major rows), y [B, L, C],
// w [C, K] (a [C, 1, K] weight), bias [C]; y[b, t, c] = Σ_k w[c, k] · x[b, t − K + 1 + k, c] + bias[c].
// x may be a column range of a wider matrix (Mamba's in_proj output): its rows are x_stride floats apart and
// channel c is column x_col + c, so no column_slice copy is made; the input gradient dx is written the same way
// into columns dx_col.. of rows dx_stride apart (the combined in_proj gradient, no column_scatter).

struct Params {
    batch: u32, len: u32, channels: u32, taps: u32, block_rows: u32, seg_len: u32,
    x_stride: u32, x_col: u32, dx_stride: u32, dx_col: u32, split1: u32, split2: u32,
}

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
// The walks with SILU (ops/conv1d.py conv1d_silu, Mamba's x branch): the forward writes y = SiLU(conv) instead
// of the conv; the backward recomputes the conv from its input window and takes the gradient of SiLU's output
// as dy (+ dy_other with TWO_GRADS: Mamba-1's activation feeds both x_proj and the scan), so the add and
// silu_backward kernels and the conv output itself (a pass over [B, L, C] each) are folded into the walks.
override SILU: bool = false;
override TWO_GRADS: bool = false;
@group(0) @binding(10) var<storage, read> dy_other: array<f32>;
// The walks' y and dy in PARTS tensors by channel ranges [0, split1), [split1, split2), [split2, C) (y, y1, y2 and
// dy, dy1, dy2, each [B, L, its width]): Mamba-2's conv output is the SSD's x, B and C and their gradients come
// back apart, so no split or concat pass is made for them. One part: split1 = C.
override PARTS: u32 = 1u;
@group(0) @binding(11) var<storage, read_write> y1: array<f32>;
@group(0) @binding(12) var<storage, read_write> y2: array<f32>;
@group(0) @binding(13) var<storage, read> dy1: array<f32>;
@group(0) @binding(14) var<storage, read> dy2: array<f32>;

// Where channel c of row `row` lives in its part (the part is fixed per walk invocation, so the branches are uniform).
fn store_part(row: u32, c: u32, v: f32) {
    if (PARTS == 1u || c < p.split1) {
        y[row * p.split1 + c] = v;
    } else if (PARTS == 2u || c < p.split2) {
        y1[row * (p.split2 - p.split1) + c - p.split1] = v;
    } else {
        y2[row * (p.channels - p.split2) + c - p.split2] = v;
    }
}

// TEXTURED (CPU adapters): the walks read x and the output gradients through textures (texture.wgsl); on GPUs
// they read the buffers and the texture bindings are left unread.
override TEXTURED: bool = false;
@group(0) @binding(15) var x_tex: texture_2d<f32>;
@group(0) @binding(16) var dy_tex: texture_2d<f32>;
@group(0) @binding(17) var dy1_tex: texture_2d<f32>;
@group(0) @binding(18) var dy2_tex: texture_2d<f32>;
@group(0) @binding(19) var dy_other_tex: texture_2d<f32>;

fn load_part(row: u32, c: u32) -> f32 {
    if (PARTS == 1u || c < p.split1) {
        let e = row * p.split1 + c;
        if (TEXTURED) { return texture_elem(dy_tex, e); }
        return dy[e];
    }
    if (PARTS == 2u || c < p.split2) {
        let e = row * (p.split2 - p.split1) + c - p.split1;
        if (TEXTURED) { return texture_elem(dy1_tex, e); }
        return dy1[e];
    }
    let e = row * (p.channels - p.split2) + c - p.split2;
    if (TEXTURED) { return texture_elem(dy2_tex, e); }
    return dy2[e];
}

// As activations.wgsl's sigmoid_of, so the fused walks compute SiLU and its derivative as those kernels do.
fn sigmoid_of(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }

// x at (row of the [B·L] rows, channel)
fn x_at(row: u32, c: u32) -> f32 { return x[row * p.x_stride + p.x_col + c]; }

fn x_walk(row: u32, c: u32) -> f32 {
    if (TEXTURED) { return texture_elem(x_tex, row * p.x_stride + p.x_col + c); }
    return x_at(row, c);
}

@compute @workgroup_size(256)
fn conv1d_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.batch * p.len * p.channels) { return; }
    let c = i % p.channels;
    let row = i / p.channels;
    let t = row % p.len;
    var s = bias[c];
    for (var k = 0u; k < p.taps; k++) {
        let lag = p.taps - 1u - k;
        if (t >= lag) { s += w[c * p.taps + k] * x_at(row - lag, c); }
    }
    y[i] = s;
}

// dx[b, t, c] = Σ_k w[c, k] · dy[b, t + K − 1 − k, c] over outputs inside the sequence.
@compute @workgroup_size(256)
fn conv1d_backward_input(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.batch * p.len * p.channels) { return; }
    let c = i % p.channels;
    let row = i / p.channels;
    let t = row % p.len;
    var s = 0.0;
    for (var k = 0u; k < p.taps; k++) {
        let lead = p.taps - 1u - k;
        if (t + lead < p.len) { s += w[c * p.taps + k] * dy[i + lead * p.channels]; }
    }
    dx[row * p.dx_stride + p.dx_col + c] = s;
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
        let g = dy[row * p.channels + c];
        if (row % p.len >= lag) { s += g * x_at(row - lag, c); }
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
    if (t >= 0) { v = x_at(b * p.len + u32(t), c); }
    conv_state[i] = v;
}

// One decoding step for x [B, ·] (len = 1): y = Σ_k w[c, k] · window[k] + bias (SiLU of it with SILU) with the
// window = conv_state then x, stored in PARTS tensors as the walks do; the state then shifts by one (each thread
// owns one (b, c) column).
@compute @workgroup_size(256)
fn conv1d_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.batch * p.channels) { return; }
    let c = i % p.channels;
    let b = i / p.channels;
    let keep = p.taps - 1u;
    let base = b * keep * p.channels + c;
    let xv = x_at(b, c);
    var s = bias[c] + w[c * p.taps + keep] * xv;
    for (var k = 0u; k < keep; k++) {
        s += w[c * p.taps + k] * conv_state[base + k * p.channels];
        if (k + 1u < keep) {
            conv_state[base + k * p.channels] = conv_state[base + (k + 1u) * p.channels];
        } else {
            conv_state[base + k * p.channels] = xv;
        }
    }
    if (SILU) { s = s * sigmoid_of(s); }
    store_part(b, c, s);
}

// --- Walks over time, K ≤ 4 (every adapter) -----------------------------------------------------------------------
// One invocation per (time segment of seg_len steps, batch row, channel) walks its segment with the last four
// inputs (or upcoming output gradients) in a vec4 window and its taps in a vec4 register: each input and each
// output gradient is loaded once (the per-output kernels above load K of each), and the backward also sums the
// weight and bias gradients of its column over the segment (dw_part [S·B, C·K], db_part [S·B, C] for S segments,
// summed by ops.reduce.column_sums). A segment first walks the K − 1 steps before it (forward) or after it
// (backward) only to fill its window. On GPUs short segments give enough threads (B·C·S) to cover memory latency;
// on Mesa lavapipe, where every storage access is a loop over the SIMD lanes, one segment spans the sequence (or
// as much of it as llvmpipe's loop budget allows). Taps are right-aligned in the vec4: tap k at component
// k + 4 − K (the rest 0). Grid grid_1d(S·B·C, 64): invocation (s·B + b)·C + c.

// Component j of the window holds the input at lag 3 − j; tap k multiplies lag K − 1 − k.
fn taps4(c: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < p.taps; k++) { v[k + 4u - p.taps] = w[c * p.taps + k]; }
    return v;
}

fn segments() -> u32 { return (p.len + p.seg_len - 1u) / p.seg_len; }

// The walks issue the loads of four steps before using them: with a store between steps the compiler keeps each
// step's load behind the previous store, and one load in flight per thread left the GPU latency-bound.

fn x_or0(row0: u32, t: u32, end: u32, c: u32) -> f32 {
    if (t < end) { return x_walk(row0 + t, c); }
    return 0.0;
}

// Shift x into the window and store step t's output (SiLU(conv) with SILU) if t is one of this segment's.
fn forward_step(win: ptr<function, vec4<f32>>, xv: f32, t: u32, lo: u32, end: u32, row0: u32, c: u32,
                tw: vec4<f32>, bc: f32) {
    *win = vec4<f32>((*win).yzw, xv);
    if (t >= lo && t < end) {
        var v = dot(tw, *win) + bc;
        if (SILU) { v = v * sigmoid_of(v); }
        store_part(row0 + t, c, v);
    }
}

@compute @workgroup_size(64)
fn conv1d_forward_walk(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= segments() * p.batch * p.channels) { return; }
    let c = i % p.channels;
    let b = (i / p.channels) % p.batch;
    let lo = (i / (p.channels * p.batch)) * p.seg_len;
    let end = min(p.len, lo + p.seg_len);
    let tw = taps4(c);
    let bc = bias[c];
    let row0 = b * p.len;
    var win = vec4<f32>(0.0);  // x[t − 3], x[t − 2], x[t − 1], x[t] (0 before t = 0 and before the warm-up)
    for (var t = lo - min(lo, p.taps - 1u); t < end; t += 4u) {
        let x0 = x_or0(row0, t, end, c);
        let x1 = x_or0(row0, t + 1u, end, c);
        let x2 = x_or0(row0, t + 2u, end, c);
        let x3 = x_or0(row0, t + 3u, end, c);
        forward_step(&win, x0, t, lo, end, row0, c, tw, bc);
        forward_step(&win, x1, t + 1u, lo, end, row0, c, tw, bc);
        forward_step(&win, x2, t + 2u, lo, end, row0, c, tw, bc);
        forward_step(&win, x3, t + 3u, lo, end, row0, c, tw, bc);
    }
}

// Backward operands of step t (i32: the last block of four may run below lo, where they are 0 and unused):
// x (t − 3), the output gradient and, with TWO_GRADS, the other consumer's.
struct BackIn { oldest: f32, g: f32, g2: f32 }

fn back_in(row0: u32, t: i32, lo: u32, c: u32) -> BackIn {
    var o = BackIn(0.0, 0.0, 0.0);
    if (t < i32(lo)) { return o; }
    let row = row0 + u32(t);
    if (t >= 3) { o.oldest = x_walk(row - 3u, c); }
    o.g = load_part(row, c);
    if (TWO_GRADS) {
        let e = row * p.channels + c;
        if (TEXTURED) { o.g2 = texture_elem(dy_other_tex, e); } else { o.g2 = dy_other[e]; }
    }
    return o;
}

struct BackState { past: vec4<f32>, ahead: vec4<f32>, dw4: vec4<f32>, db: f32 }

fn backward_step(st: ptr<function, BackState>, o: BackIn, t: i32, lo: u32, end: u32, row0: u32, c: u32,
                 tw: vec4<f32>, back: vec4<f32>, bc: f32) {
    if (t < i32(lo)) { return; }
    (*st).past = vec4<f32>(o.oldest, (*st).past.xyz);
    var g = o.g;
    if (SILU) {  // as add_forward then silu_backward (1 − σ(v) as σ(−v)) on the recomputed conv output v
        let v = dot(tw, (*st).past) + bc;
        if (TWO_GRADS) { g += o.g2; }
        g = g * sigmoid_of(v) * (1.0 + v * sigmoid_of(-v));
    }
    (*st).ahead = vec4<f32>(g, (*st).ahead.xyz);
    if (u32(t) < end) {
        dx[(row0 + u32(t)) * p.dx_stride + p.dx_col + c] = dot(back, (*st).ahead);
        (*st).dw4 += g * (*st).past;
        (*st).db += g;
    }
}

@compute @workgroup_size(64)
fn conv1d_backward_walk(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= segments() * p.batch * p.channels) { return; }
    let c = i % p.channels;
    let b = (i / p.channels) % p.batch;
    let part = i / p.channels;  // s·B + b: this invocation's row of dw_part and db_part
    let lo = (part / p.batch) * p.seg_len;
    let end = min(p.len, lo + p.seg_len);
    let hi = min(p.len, end + p.taps - 1u);  // steps in [end, hi) only fill the window of upcoming gradients
    let tw = taps4(c);
    let back = vec4<f32>(tw.w, tw.z, tw.y, tw.x);  // dx[t] = Σ_j tap(K − 1 − j) · dy[t + j]
    let bc = bias[c];
    let row0 = b * p.len;
    // past: x[t − 3], x[t − 2], x[t − 1], x[t] (0 before t = 0); ahead: dy[t], dy[t + 1], ... (0 past the end)
    var st = BackState(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), 0.0);
    for (var j = 0u; j < 3u; j++) {  // x[hi − 3], x[hi − 2], x[hi − 1], _: one shift before the window at t = hi − 1
        let t = i32(hi) - 3 + i32(j);
        if (t >= 0) { st.past[j] = x_walk(row0 + u32(t), c); }
    }
    for (var t = i32(hi) - 1; t >= i32(lo); t -= 4) {
        let o0 = back_in(row0, t, lo, c);
        let o1 = back_in(row0, t - 1, lo, c);
        let o2 = back_in(row0, t - 2, lo, c);
        let o3 = back_in(row0, t - 3, lo, c);
        backward_step(&st, o0, t, lo, end, row0, c, tw, back, bc);
        backward_step(&st, o1, t - 1, lo, end, row0, c, tw, back, bc);
        backward_step(&st, o2, t - 2, lo, end, row0, c, tw, back, bc);
        backward_step(&st, o3, t - 3, lo, end, row0, c, tw, back, bc);
    }
    for (var k = 0u; k < p.taps; k++) { dw_part[(part * p.channels + c) * p.taps + k] = st.dw4[k + 4u - p.taps]; }
    db_part[part * p.channels + c] = st.db;
}
