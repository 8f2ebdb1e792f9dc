// Element-wise functions and their backward. One thread per element over a 2-D grid
// (index = y * groups_x * 256 + x) so tensors larger than 65535 workgroups still fit.
// softplus follows PyTorch: x above threshold 20, else log1p(exp(x)).

struct Params { n: u32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> other: array<f32>;
@group(0) @binding(3) var<storage, read> dy: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> dx: array<f32>;
@group(0) @binding(6) var<storage, read_write> d_other: array<f32>;

fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 { return gid.y * nwg.x * 256u + gid.x; }

fn sigmoid_of(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }

// log(1 + e) for e >= 0. WGSL only promises log an absolute error of 2^-21 on [0.5, 2] (llvmpipe uses that
// freedom), a large relative error when 1 + e is near 1, so below e = 1/4 the series e − e²/2 + … − e¹²/12 is
// summed instead (truncation < 5e-9 relative); above it log(1 + e) >= 0.22 keeps the error below 3e-6.
fn log1p_of(e: f32) -> f32 {
    if (e >= 0.25) { return log(1.0 + e); }
    return e * (1.0 - e * (0.5 - e * (1.0 / 3.0 - e * (0.25 - e * (0.2 - e * (1.0 / 6.0 - e * (1.0 / 7.0 - e * (0.125 - e * (1.0 / 9.0 - e * (0.1 - e * (1.0 / 11.0 - e / 12.0)))))))))));
}

fn softplus_of(v: f32) -> f32 {
    if (v > 20.0) { return v; }
    return log1p_of(exp(v));
}

@compute @workgroup_size(256)
fn silu_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let v = x[i];
    y[i] = v * sigmoid_of(v);
}

@compute @workgroup_size(256)
fn silu_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let v = x[i];
    // 1 − σ(v) is σ(−v), computed directly: subtracting from 1 loses its digits for large v.
    dx[i] = dy[i] * sigmoid_of(v) * (1.0 + v * sigmoid_of(-v));
}

@compute @workgroup_size(256)
fn softplus_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    y[i] = softplus_of(x[i]);
}

@compute @workgroup_size(256)
fn softplus_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let v = x[i];
    var g = 1.0;
    if (v <= 20.0) { g = sigmoid_of(v); }
    dx[i] = dy[i] * g;
}

@compute @workgroup_size(256)
fn sigmoid_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    y[i] = sigmoid_of(x[i]);
}

@compute @workgroup_size(256)
fn sigmoid_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    let v = x[i];
    dx[i] = dy[i] * sigmoid_of(v) * sigmoid_of(-v);  // σ(v)(1 − σ(v)) without the cancellation
}

@compute @workgroup_size(256)
fn exp_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    y[i] = exp(x[i]);
}

@compute @workgroup_size(256)
fn exp_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    dx[i] = dy[i] * exp(x[i]);
}

@compute @workgroup_size(256)
fn add_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    y[i] = x[i] + other[i];
}

@compute @workgroup_size(256)
fn mul_forward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    y[i] = x[i] * other[i];
}

@compute @workgroup_size(256)
fn mul_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = index(gid, nwg);
    if (i >= p.n) { return; }
    dx[i] = dy[i] * other[i];
    d_other[i] = dy[i] * x[i];
}
