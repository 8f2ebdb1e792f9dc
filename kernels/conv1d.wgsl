// Causal depthwise conv over the sequence with PyTorch's taps: x, y [B, L, C] (time-major rows),
// w [C, K] (a [C, 1, K] weight), bias [C]; y[b, t, c] = Σ_k w[c, k] · x[b, t − K + 1 + k, c] + bias[c].

override ACCUMULATE: bool = false;

struct Params { batch: u32, len: u32, channels: u32, taps: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read> dy: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;
@group(0) @binding(6) var<storage, read_write> dx: array<f32>;
@group(0) @binding(7) var<storage, read_write> dw: array<f32>;
@group(0) @binding(8) var<storage, read_write> db: array<f32>;

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

// dw[c, k] (+)= Σ_{b,t} dy[b, t, c] · x[b, t − K + 1 + k, c]; the k = 0 thread also does db[c].
// One thread per (c, k): x.y picks the tap, threads along c read consecutive addresses.
@compute @workgroup_size(64)
fn conv1d_backward_weight(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let k = gid.y;
    if (c >= p.channels || k >= p.taps) { return; }
    let lag = p.taps - 1u - k;
    var s = 0.0;
    var sb = 0.0;
    for (var b = 0u; b < p.batch; b++) {
        for (var t = 0u; t < p.len; t++) {
            let i = (b * p.len + t) * p.channels + c;
            let g = dy[i];
            if (t >= lag) { s += g * x[i - lag * p.channels]; }
            sb += g;
        }
    }
    if (ACCUMULATE) { s += dw[c * p.taps + k]; sb += db[c]; }
    dw[c * p.taps + k] = s;
    if (k == 0u) { db[c] = sb; }
}
