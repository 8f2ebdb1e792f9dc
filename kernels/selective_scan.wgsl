// Mamba-1 selective scan (S6), fused like mamba_ssm's selective_scan_fn with delta_softplus, and its exact
// backward. u, delta, z, y [B, L, Dc] (time-major rows); A_log [Dc, N]; B, C [B, L, N]; D, delta_bias [Dc]:
//   Δ = softplus(delta + delta_bias), A = −exp(A_log), h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t,
//   y_t = (C_t·h_t + D u_t) · silu(z_t).
//
// Threads: one per (batch b, channel d, state n). A workgroup of WG threads owns one batch row and CH channels
// (thread = c·N + n; CH is a power of two ≤ WG / N, so it divides WG) and walks time in order, so h is a
// register carried from step to step and no workgroup of a dispatch depends on another.
// Time goes in tiles of T steps: per-(step, channel) inputs are staged in workgroup memory once per tile, and
// the sums across threads (over n for y, du, ddelta; over the workgroup's channels for dB, dC) run once per
// tile, so a tile costs a few barriers rather than a few per step.
// Memory: the forward saves only the state entering each chunk of `chunk` steps, states [B, n_chunks, Dc, N].
// The backward walks the chunks last to first: it recomputes the tile entry states of a chunk into
// tile_states (per workgroup, chunk / T states per thread), then for each tile, last to first, the tile's
// states in workgroup memory, and runs the adjoint g_t = ∂loss/∂h_t = C_t dy'_t + exp(Δ_{t+1} A) g_{t+1}
// backwards (dy' = dy·silu(z)). Sums over channels go out as per-workgroup partials (dB_part, dC_part) and
// sums over batch as per-batch-row partials (param_part); second dispatches add them in a fixed order,
// so results are deterministic and there are no atomics.
// The Python wrapper (mambactl/ops/selective_scan.py) mirrors WG, T and CH_MAX.

const WG: u32 = 128u;
const T: u32 = 8u;
const CH_MAX: u32 = 32u;  // channels per workgroup at most (reached only for N ≤ 4)

override ACCUMULATE: bool = false;

// ch: channels per workgroup (CH); chunk: steps between saved states (a multiple of T).
struct ScanParams { batch: u32, len: u32, channels: u32, nstate: u32, ch: u32, chunk: u32, nchunks: u32 }
// Sums over `slices` consecutive blocks of `count` elements.
struct SumParams { count: u32, slices: u32 }
struct ParamSumParams { count: u32, batch: u32, nstate: u32 }

@group(0) @binding(0) var<uniform> p: ScanParams;
@group(0) @binding(1) var<storage, read> u: array<f32>;
@group(0) @binding(2) var<storage, read> delta: array<f32>;
@group(0) @binding(3) var<storage, read> A_log: array<f32>;
@group(0) @binding(4) var<storage, read> B: array<f32>;
@group(0) @binding(5) var<storage, read> C: array<f32>;
@group(0) @binding(6) var<storage, read> D: array<f32>;
@group(0) @binding(7) var<storage, read> z: array<f32>;
@group(0) @binding(8) var<storage, read> delta_bias: array<f32>;
@group(0) @binding(9) var<storage, read> dy: array<f32>;
@group(0) @binding(10) var<storage, read> saved_states: array<f32>;  // [B, n_chunks, Dc, N]
@group(0) @binding(11) var<storage, read_write> y: array<f32>;
@group(0) @binding(12) var<storage, read_write> states: array<f32>;  // [B, n_chunks, Dc, N]
@group(0) @binding(13) var<storage, read_write> du: array<f32>;
@group(0) @binding(14) var<storage, read_write> ddelta: array<f32>;
@group(0) @binding(15) var<storage, read_write> dz: array<f32>;
@group(0) @binding(16) var<storage, read_write> dB_part: array<f32>;  // [Dc / CH, B, L, N]
@group(0) @binding(17) var<storage, read_write> dC_part: array<f32>;  // [Dc / CH, B, L, N]
// [B, Dc, N + 2]: per batch row, ∂loss/∂A_log[d, :], then ∂loss/∂D[d], then ∂loss/∂delta_bias[d]
@group(0) @binding(18) var<storage, read_write> param_part: array<f32>;
@group(0) @binding(19) var<storage, read_write> tile_states: array<f32>;  // [B, Dc / CH, chunk / T, WG]
@group(0) @binding(20) var<uniform> q: SumParams;
@group(0) @binding(21) var<storage, read> part: array<f32>;
@group(0) @binding(22) var<storage, read_write> total: array<f32>;
@group(0) @binding(23) var<uniform> r: ParamSumParams;
@group(0) @binding(24) var<storage, read_write> dA_log: array<f32>;
@group(0) @binding(25) var<storage, read_write> dD: array<f32>;
@group(0) @binding(26) var<storage, read_write> ddelta_bias: array<f32>;

// Per (step of the tile, channel of the workgroup), index s·CH_MAX + c.
var<workgroup> dt_tile: array<f32, 256>;        // Δ_t
var<workgroup> u_tile: array<f32, 256>;         // u_t
var<workgroup> dyg_tile: array<f32, 256>;       // dy'_t = dy_t·silu(z_t): the gradient reaching y before the gate
var<workgroup> dzg_tile: array<f32, 256>;       // dy_t·silu'(z_t): dz_t is this times the ungated y_t
var<workgroup> dsoftplus_tile: array<f32, 256>; // ∂Δ_t/∂delta_t
// Per (step of the tile, thread), index s·WG + thread. state_terms holds C_t·h_t in the forward; in the
// backward first h_t, then (the adjoint pass overwrites step t once it is past it) g_t·exp(Δ_t A)·h_{t−1}·A.
var<workgroup> state_terms: array<f32, 1024>;
var<workgroup> adjoint: array<f32, 1024>;       // g_t

fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }

// PyTorch's softplus (threshold 20). log(1 + e)·e / ((1 + e) − 1) is log1p(e) to f32 precision even when
// 1 + e rounds (WGSL has no log1p); when it rounds to 1, log1p(e) = e.
fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    let e = exp(x);
    let one_plus = 1.0 + e;
    if (one_plus == 1.0) { return e; }
    return log(one_plus) * e / (one_plus - 1.0);
}

// Stage Δ and u for steps [t0, t0 + steps) of the workgroup's channels (index s·CH_MAX + c). Channels past
// Dc are left alone: no thread reads them.
fn load_inputs(b: u32, d0: u32, t0: u32, steps: u32, thread: u32) {
    for (var i = thread; i < steps * p.ch; i += WG) {
        let s = i / p.ch;
        let c = i % p.ch;
        if (d0 + c < p.channels) {
            let row = (b * p.len + t0 + s) * p.channels + d0 + c;
            dt_tile[s * CH_MAX + c] = softplus(delta[row] + delta_bias[d0 + c]);
            u_tile[s * CH_MAX + c] = u[row];
        }
    }
}

// Stage the backward's per-(step, channel) factors: the gate's and softplus's derivatives.
fn load_grad_inputs(b: u32, d0: u32, t0: u32, steps: u32, thread: u32) {
    for (var i = thread; i < steps * p.ch; i += WG) {
        let s = i / p.ch;
        let c = i % p.ch;
        if (d0 + c < p.channels) {
            let row = (b * p.len + t0 + s) * p.channels + d0 + c;
            let k = s * CH_MAX + c;
            let zv = z[row];
            let gate = sigmoid(zv);
            dyg_tile[k] = dy[row] * zv * gate;
            dzg_tile[k] = dy[row] * gate * (1.0 + zv * (1.0 - gate));
            let x = delta[row] + delta_bias[d0 + c];
            dsoftplus_tile[k] = select(sigmoid(x), 1.0, x > 20.0);
        }
    }
}

// Grid (Dc / CH, B).
@compute @workgroup_size(128)
fn selective_scan_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let d0 = wid.x * p.ch;
    let thread = lid.x;
    let c = thread / p.nstate;
    let n = thread % p.nstate;
    let d = d0 + c;
    let owns_state = c < p.ch && d < p.channels;
    var a = 0.0;
    if (owns_state) { a = -exp(A_log[d * p.nstate + n]); }
    var h = 0.0;
    for (var t0 = 0u; t0 < p.len; t0 += T) {
        if (owns_state && t0 % p.chunk == 0u) {
            states[((b * p.nchunks + t0 / p.chunk) * p.channels + d) * p.nstate + n] = h;
        }
        let steps = min(T, p.len - t0);
        load_inputs(b, d0, t0, steps, thread);
        workgroupBarrier();
        if (owns_state) {
            for (var s = 0u; s < steps; s++) {
                let bn = (b * p.len + t0 + s) * p.nstate + n;
                let dt = dt_tile[s * CH_MAX + c];
                h = exp(dt * a) * h + dt * u_tile[s * CH_MAX + c] * B[bn];
                state_terms[s * WG + thread] = C[bn] * h;
            }
        }
        workgroupBarrier();
        for (var i = thread; i < steps * p.ch; i += WG) {
            let s = i / p.ch;
            let cc = i % p.ch;
            if (d0 + cc < p.channels) {
                var acc = 0.0;
                for (var k = 0u; k < p.nstate; k++) { acc += state_terms[s * WG + cc * p.nstate + k]; }
                acc += D[d0 + cc] * u_tile[s * CH_MAX + cc];
                let row = (b * p.len + t0 + s) * p.channels + d0 + cc;
                let zv = z[row];
                y[row] = acc * zv * sigmoid(zv);
            }
        }
        workgroupBarrier();  // the next tile overwrites the staged inputs
    }
}

// Grid (Dc / CH, B), as the forward.
@compute @workgroup_size(128)
fn selective_scan_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let d0 = wid.x * p.ch;
    let thread = lid.x;
    let c = thread / p.nstate;
    let n = thread % p.nstate;
    let d = d0 + c;
    let owns_state = c < p.ch && d < p.channels;
    var a = 0.0;
    if (owns_state) { a = -exp(A_log[d * p.nstate + n]); }
    let tiles_per_chunk = p.chunk / T;
    let scratch = (b * nwg.x + wid.x) * tiles_per_chunk * WG + thread;
    let part_row = wid.x * p.batch + b;  // this workgroup's slice of dB_part / dC_part
    var g = 0.0;           // g_t = ∂loss/∂h_t, carried backwards over tiles and chunks
    var da = 0.0;          // Σ_t g_t exp(Δ_t A) h_{t−1} Δ_t = ∂loss/∂A[d, n] for this batch row
    var d_skip = 0.0;      // Σ dy'·u over this thread's (step, channel) items: ∂loss/∂D
    var d_bias = 0.0;      // Σ ddelta over the same items: ∂loss/∂delta_bias
    for (var k = p.nchunks; k > 0u; k--) {
        let chunk_start = (k - 1u) * p.chunk;
        let ntiles = (min(p.chunk, p.len - chunk_start) + T - 1u) / T;
        // Entry state of every tile of the chunk, recomputed from the chunk's saved entry state.
        var h = 0.0;
        if (owns_state) { h = saved_states[((b * p.nchunks + k - 1u) * p.channels + d) * p.nstate + n]; }
        for (var j = 0u; j < ntiles; j++) {
            let t0 = chunk_start + j * T;
            let steps = min(T, p.len - t0);
            if (owns_state) { tile_states[scratch + j * WG] = h; }
            load_inputs(b, d0, t0, steps, thread);
            workgroupBarrier();
            if (owns_state) {
                for (var s = 0u; s < steps; s++) {
                    let dt = dt_tile[s * CH_MAX + c];
                    h = exp(dt * a) * h + dt * u_tile[s * CH_MAX + c] * B[(b * p.len + t0 + s) * p.nstate + n];
                }
            }
            workgroupBarrier();
        }
        for (var j = ntiles; j > 0u; j--) {
            let t0 = chunk_start + (j - 1u) * T;
            let steps = min(T, p.len - t0);
            var h_entry = 0.0;
            if (owns_state) { h_entry = tile_states[scratch + (j - 1u) * WG]; }
            load_inputs(b, d0, t0, steps, thread);
            load_grad_inputs(b, d0, t0, steps, thread);
            workgroupBarrier();
            if (owns_state) {
                var ht = h_entry;
                for (var s = 0u; s < steps; s++) {
                    let dt = dt_tile[s * CH_MAX + c];
                    ht = exp(dt * a) * ht + dt * u_tile[s * CH_MAX + c] * B[(b * p.len + t0 + s) * p.nstate + n];
                    state_terms[s * WG + thread] = ht;
                }
            }
            workgroupBarrier();
            // From h_t: dz (needs the ungated y_t) per (step, channel) and dC per (step, state).
            for (var i = thread; i < steps * p.ch; i += WG) {
                let s = i / p.ch;
                let cc = i % p.ch;
                if (d0 + cc < p.channels) {
                    let bn = (b * p.len + t0 + s) * p.nstate;
                    var acc = 0.0;
                    for (var m = 0u; m < p.nstate; m++) { acc += C[bn + m] * state_terms[s * WG + cc * p.nstate + m]; }
                    acc += D[d0 + cc] * u_tile[s * CH_MAX + cc];
                    dz[(b * p.len + t0 + s) * p.channels + d0 + cc] = acc * dzg_tile[s * CH_MAX + cc];
                }
            }
            for (var i = thread; i < steps * p.nstate; i += WG) {
                let s = i / p.nstate;
                let m = i % p.nstate;
                var acc = 0.0;
                for (var cc = 0u; cc < p.ch && d0 + cc < p.channels; cc++) {
                    acc += state_terms[s * WG + cc * p.nstate + m] * dyg_tile[s * CH_MAX + cc];
                }
                dC_part[(part_row * p.len + t0 + s) * p.nstate + m] = acc;
            }
            workgroupBarrier();
            // The adjoint, last step to first. Step s reads h_{s−1} before step s − 1 overwrites its slot.
            if (owns_state) {
                for (var s = steps; s > 0u; s--) {
                    let si = s - 1u;
                    let k_in = si * CH_MAX + c;
                    g += dyg_tile[k_in] * C[(b * p.len + t0 + si) * p.nstate + n];
                    let dt = dt_tile[k_in];
                    let decay = exp(dt * a);
                    var h_prev = h_entry;
                    if (si > 0u) { h_prev = state_terms[(si - 1u) * WG + thread]; }
                    let gh = g * decay * h_prev;  // ∂loss/∂(Δ_t A)
                    da += gh * dt;
                    state_terms[si * WG + thread] = gh * a;
                    adjoint[si * WG + thread] = g;
                    g *= decay;
                }
            }
            workgroupBarrier();
            // du, ddelta per (step, channel); dB per (step, state).
            for (var i = thread; i < steps * p.ch; i += WG) {
                let s = i / p.ch;
                let cc = i % p.ch;
                if (d0 + cc < p.channels) {
                    let bn = (b * p.len + t0 + s) * p.nstate;
                    var gb = 0.0;   // Σ_n g_t[n] B_t[n] = ∂loss/∂(Δ_t u_t)
                    var gha = 0.0;  // Σ_n g_t[n] exp(Δ_t A[n]) h_{t−1}[n] A[n]
                    for (var m = 0u; m < p.nstate; m++) {
                        gb += adjoint[s * WG + cc * p.nstate + m] * B[bn + m];
                        gha += state_terms[s * WG + cc * p.nstate + m];
                    }
                    let k_in = s * CH_MAX + cc;
                    let row = (b * p.len + t0 + s) * p.channels + d0 + cc;
                    du[row] = D[d0 + cc] * dyg_tile[k_in] + dt_tile[k_in] * gb;
                    let dx = (gha + u_tile[k_in] * gb) * dsoftplus_tile[k_in];
                    ddelta[row] = dx;
                    d_skip += dyg_tile[k_in] * u_tile[k_in];
                    d_bias += dx;
                }
            }
            for (var i = thread; i < steps * p.nstate; i += WG) {
                let s = i / p.nstate;
                let m = i % p.nstate;
                var acc = 0.0;
                for (var cc = 0u; cc < p.ch && d0 + cc < p.channels; cc++) {
                    let k_in = s * CH_MAX + cc;
                    acc += adjoint[s * WG + cc * p.nstate + m] * dt_tile[k_in] * u_tile[k_in];
                }
                dB_part[(part_row * p.len + t0 + s) * p.nstate + m] = acc;
            }
            workgroupBarrier();  // the next tile overwrites the staged inputs and terms
        }
    }
    let stride = p.nstate + 2u;
    if (owns_state) { param_part[(b * p.channels + d) * stride + n] = da * a; }  // ∂/∂A_log = ∂/∂A · A
    // Thread i summed the (step, channel) items of channel i % CH (CH divides WG): add the WG / CH partials
    // of each channel in workgroup memory.
    state_terms[thread] = d_skip;
    adjoint[thread] = d_bias;
    workgroupBarrier();
    if (thread < p.ch && d0 + thread < p.channels) {
        var skip = 0.0;
        var bias = 0.0;
        for (var i = thread; i < WG; i += p.ch) { skip += state_terms[i]; bias += adjoint[i]; }
        let base = (b * p.channels + d0 + thread) * stride + p.nstate;
        param_part[base] = skip;
        param_part[base + 1u] = bias;
    }
}

// total[i] = Σ_k part[k·count + i], k in order (dB, dC from the per-workgroup partials). Grid grid_1d(count).
@compute @workgroup_size(256)
fn selective_scan_sum_slices(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= q.count) { return; }
    var acc = 0.0;
    for (var k = 0u; k < q.slices; k++) { acc += part[k * q.count + i]; }
    total[i] = acc;
}

// Sum param_part over the batch (r.batch rows of r.count = Dc·(N + 2)) and split it into dA_log [Dc, N],
// dD [Dc] and ddelta_bias [Dc]; ACCUMULATE adds into them. Grid grid_1d(count).
@compute @workgroup_size(256)
fn selective_scan_param_grads(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= r.count) { return; }
    var acc = 0.0;
    for (var k = 0u; k < r.batch; k++) { acc += part[k * r.count + i]; }
    let stride = r.nstate + 2u;
    let d = i / stride;
    let j = i % stride;
    if (j < r.nstate) {
        if (ACCUMULATE) { acc += dA_log[d * r.nstate + j]; }
        dA_log[d * r.nstate + j] = acc;
    } else if (j == r.nstate) {
        if (ACCUMULATE) { acc += dD[d]; }
        dD[d] = acc;
    } else {
        if (ACCUMULATE) { acc += ddelta_bias[d]; }
        ddelta_bias[d] = acc;
    }
}
