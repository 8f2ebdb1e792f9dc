// Set every element to one value, recorded in the command stream (no host write, no flush).

struct Params { n: u32, value: f32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(256)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i < p.n) { dst[i] = p.value; }
}
