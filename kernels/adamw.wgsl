//! include texture
// AdamW with global-norm clipping, a trust region and a NaN/Inf guard, entirely on the GPU.
// Per step: optimizer_begin_step (one thread) reads the squared global gradient norm and decides, on the
// GPU, whether the step happens and with which clip scale; then one adamw_update (adamw_update_vec4 where the
// length is a multiple of 4) per span of parameters (ops/adamw.py: a run of Arena views, else one tensor).
// The host never has to read anything back, so a training step needs no round trip.
// Exact CPU mirror: mambactl/reference/adamw.py.

// The optimizer's GPU-side counters and per-step values (mambactl/ops/adamw.py mirrors this layout).
struct OptState {
    t: u32,            // updates applied; the bias corrections use it, so skipped steps don't advance it
    skipped: u32,      // steps skipped because the global gradient norm was not finite
    bad: atomic<u32>,  // elements the per-element guard left unchanged, over all steps (integer: order-free)
    skip_now: u32,     // 1 while the current step is skipped: every adamw_update then writes nothing
    scale: f32,        // the current step's clip scale, min(1, max_norm / norm)
    bc1: f32,          // 1 - beta1^t
    bc2: f32,          // 1 - beta2^t
    grad_norm: f32,    // the latest step's global gradient norm (NaN or Inf when that step was skipped)
}

struct BeginParams { one_minus_beta1: f32, one_minus_beta2: f32, max_norm: f32, guard_norm: u32 }

// keep = 1 - lr·wd, formed on the host in float64 (0 decay for no-decay parameters gives keep = 1 exactly).
struct UpdateParams {
    n: u32, lr: f32, beta1: f32, beta2: f32, one_minus_beta1: f32, one_minus_beta2: f32,
    eps: f32, keep: f32, max_delta: f32,
}

@group(0) @binding(0) var<uniform> bp: BeginParams;
@group(0) @binding(1) var<storage, read> norm_sq: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: OptState;
@group(0) @binding(3) var<uniform> up: UpdateParams;
@group(0) @binding(4) var<storage, read_write> param: array<f32>;
@group(0) @binding(5) var<storage, read> grad: array<f32>;
@group(0) @binding(6) var<storage, read_write> m: array<f32>;
@group(0) @binding(7) var<storage, read_write> v: array<f32>;

// Bit tests, because compilers may fold `x != x` away under fast-math assumptions.
fn is_finite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

@compute @workgroup_size(1)
fn optimizer_begin_step() {
    let nsq = norm_sq[0];
    let finite = is_finite(nsq);
    let norm = sqrt(nsq);
    state.grad_norm = norm;
    if (!finite && bp.guard_norm != 0u) {
        state.skipped += 1u;
        state.skip_now = 1u;
        return;
    }
    state.skip_now = 0u;
    state.t += 1u;
    // 1 - beta^t by the recurrence q' = q + (1 - beta)·(1 - q): both terms are non-negative, so it keeps
    // q's relative error at a few ulp even at small t, where pow(beta, t) in float32 would lose ~1e-4 of
    // 1 - 0.999^t to cancellation (and pow on GPUs is exp2(t·log2 beta) with loose error bounds).
    state.bc1 = state.bc1 + bp.one_minus_beta1 * (1.0 - state.bc1);
    state.bc2 = state.bc2 + bp.one_minus_beta2 * (1.0 - state.bc2);
    // Without the norm guard a non-finite norm can't give a meaningful scale: that step goes unclipped
    // and the per-element guard alone protects the weights.
    var scale = 1.0;
    if (bp.max_norm > 0.0 && finite && norm > bp.max_norm) { scale = bp.max_norm / norm; }
    state.scale = scale;
}

// The step's values of `state`, read once at the top of an entry point: on lavapipe a load under control flow (past
// the early return, in the element loop) is a loop over the SIMD lanes, one at the top a single load.
struct StepValues { scale: f32, bc1: f32, bc2: f32, skip: bool }
fn step_values() -> StepValues { return StepValues(state.scale, state.bc1, state.bc2, state.skip_now != 0u); }

// One element's update: (param, m, v) from (param, grad, m, v) as the mirror does, and whether it is applied.
struct Updated { param: f32, m: f32, v: f32, ok: bool }

fn update_element(p0: f32, g0: f32, m0: f32, v0: f32, sv: StepValues) -> Updated {
    let g = g0 * sv.scale;
    let m1 = up.beta1 * m0 + up.one_minus_beta1 * g;
    let v1 = up.beta2 * v0 + up.one_minus_beta2 * g * g;
    var step = up.lr * (m1 / sv.bc1) / (sqrt(v1 / sv.bc2) + up.eps);
    // A NaN must stay NaN through the trust region (min/max may drop it); an infinite step clamps to
    // ±max_delta, as in the mirror.
    if (up.max_delta > 0.0 && !is_nan(step)) { step = clamp(step, -up.max_delta, up.max_delta); }
    // Inputs are tested too: arithmetic on NaN/Inf is indeterminate in WGSL, so a result alone can't prove it.
    // The old engine updated the moments anyway, which froze the weight forever after one bad gradient.
    let ok = is_finite(g0) && is_finite(m0) && is_finite(v0) && is_finite(g) && is_finite(m1) && is_finite(v1)
        && is_finite(step);
    return Updated(p0 * up.keep - step, m1, v1, ok);
}

// In place over one parameter tensor: param, m, v [n] updated from grad [n].
@compute @workgroup_size(256)
fn adamw_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let sv = step_values();
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= up.n || sv.skip) { return; }
    let u = update_element(param[i], grad[i], m[i], v[i], sv);
    if (!u.ok) {
        atomicAdd(&state.bad, 1u);
        return;
    }
    param[i] = u.param;
    m[i] = u.m;
    v[i] = u.v;
}

// The same over n = 4·(threads) elements as vec4 loads and stores (ops/adamw.py takes it where n % 4 == 0, as for
// every span of an Arena): a quarter of the threads and of the per-step state loads.
@group(0) @binding(8) var<storage, read_write> param4: array<vec4<f32>>;
@group(0) @binding(9) var<storage, read> grad4: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read_write> m4: array<vec4<f32>>;
@group(0) @binding(11) var<storage, read_write> v4: array<vec4<f32>>;

// CPU adapters (TEXTURED) read the four through textures (texture.wgsl): each element is read and then written by
// the same invocation only, so the copies made before the dispatch hold what the buffers held.
override TEXTURED: bool = false;
@group(0) @binding(12) var param_tex: texture_2d<f32>;
@group(0) @binding(13) var grad_tex: texture_2d<f32>;
@group(0) @binding(14) var m_tex: texture_2d<f32>;
@group(0) @binding(15) var v_tex: texture_2d<f32>;

@compute @workgroup_size(256)
fn adamw_update_vec4(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let sv = step_values();
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i * 4u >= up.n || sv.skip) { return; }
    var p: vec4<f32>;
    var g: vec4<f32>;
    var mv: vec4<f32>;
    var vv: vec4<f32>;
    if (TEXTURED) {
        p = texel(param_tex, i);
        g = texel(grad_tex, i);
        mv = texel(m_tex, i);
        vv = texel(v_tex, i);
    } else {
        p = param4[i];
        g = grad4[i];
        mv = m4[i];
        vv = v4[i];
    }
    var bad = 0u;
    for (var k = 0u; k < 4u; k++) {
        let u = update_element(p[k], g[k], mv[k], vv[k], sv);
        if (u.ok) {
            p[k] = u.param;
            mv[k] = u.m;
            vv[k] = u.v;
        } else {
            bad += 1u;
        }
    }
    if (bad != 0u) { atomicAdd(&state.bad, bad); }
    param4[i] = p;
    m4[i] = mv;
    v4[i] = vv;
}
