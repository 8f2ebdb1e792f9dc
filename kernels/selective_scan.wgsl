// Mamba-1 selective scan (S6), fused like mamba_ssm's selective_scan_fn with delta_softplus, and its exact
// backward. u, delta, z, y [B, L, Dc] (time-major rows); A_log [Dc, N]; B, C [B, L, N]; D, delta_bias [Dc]:
//   Δ = softplus(delta + delta_bias), A = −exp(A_log), h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t,
//   y_t = (C_t·h_t + D u_t) · silu(z_t).
//
// Threads: LP = NP / SPT per (batch b, channel d), NP = N rounded up to a power of two; each holds SPT states
// of the channel (its lane l < LP holds states l, l + LP, …, components of vec4 registers; states ≥ N are
// padding that no sum sees). A workgroup of WG threads owns one batch row and CH channels (thread = c·LP + l,
// so a channel's lanes are an aligned block; CH·LP ≤ WG) and walks time in order, so h is a register carried
// from step to step and no workgroup of a dispatch depends on another.
// Time goes in tiles of T steps: a tile's inputs are loaded by all threads at once (one batch of loads per
// thread, so their latency is paid once per tile) and staged in workgroup memory. The forward sums over n
// either through workgroup memory once per tile (a barrier and a pass over (step, channel) items) or, with
// LANE_SUM, at each step in-thread and by a subgroupShuffleXor butterfly within the channel's LP lanes (LP ≤
// the subgroup's lanes; needs lanes numbered as the threads, as on NVIDIA and lavapipe). The backward sums
// over n and over the workgroup's channels (dB, dC) through workgroup memory once per tile.
// Measured (H200, B 8, L 1024, Dc 1536, N 16, GPU timestamps, bench/scan.py): the forward with SPT = 4 and
// LANE_SUM (T 8) 0.49 ms, with SPT = 1 and workgroup sums 0.68 ms; the backward's dispatches (SPT = 1, T 8;
// with the dB / dC and parameter sums) 2.35 / 2.46 / 2.59 ms at chunk 8 / 16 / 128. Anything that added registers or workgroup memory measured slower there:
// prefetching the next tile into registers, two staging buffers, a third terms array to drop a barrier, lane
// sums or several states per thread in the backward, T = 16, step loops of constant trip count.
// N, NP, SPT, LP, CH, T, PF, LANE_SUM and TERM_STEPS are pipeline constants (the workgroup arrays are sized
// by them); the wrapper keeps workgroup memory within WebGPU's guaranteed 16 KiB.
// Memory: the forward saves only the state entering each chunk of `chunk` steps, states [B, n_chunks, Dc, N].
// The backward walks the chunks last to first: it recomputes the tile entry states of a chunk into
// tile_states (per workgroup, chunk / T states per thread), then for each tile, last to first, the tile's
// states in workgroup memory, and runs the adjoint g_t = ∂loss/∂h_t = C_t dy'_t + exp(Δ_{t+1} A) g_{t+1}
// backwards (dy' = dy·silu(z)). Sums over channels go out as per-workgroup partials (dB_part, dC_part) and
// sums over batch as per-batch-row partials (param_part); second dispatches add them in a fixed order,
// so results are deterministic and there are no atomics.

const WG: u32 = 128u;  // mirrored by the wrapper (mambactl/ops/selective_scan.py)
const CARRY: u32 = 10u;  // carry words per backward thread: g, ∂/∂A (4 each), ∂/∂D, ∂/∂delta_bias

override N: u32 = 16u;   // state size
override NP: u32 = 16u;  // N rounded up to a power of two
override SPT: u32 = 1u;  // states per thread: 1, 2 or 4 (≤ NP)
override LP: u32 = 16u;  // threads per channel, NP / SPT
override CH: u32 = 8u;   // channels per workgroup (CH·LP ≤ WG)
override T: u32 = 8u;    // steps per tile; divides chunk
override PF: u32 = 1u;   // items per thread of a staged tile: ceil(T·max(CH, N) / WG), at most 4
override LANE_SUM: bool = false;  // the forward's sums over n by subgroup butterflies (LP ≤ subgroup lanes)
override TERM_STEPS: u32 = 8u;  // steps of state_terms: T, or 1 where nothing reads it (the LANE_SUM forward)
override ACCUMULATE: bool = false;

// Segments (Mesa llvmpipe caps one invocation's loop iterations at 65,535 in total, so there the wrapper splits
// the walk over time into dispatches; elsewhere one dispatch covers it): the forward runs steps [seg_begin,
// seg_end) (multiples of T), h entering from last_state when seg_begin > 0; the backward runs chunks kc_hi down to
// kc_lo + 1 (1-based), its carried sums entering from carry when kc_hi < nchunks and leaving there when kc_lo > 0.
struct ScanParams { batch: u32, len: u32, channels: u32, chunk: u32, nchunks: u32, seg_begin: u32, seg_end: u32,
                    kc_lo: u32, kc_hi: u32 }
// Sums over `slices` consecutive blocks of `count` elements.
struct SumParams { count: u32, slices: u32 }
struct ParamSumParams { count: u32, batch: u32, nstate: u32 }
struct StepParams { batch: u32, channels: u32, nstate: u32 }

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
@group(0) @binding(19) var<storage, read_write> tile_states: array<f32>;  // [B, Dc / CH, tiles per chunk, SPT, WG]
@group(0) @binding(20) var<uniform> q: SumParams;
@group(0) @binding(21) var<storage, read> part: array<f32>;
@group(0) @binding(22) var<storage, read_write> total: array<f32>;
@group(0) @binding(23) var<uniform> r: ParamSumParams;
@group(0) @binding(24) var<storage, read_write> dA_log: array<f32>;
@group(0) @binding(25) var<storage, read_write> dD: array<f32>;
@group(0) @binding(26) var<storage, read_write> ddelta_bias: array<f32>;
@group(0) @binding(27) var<storage, read_write> last_state: array<f32>;  // [B, Dc, N]: h after the last step
// Decode: one step for a batch of single tokens, u, delta, z, y [B, Dc], B_t, C_t [B, N], state [B, Dc, N].
@group(0) @binding(28) var<uniform> st: StepParams;
@group(0) @binding(29) var<storage, read_write> state: array<f32>;
@group(0) @binding(30) var<storage, read_write> carry: array<f32>;  // [B, Dc / CH, WG, CARRY]: backward segments
// The subgroup kernels' vec4 views (lavapipe moves a vec4 for about the price of two scalar loads or stores:
// ~12 ns per 8-lane scalar load, ~24 per vec4, bench-style micro-kernels): states and saved_states as vec4 where
// N is a multiple of 4 (the wrapper binds the same tensors to both names), and the backward's scratch.
@group(0) @binding(32) var<storage, read_write> states4: array<vec4<f32>>;
@group(0) @binding(33) var<storage, read> saved_states4: array<vec4<f32>>;
@group(0) @binding(34) var<storage, read_write> scratch4: array<vec4<f32>>;

// Per (step of the tile, channel of the workgroup), index s·CH + c.
var<workgroup> dt_tile: array<f32, T * CH>;        // Δ_t
var<workgroup> u_tile: array<f32, T * CH>;         // u_t
var<workgroup> z_tile: array<f32, T * CH>;         // z_t
var<workgroup> dyg_tile: array<f32, T * CH>;       // dy'_t = dy_t·silu(z_t): the gradient reaching y before the gate
var<workgroup> dzg_tile: array<f32, T * CH>;       // dy_t·silu'(z_t): dz_t is this times the ungated y_t
var<workgroup> dsoftplus_tile: array<f32, T * CH>; // ∂Δ_t/∂delta_t
// Per (step of the tile, state), index s·N + n.
var<workgroup> B_tile: array<f32, T * N>;
var<workgroup> C_tile: array<f32, T * N>;
// Per (step of the tile, channel, state), index s·CH·(N + 1) + c·(N + 1) + n: padding each channel's row by
// one word puts the N values of one channel, and the same n of consecutive channels, in distinct banks.
// Without LANE_SUM, state_terms holds C_t·h_t in the forward; in the backward first h_t, then (the adjoint
// pass overwrites step t once it is past it) g_t·exp(Δ_t A)·h_{t−1}·A, and adjoint holds g_t. In the
// backward both hold at least WG words (T ≥ 4 and CH·(N + 1) ≥ WG / 2).
var<workgroup> state_terms: array<f32, TERM_STEPS * CH * (N + 1u)>;
var<workgroup> adjoint: array<f32, T * CH * (N + 1u)>;

fn sigmoid(x: f32) -> f32 { return 1.0 / (1.0 + exp(-x)); }

// log(1 + e) for e >= 0. WGSL only promises log an absolute error of 2^-21 on [0.5, 2] (llvmpipe uses that
// freedom), a large relative error when 1 + e is near 1, so below e = 1/4 the series e − e²/2 + … − e¹²/12 is
// summed instead (truncation < 5e-9 relative); above it log(1 + e) >= 0.22 keeps the error below 3e-6.
fn log1p_of(e: f32) -> f32 {
    if (e >= 0.25) { return log(1.0 + e); }
    return e * (1.0 - e * (0.5 - e * (1.0 / 3.0 - e * (0.25 - e * (0.2 - e * (1.0 / 6.0 - e * (1.0 / 7.0 - e * (0.125 - e * (1.0 / 9.0 - e * (0.1 - e * (1.0 / 11.0 - e / 12.0)))))))))));
}

// PyTorch's softplus (threshold 20).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) { return x; }
    return log1p_of(exp(x));
}

// Row of a [B, L, Dc] tensor.
fn row_index(b: u32, t: u32, d: u32) -> u32 { return (b * p.len + t) * p.channels + d; }

// Σ over the LP lanes of a channel (a butterfly; every lane gets the same sum, bit for bit, as a + b = b + a).
fn lane_sum(v: f32) -> f32 {
    var s = v;
    for (var m = LP / 2u; m > 0u; m >>= 1u) { s += subgroupShuffleXor(s, m); }
    return s;
}

// A thread's states: component j < SPT of its vec4 registers is state l + j·LP of its channel (the other
// components stay 0). Every per-state access below is written out per component (no vector or array indexed
// by a loop counter: those can land in local memory). mask: 1 where that state exists (l + j·LP < N).
fn state_ok(l: u32, j: u32) -> bool { return SPT > j && l + j * LP < N; }
fn state_mask(l: u32) -> vec4<f32> {
    return vec4<f32>(select(0.0, 1.0, state_ok(l, 0u)), select(0.0, 1.0, state_ok(l, 1u)),
                     select(0.0, 1.0, state_ok(l, 2u)), select(0.0, 1.0, state_ok(l, 3u)));
}
fn state_at(l: u32, j: u32) -> u32 { return min(l + j * LP, N - 1u); }
// B_t or C_t of step s (base = s·N) at the thread's states (clamped past N).
fn b_states(base: u32, l: u32) -> vec4<f32> {
    return vec4<f32>(B_tile[base + state_at(l, 0u)], select(0.0, B_tile[base + state_at(l, 1u)], SPT > 1u),
                     select(0.0, B_tile[base + state_at(l, 2u)], SPT > 2u),
                     select(0.0, B_tile[base + state_at(l, 3u)], SPT > 3u));
}
fn c_states(base: u32, l: u32) -> vec4<f32> {
    return vec4<f32>(C_tile[base + state_at(l, 0u)], select(0.0, C_tile[base + state_at(l, 1u)], SPT > 1u),
                     select(0.0, C_tile[base + state_at(l, 2u)], SPT > 2u),
                     select(0.0, C_tile[base + state_at(l, 3u)], SPT > 3u));
}
// The thread's words of a (step, channel) row of state_terms / adjoint (base = s·CH·(N + 1) + c·(N + 1)):
// states past N are neither stored nor loaded (their words belong to the next channel).
fn terms_load(base: u32, l: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (SPT > 0u) { if (state_ok(l, 0u)) { v.x = state_terms[base + l + 0u * LP]; } }
    if (SPT > 1u) { if (state_ok(l, 1u)) { v.y = state_terms[base + l + 1u * LP]; } }
    if (SPT > 2u) { if (state_ok(l, 2u)) { v.z = state_terms[base + l + 2u * LP]; } }
    if (SPT > 3u) { if (state_ok(l, 3u)) { v.w = state_terms[base + l + 3u * LP]; } }
    return v;
}
fn terms_store(base: u32, l: u32, v: vec4<f32>) {
    if (SPT > 0u) { if (state_ok(l, 0u)) { state_terms[base + l + 0u * LP] = v.x; } }
    if (SPT > 1u) { if (state_ok(l, 1u)) { state_terms[base + l + 1u * LP] = v.y; } }
    if (SPT > 2u) { if (state_ok(l, 2u)) { state_terms[base + l + 2u * LP] = v.z; } }
    if (SPT > 3u) { if (state_ok(l, 3u)) { state_terms[base + l + 3u * LP] = v.w; } }
}
fn adjoint_store(base: u32, l: u32, v: vec4<f32>) {
    if (SPT > 0u) { if (state_ok(l, 0u)) { adjoint[base + l + 0u * LP] = v.x; } }
    if (SPT > 1u) { if (state_ok(l, 1u)) { adjoint[base + l + 1u * LP] = v.y; } }
    if (SPT > 2u) { if (state_ok(l, 2u)) { adjoint[base + l + 2u * LP] = v.z; } }
    if (SPT > 3u) { if (state_ok(l, 3u)) { adjoint[base + l + 3u * LP] = v.w; } }
}

// One tile's inputs as loaded from memory: item k (< PF) of a thread is item thread + k·WG of the tile's
// (step, channel) and (step, state) lists, in member i<k> (members, not an indexed array, so they stay in
// registers): all of a tile's loads are issued before any is staged. h: the tile's entry state (backward).
struct Item { x: f32, u: f32, z: f32, dy: f32, b: f32, c: f32 }
struct Staged { i0: Item, i1: Item, i2: Item, i3: Item, h: vec4<f32> }

// Load item i of what steps [t0, t0 + steps) need: delta + bias, u and B always; C with `with_c`; z with
// `with_z`. Channels past Dc are left alone (no thread reads them).
fn fetch_item(b: u32, d0: u32, t0: u32, steps: u32, i: u32, with_c: bool, with_z: bool) -> Item {
    var it: Item;
    let d = d0 + i % CH;
    if (i < steps * CH && d < p.channels) {
        let row = row_index(b, t0 + i / CH, d);
        it.x = delta[row] + delta_bias[d];
        it.u = u[row];
        if (with_z) { it.z = z[row]; }
    }
    if (i < steps * N) {
        it.b = B[(b * p.len + t0) * N + i];
        if (with_c) { it.c = C[(b * p.len + t0) * N + i]; }
    }
    return it;
}

fn fetch(b: u32, d0: u32, t0: u32, steps: u32, thread: u32, with_c: bool, with_z: bool) -> Staged {
    var staged: Staged;
    staged.i0 = fetch_item(b, d0, t0, steps, thread, with_c, with_z);
    if (PF > 1u) { staged.i1 = fetch_item(b, d0, t0, steps, thread + WG, with_c, with_z); }
    if (PF > 2u) { staged.i2 = fetch_item(b, d0, t0, steps, thread + 2u * WG, with_c, with_z); }
    if (PF > 3u) { staged.i3 = fetch_item(b, d0, t0, steps, thread + 3u * WG, with_c, with_z); }
    return staged;
}

fn dy_item(b: u32, d0: u32, t0: u32, steps: u32, i: u32) -> f32 {
    let d = d0 + i % CH;
    if (i < steps * CH && d < p.channels) { return dy[row_index(b, t0 + i / CH, d)]; }
    return 0.0;
}

// The backward's fetch: everything, dy and the tile's entry state h (at h_slot + j·WG for state j) included.
fn fetch_grad(b: u32, d0: u32, t0: u32, steps: u32, thread: u32, h_slot: u32, mask: vec4<f32>) -> Staged {
    var staged = fetch(b, d0, t0, steps, thread, true, true);
    staged.i0.dy = dy_item(b, d0, t0, steps, thread);
    if (PF > 1u) { staged.i1.dy = dy_item(b, d0, t0, steps, thread + WG); }
    if (PF > 2u) { staged.i2.dy = dy_item(b, d0, t0, steps, thread + 2u * WG); }
    if (PF > 3u) { staged.i3.dy = dy_item(b, d0, t0, steps, thread + 3u * WG); }
    if (SPT > 0u) { if (mask.x > 0.0) { staged.h.x = tile_states[h_slot + 0u * WG]; } }
    if (SPT > 1u) { if (mask.y > 0.0) { staged.h.y = tile_states[h_slot + 1u * WG]; } }
    if (SPT > 2u) { if (mask.z > 0.0) { staged.h.z = tile_states[h_slot + 2u * WG]; } }
    if (SPT > 3u) { if (mask.w > 0.0) { staged.h.w = tile_states[h_slot + 3u * WG]; } }
    return staged;
}

// Write fetched item i into workgroup memory: Δ, u, B, and C, z (forward) or the backward's
// per-(step, channel) factors (`grad`): dy through the gate, and the gate's and softplus's derivatives.
fn stage_item(it: Item, d0: u32, steps: u32, i: u32, with_c: bool, with_z: bool, grad: bool) {
    if (i < steps * CH && d0 + i % CH < p.channels) {
        let j = i;
        dt_tile[j] = softplus(it.x);
        u_tile[j] = it.u;
        if (with_z) { z_tile[j] = it.z; }
        if (grad) {
            let gate = sigmoid(it.z);
            dyg_tile[j] = it.dy * it.z * gate;
            dzg_tile[j] = it.dy * gate * (1.0 + it.z * sigmoid(-it.z));  // 1 − σ(z) = σ(−z), no cancellation
            dsoftplus_tile[j] = select(sigmoid(it.x), 1.0, it.x > 20.0);
        }
    }
    if (i < steps * N) {
        B_tile[i] = it.b;
        if (with_c) { C_tile[i] = it.c; }
    }
}

fn stage(staged: Staged, d0: u32, steps: u32, thread: u32, with_c: bool, with_z: bool, grad: bool) {
    stage_item(staged.i0, d0, steps, thread, with_c, with_z, grad);
    if (PF > 1u) { stage_item(staged.i1, d0, steps, thread + WG, with_c, with_z, grad); }
    if (PF > 2u) { stage_item(staged.i2, d0, steps, thread + 2u * WG, with_c, with_z, grad); }
    if (PF > 3u) { stage_item(staged.i3, d0, steps, thread + 3u * WG, with_c, with_z, grad); }
}

// Grid (Dc / CH, B).
@compute @workgroup_size(128)
fn selective_scan_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let d0 = wid.x * CH;
    let thread = lid.x;
    let c = thread / LP;
    let l = thread % LP;
    let owns_channel = c < CH && d0 + c < p.channels;
    let cc = min(c, CH - 1u);  // in-range indices for the lanes that own nothing (their sums are not stored)
    let mask = select(vec4<f32>(0.0), state_mask(l), owns_channel);
    let stride = CH * (N + 1u);  // state_terms per step
    let sb = (b * p.channels + d0 + c) * N + l;  // [B, Dc, N] index of the thread's first state
    var a = vec4<f32>(0.0);
    var h = vec4<f32>(0.0);
    if (SPT > 0u) { if (mask.x > 0.0) { a.x = -exp(A_log[(d0 + c) * N + l + 0u * LP]); } }
    if (SPT > 1u) { if (mask.y > 0.0) { a.y = -exp(A_log[(d0 + c) * N + l + 1u * LP]); } }
    if (SPT > 2u) { if (mask.z > 0.0) { a.z = -exp(A_log[(d0 + c) * N + l + 2u * LP]); } }
    if (SPT > 3u) { if (mask.w > 0.0) { a.w = -exp(A_log[(d0 + c) * N + l + 3u * LP]); } }
    if (p.seg_begin > 0u) {
        if (SPT > 0u) { if (mask.x > 0.0) { h.x = last_state[sb + 0u * LP]; } }
        if (SPT > 1u) { if (mask.y > 0.0) { h.y = last_state[sb + 1u * LP]; } }
        if (SPT > 2u) { if (mask.z > 0.0) { h.z = last_state[sb + 2u * LP]; } }
        if (SPT > 3u) { if (mask.w > 0.0) { h.w = last_state[sb + 3u * LP]; } }
    }
    for (var t0 = p.seg_begin; t0 < p.seg_end; t0 += T) {
        if (t0 % p.chunk == 0u) {
            let cb = ((b * p.nchunks + t0 / p.chunk) * p.channels + d0 + c) * N + l;
            if (SPT > 0u) { if (mask.x > 0.0) { states[cb + 0u * LP] = h.x; } }
            if (SPT > 1u) { if (mask.y > 0.0) { states[cb + 1u * LP] = h.y; } }
            if (SPT > 2u) { if (mask.z > 0.0) { states[cb + 2u * LP] = h.z; } }
            if (SPT > 3u) { if (mask.w > 0.0) { states[cb + 3u * LP] = h.w; } }
        }
        let steps = min(T, p.len - t0);
        stage(fetch(b, d0, t0, steps, thread, true, true), d0, steps, thread, true, true, false);
        workgroupBarrier();
        for (var s = 0u; s < steps; s++) {
            let dt = dt_tile[s * CH + cc];
            let uv = u_tile[s * CH + cc];
            h = exp(dt * a) * h + (dt * uv) * b_states(s * N, l);
            let term = c_states(s * N, l) * mask * h;
            if (LANE_SUM) {
                let sum_ch = lane_sum(term.x + term.y + term.z + term.w);
                if (owns_channel && l == s % LP) {
                    let zv = z_tile[s * CH + c];
                    y[row_index(b, t0 + s, d0 + c)] = (D[d0 + c] * uv + sum_ch) * zv * sigmoid(zv);
                }
            } else if (owns_channel) {
                terms_store(s * stride + cc * (N + 1u), l, term);
            }
        }
        if (!LANE_SUM) {
            workgroupBarrier();
            for (var i = thread; i < steps * CH; i += WG) {
                let s = i / CH;
                let ci = i % CH;
                if (d0 + ci < p.channels) {
                    var acc = D[d0 + ci] * u_tile[i];
                    for (var m = 0u; m < N; m++) { acc += state_terms[s * stride + ci * (N + 1u) + m]; }
                    let zv = z_tile[i];
                    y[row_index(b, t0 + s, d0 + ci)] = acc * zv * sigmoid(zv);
                }
            }
        }
        workgroupBarrier();  // the next tile overwrites the staged inputs (and state_terms)
    }
    // The final state seeds recurrent decoding after a parallel prefill.
    if (SPT > 0u) { if (mask.x > 0.0) { last_state[sb + 0u * LP] = h.x; } }
    if (SPT > 1u) { if (mask.y > 0.0) { last_state[sb + 1u * LP] = h.y; } }
    if (SPT > 2u) { if (mask.z > 0.0) { last_state[sb + 2u * LP] = h.z; } }
    if (SPT > 3u) { if (mask.w > 0.0) { last_state[sb + 3u * LP] = h.w; } }
}

// One recurrent step per (batch row, channel), walking its N states in `state` (read and updated):
// h = exp(Δ A) h + Δ B_t u, y = (C_t·h + D u) · silu(z), Δ = softplus(delta + delta_bias). O(1) per token.
@compute @workgroup_size(64)
fn selective_scan_step(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= st.batch * st.channels) { return; }
    let b = i / st.channels;
    let d = i % st.channels;
    let dt = softplus(delta[i] + delta_bias[d]);
    let uv = u[i];
    var acc = D[d] * uv;
    for (var n = 0u; n < st.nstate; n++) {
        let k = i * st.nstate + n;
        let h = exp(-dt * exp(A_log[d * st.nstate + n])) * state[k] + dt * B[b * st.nstate + n] * uv;
        state[k] = h;
        acc += C[b * st.nstate + n] * h;
    }
    let zv = z[i];
    y[i] = acc * zv * sigmoid(zv);
}

// Grid (Dc / CH, B), as the forward.
@compute @workgroup_size(128)
fn selective_scan_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let d0 = wid.x * CH;
    let thread = lid.x;
    let c = thread / LP;
    let l = thread % LP;
    let owns_channel = c < CH && d0 + c < p.channels;
    let cc = min(c, CH - 1u);
    let mask = select(vec4<f32>(0.0), state_mask(l), owns_channel);
    let stride = CH * (N + 1u);
    let row_c = cc * (N + 1u);  // the channel's words in a step of state_terms / adjoint
    let nch = min(CH, p.channels - d0);  // channels of this workgroup inside Dc
    var a = vec4<f32>(0.0);
    if (SPT > 0u) { if (mask.x > 0.0) { a.x = -exp(A_log[(d0 + c) * N + l + 0u * LP]); } }
    if (SPT > 1u) { if (mask.y > 0.0) { a.y = -exp(A_log[(d0 + c) * N + l + 1u * LP]); } }
    if (SPT > 2u) { if (mask.z > 0.0) { a.z = -exp(A_log[(d0 + c) * N + l + 2u * LP]); } }
    if (SPT > 3u) { if (mask.w > 0.0) { a.w = -exp(A_log[(d0 + c) * N + l + 3u * LP]); } }
    let tiles_per_chunk = (min(p.chunk, p.len) + T - 1u) / T;
    // tile_states [B, Dc / CH, tiles per chunk, SPT, WG]: the thread's entry state j of tile i at
    // scratch + (i·SPT + j)·WG.
    let scratch = (b * nwg.x + wid.x) * tiles_per_chunk * SPT * WG + thread;
    let part_row = wid.x * p.batch + b;  // this workgroup's slice of dB_part / dC_part
    var g = vec4<f32>(0.0);   // g_t = ∂loss/∂h_t, carried backwards over tiles and chunks
    var da = vec4<f32>(0.0);  // Σ_t g_t exp(Δ_t A) h_{t−1} Δ_t = ∂loss/∂A[d, n] for this batch row
    var d_skip = 0.0;  // Σ dy'·u over this thread's (step, channel) items: ∂loss/∂D
    var d_bias = 0.0;  // Σ ddelta over the same items: ∂loss/∂delta_bias
    let ci = ((b * nwg.x + wid.x) * WG + thread) * CARRY;
    if (p.kc_hi < p.nchunks) {
        g = vec4<f32>(carry[ci], carry[ci + 1u], carry[ci + 2u], carry[ci + 3u]);
        da = vec4<f32>(carry[ci + 4u], carry[ci + 5u], carry[ci + 6u], carry[ci + 7u]);
        d_skip = carry[ci + 8u];
        d_bias = carry[ci + 9u];
    }
    for (var k = min(p.kc_hi, p.nchunks); k > p.kc_lo; k--) {
        let chunk_start = (k - 1u) * p.chunk;
        let ntiles = (min(p.chunk, p.len - chunk_start) + T - 1u) / T;
        // Entry state of every tile of the chunk, recomputed from the chunk's saved entry state (the walk stops
        // at the last tile's entry: its exit state is not needed; all tiles before it are whole).
        var h = vec4<f32>(0.0);
        let sb = ((b * p.nchunks + k - 1u) * p.channels + d0 + c) * N + l;
        if (SPT > 0u) { if (mask.x > 0.0) { h.x = saved_states[sb + 0u * LP]; } }
        if (SPT > 1u) { if (mask.y > 0.0) { h.y = saved_states[sb + 1u * LP]; } }
        if (SPT > 2u) { if (mask.z > 0.0) { h.z = saved_states[sb + 2u * LP]; } }
        if (SPT > 3u) { if (mask.w > 0.0) { h.w = saved_states[sb + 3u * LP]; } }
        let walked = ntiles - 1u;
        for (var i = 0u; i < walked; i++) {
            let t0 = chunk_start + i * T;
            if (SPT > 0u) { if (mask.x > 0.0) { tile_states[scratch + (i * SPT + 0u) * WG] = h.x; } }
            if (SPT > 1u) { if (mask.y > 0.0) { tile_states[scratch + (i * SPT + 1u) * WG] = h.y; } }
            if (SPT > 2u) { if (mask.z > 0.0) { tile_states[scratch + (i * SPT + 2u) * WG] = h.z; } }
            if (SPT > 3u) { if (mask.w > 0.0) { tile_states[scratch + (i * SPT + 3u) * WG] = h.w; } }
            stage(fetch(b, d0, t0, T, thread, false, false), d0, T, thread, false, false, false);
            workgroupBarrier();
            for (var s = 0u; s < T; s++) {
                let dt = dt_tile[s * CH + cc];
                h = exp(dt * a) * h + (dt * u_tile[s * CH + cc]) * b_states(s * N, l);
            }
            workgroupBarrier();
        }
        if (SPT > 0u) { if (mask.x > 0.0) { tile_states[scratch + (walked * SPT + 0u) * WG] = h.x; } }
        if (SPT > 1u) { if (mask.y > 0.0) { tile_states[scratch + (walked * SPT + 1u) * WG] = h.y; } }
        if (SPT > 2u) { if (mask.z > 0.0) { tile_states[scratch + (walked * SPT + 2u) * WG] = h.z; } }
        if (SPT > 3u) { if (mask.w > 0.0) { tile_states[scratch + (walked * SPT + 3u) * WG] = h.w; } }
        for (var i = ntiles; i > 0u; i--) {
            let t0 = chunk_start + (i - 1u) * T;
            let steps = min(T, p.len - t0);
            let staged = fetch_grad(b, d0, t0, steps, thread, scratch + (i - 1u) * SPT * WG, mask);
            let h_entry = staged.h;
            stage(staged, d0, steps, thread, true, false, true);
            workgroupBarrier();
            var ht = h_entry;
            for (var s = 0u; s < steps; s++) {
                let dt = dt_tile[s * CH + cc];
                ht = exp(dt * a) * ht + (dt * u_tile[s * CH + cc]) * b_states(s * N, l);
                if (owns_channel) { terms_store(s * stride + row_c, l, ht); }
            }
            workgroupBarrier();
            // From h_t: dz (needs the ungated y_t) per (step, channel) and dC per (step, state).
            for (var i = thread; i < steps * CH; i += WG) {
                let s = i / CH;
                let ch = i % CH;
                if (ch < nch) {
                    var acc = D[d0 + ch] * u_tile[i];
                    for (var m = 0u; m < N; m++) {
                        acc += C_tile[s * N + m] * state_terms[s * stride + ch * (N + 1u) + m];
                    }
                    dz[row_index(b, t0 + s, d0 + ch)] = acc * dzg_tile[i];
                }
            }
            for (var i = thread; i < steps * N; i += WG) {
                let s = i / N;
                let m = i % N;
                var acc = 0.0;
                for (var ch = 0u; ch < nch; ch++) {
                    acc += state_terms[s * stride + ch * (N + 1u) + m] * dyg_tile[s * CH + ch];
                }
                dC_part[(part_row * p.len + t0) * N + i] = acc;
            }
            workgroupBarrier();
            // The adjoint, last step to first. Step s reads h_{s−1} before step s − 1 overwrites its words.
            if (owns_channel) {
                for (var s = steps; s > 0u; s--) {
                    let si = s - 1u;
                    g += dyg_tile[si * CH + c] * c_states(si * N, l) * mask;
                    let dt = dt_tile[si * CH + c];
                    let decay = exp(dt * a);
                    var h_prev = h_entry;
                    if (si > 0u) { h_prev = terms_load((si - 1u) * stride + row_c, l); }
                    let gh = g * decay * h_prev;  // ∂loss/∂(Δ_t A)
                    da += gh * dt;
                    terms_store(si * stride + row_c, l, gh * a);
                    adjoint_store(si * stride + row_c, l, g);
                    g *= decay;
                }
            }
            workgroupBarrier();
            // du, ddelta per (step, channel); dB per (step, state).
            for (var i = thread; i < steps * CH; i += WG) {
                let s = i / CH;
                let ch = i % CH;
                if (ch < nch) {
                    var gb = 0.0;   // Σ_n g_t[n] B_t[n] = ∂loss/∂(Δ_t u_t)
                    var gha = 0.0;  // Σ_n g_t[n] exp(Δ_t A[n]) h_{t−1}[n] A[n]
                    for (var m = 0u; m < N; m++) {
                        gb += adjoint[s * stride + ch * (N + 1u) + m] * B_tile[s * N + m];
                        gha += state_terms[s * stride + ch * (N + 1u) + m];
                    }
                    let row = row_index(b, t0 + s, d0 + ch);
                    du[row] = D[d0 + ch] * dyg_tile[i] + dt_tile[i] * gb;
                    let dx = (gha + u_tile[i] * gb) * dsoftplus_tile[i];
                    ddelta[row] = dx;
                    d_skip += dyg_tile[i] * u_tile[i];
                    d_bias += dx;
                }
            }
            for (var i = thread; i < steps * N; i += WG) {
                let s = i / N;
                let m = i % N;
                var acc = 0.0;
                for (var ch = 0u; ch < nch; ch++) {
                    acc += adjoint[s * stride + ch * (N + 1u) + m] * dt_tile[s * CH + ch] * u_tile[s * CH + ch];
                }
                dB_part[(part_row * p.len + t0) * N + i] = acc;
            }
            workgroupBarrier();  // the next tile overwrites the staged inputs and terms
        }
    }
    if (p.kc_lo > 0u) {  // uniform: more chunks follow in another dispatch
        carry[ci] = g.x; carry[ci + 1u] = g.y; carry[ci + 2u] = g.z; carry[ci + 3u] = g.w;
        carry[ci + 4u] = da.x; carry[ci + 5u] = da.y; carry[ci + 6u] = da.z; carry[ci + 7u] = da.w;
        carry[ci + 8u] = d_skip;
        carry[ci + 9u] = d_bias;
        return;
    }
    let pb = (b * p.channels + d0 + c) * (N + 2u) + l;
    // ∂/∂A_log = ∂/∂A · A
    if (SPT > 0u) { if (mask.x > 0.0) { param_part[pb + 0u * LP] = da.x * a.x; } }
    if (SPT > 1u) { if (mask.y > 0.0) { param_part[pb + 1u * LP] = da.y * a.y; } }
    if (SPT > 2u) { if (mask.z > 0.0) { param_part[pb + 2u * LP] = da.z * a.z; } }
    if (SPT > 3u) { if (mask.w > 0.0) { param_part[pb + 3u * LP] = da.w * a.w; } }
    // Add each channel's partials of ∂/∂D and ∂/∂delta_bias in workgroup memory (thread i summed the
    // (step, channel) items of channel i % CH; CH divides WG).
    state_terms[thread] = d_skip;
    adjoint[thread] = d_bias;
    workgroupBarrier();
    if (thread < nch) {
        var skip = 0.0;
        var bias = 0.0;
        for (var i = thread; i < WG; i += CH) { skip += state_terms[i]; bias += adjoint[i]; }
        let base = (b * p.channels + d0 + thread) * (N + 2u) + N;
        param_part[base] = skip;
        param_part[base + 1u] = bias;
    }
}

// total[i] = Σ_k part[k·count + i] (dB, dC from the per-workgroup partials) in a fixed order: four running sums
// over k ≡ 0, 1, 2, 3 (mod 4), added as (s0 + s1) + (s2 + s3). Four loads in flight per thread where one running
// sum issues each load only after the last one arrived (~1.2 TB/s on an H200). Grid grid_1d(count).
@compute @workgroup_size(256)
fn selective_scan_sum_slices(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= q.count) { return; }
    var s0 = 0.0;
    var s1 = 0.0;
    var s2 = 0.0;
    var s3 = 0.0;
    var k = 0u;
    for (; k + 4u <= q.slices; k += 4u) {
        s0 += part[k * q.count + i];
        s1 += part[(k + 1u) * q.count + i];
        s2 += part[(k + 2u) * q.count + i];
        s3 += part[(k + 3u) * q.count + i];
    }
    if (k < q.slices) { s0 += part[k * q.count + i]; }
    if (k + 1u < q.slices) { s1 += part[(k + 1u) * q.count + i]; }
    if (k + 2u < q.slices) { s2 += part[(k + 2u) * q.count + i]; }
    total[i] = (s0 + s1) + (s2 + s3);
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

// --- CPU adapters: barrier-free walks -------------------------------------------------------------------------
// On a CPU adapter (Mesa llvmpipe) a workgroup's invocations run as SIMD loops on one CPU thread and every
// barrier is a coroutine switch, so the tiled kernels above spend their time in barriers and workgroup memory.
// These entry points use neither (as matmul_direct in linear.wgsl): one invocation walks time for one
// (batch row, channel) with the channel's N states in private arrays, reading its inputs straight from memory
// (CPU caches do the tiling). Same saved format as the tiled forward (states [B, n_chunks, Dc, N], last_state),
// so either backward consumes either forward's states. The backward gives each invocation `per_thread` channels
// (d = group + j·groups, walked one after another) and writes dB and dC as per-group partials
// dB_part, dC_part [groups, B, L, N] (its channels added in order j), summed over groups by
// selective_scan_sum_slices; du, ddelta, dz and the per-batch-row parameter sums (param_part) are summed
// in-thread. Segments as above: the forward steps [seg_begin, seg_end) (h entering from last_state when
// seg_begin > 0), the backward chunks kc_hi down to kc_lo + 1, per channel g, ∂/∂A, ∂/∂D, ∂/∂delta_bias carried
// in carry [B, Dc, 2N + 2]. Loop iterations per invocation: see the wrapper.
const MAX_N: u32 = 128u;  // MAX_STATE in the wrapper

struct DirectParams { batch: u32, len: u32, channels: u32, chunk: u32, nchunks: u32, seg_begin: u32, seg_end: u32,
                      kc_lo: u32, kc_hi: u32, ngroups: u32, per_thread: u32 }
@group(0) @binding(31) var<uniform> dp: DirectParams;

fn direct_row(b: u32, t: u32, d: u32) -> u32 { return (b * dp.len + t) * dp.channels + d; }

// Grid grid_1d(B·Dc) in workgroups of 64: invocation b·Dc + d.
@compute @workgroup_size(64)
fn selective_scan_forward_direct(@builtin(global_invocation_id) gid: vec3<u32>,
                                 @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= dp.batch * dp.channels) { return; }
    let b = i / dp.channels;
    let d = i % dp.channels;
    let base = i * N;  // [B, Dc, N] index of (b, d, 0)
    let resume = dp.seg_begin > 0u;
    var a: array<f32, MAX_N>;
    var h: array<f32, MAX_N>;
    for (var n = 0u; n < N; n++) {
        a[n] = -exp(A_log[d * N + n]);
        var h0 = 0.0;
        if (resume) { h0 = last_state[base + n]; }
        h[n] = h0;
    }
    let bias = delta_bias[d];
    let skip = D[d];
    for (var t = dp.seg_begin; t < dp.seg_end; t++) {
        let row = direct_row(b, t, d);
        let dt = softplus(delta[row] + bias);
        let uv = u[row];
        let dtu = dt * uv;
        let save = t % dp.chunk == 0u;
        let sb = ((b * dp.nchunks + t / dp.chunk) * dp.channels + d) * N;
        let bc = (b * dp.len + t) * N;
        var acc = 0.0;
        for (var n = 0u; n < N; n++) {
            if (save) { states[sb + n] = h[n]; }
            let hn = exp(dt * a[n]) * h[n] + dtu * B[bc + n];
            h[n] = hn;
            acc += C[bc + n] * hn;
        }
        let zv = z[row];
        y[row] = (skip * uv + acc) * zv * sigmoid(zv);
    }
    for (var n = 0u; n < N; n++) { last_state[base + n] = h[n]; }
}

// Grid grid_1d(B·groups) in workgroups of 32: invocation b·groups + group. tile_states is the scratch of the
// chunk's states, [B·groups, min(chunk, L) + 1, N] (slot 0: the chunk's entry state; slot s + 1: h after its
// step s), reused for each chunk and channel.
@compute @workgroup_size(32)
fn selective_scan_backward_direct(@builtin(global_invocation_id) gid: vec3<u32>,
                                  @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 32u + gid.x;
    if (i >= dp.batch * dp.ngroups) { return; }
    let b = i / dp.ngroups;
    let grp = i % dp.ngroups;
    let scr = i * (min(dp.chunk, dp.len) + 1u) * N;
    let resume = dp.kc_hi < dp.nchunks;
    var a: array<f32, MAX_N>;
    var h: array<f32, MAX_N>;
    var g: array<f32, MAX_N>;   // g_t = ∂loss/∂h_t, carried backwards over steps and chunks
    var da: array<f32, MAX_N>;  // Σ_t g_t exp(Δ_t A) h_{t−1} Δ_t = ∂loss/∂A[d, n] for this batch row
    for (var j = 0u; j < dp.per_thread; j++) {
        let d = grp + j * dp.ngroups;
        if (d >= dp.channels) { break; }
        let cb = (b * dp.channels + d) * (2u * N + 2u);
        var d_skip = 0.0;  // ∂loss/∂D
        var d_bias = 0.0;  // ∂loss/∂delta_bias
        if (resume) {
            d_skip = carry[cb + 2u * N];
            d_bias = carry[cb + 2u * N + 1u];
        }
        for (var n = 0u; n < N; n++) {
            a[n] = -exp(A_log[d * N + n]);
            var g0 = 0.0;
            var da0 = 0.0;
            if (resume) {
                g0 = carry[cb + n];
                da0 = carry[cb + N + n];
            }
            g[n] = g0;
            da[n] = da0;
        }
        let bias = delta_bias[d];
        let skip = D[d];
        for (var k = min(dp.kc_hi, dp.nchunks); k > dp.kc_lo; k--) {
            let t0 = (k - 1u) * dp.chunk;
            let steps = min(dp.chunk, dp.len - t0);
            // The chunk's states, recomputed from its saved entry state.
            let sb = ((b * dp.nchunks + k - 1u) * dp.channels + d) * N;
            for (var n = 0u; n < N; n++) {
                let h0 = saved_states[sb + n];
                h[n] = h0;
                tile_states[scr + n] = h0;
            }
            for (var s = 0u; s < steps; s++) {
                let row = direct_row(b, t0 + s, d);
                let dt = softplus(delta[row] + bias);
                let dtu = dt * u[row];
                let bc = (b * dp.len + t0 + s) * N;
                let out = scr + (s + 1u) * N;
                for (var n = 0u; n < N; n++) {
                    let hn = exp(dt * a[n]) * h[n] + dtu * B[bc + n];
                    h[n] = hn;
                    tile_states[out + n] = hn;
                }
            }
            // The adjoint, last step to first.
            for (var s = steps; s > 0u; s--) {
                let t = t0 + s - 1u;
                let row = direct_row(b, t, d);
                let uv = u[row];
                let zv = z[row];
                let dyv = dy[row];
                let gate = sigmoid(zv);
                let dyg = dyv * zv * gate;                            // dy through the gate
                let dzg = dyv * gate * (1.0 + zv * sigmoid(-zv));     // dz is this times the ungated y
                let x = delta[row] + bias;
                let dt = softplus(x);
                let dsp = select(sigmoid(x), 1.0, x > 20.0);          // ∂Δ/∂delta
                let dtu = dt * uv;
                let bc = (b * dp.len + t) * N;
                let cur = scr + s * N;  // h_t; h_{t−1} is the slot before
                let pb = ((grp * dp.batch + b) * dp.len + t) * N;
                var yc = 0.0;   // C_t·h_t
                var gb = 0.0;   // Σ_n g_t[n] B_t[n] = ∂loss/∂(Δ_t u_t)
                var gha = 0.0;  // Σ_n g_t[n] exp(Δ_t A[n]) h_{t−1}[n] A[n]
                for (var n = 0u; n < N; n++) {
                    let ht = tile_states[cur + n];
                    let cn = C[bc + n];
                    yc += cn * ht;
                    let gn = g[n] + dyg * cn;
                    let decay = exp(dt * a[n]);
                    let gh = gn * decay * tile_states[cur - N + n];  // ∂loss/∂(Δ_t A)
                    da[n] += gh * dt;
                    gha += gh * a[n];
                    gb += gn * B[bc + n];
                    var dc = ht * dyg;
                    var db = gn * dtu;
                    if (j > 0u) {
                        dc += dC_part[pb + n];
                        db += dB_part[pb + n];
                    }
                    dC_part[pb + n] = dc;
                    dB_part[pb + n] = db;
                    g[n] = gn * decay;
                }
                dz[row] = (skip * uv + yc) * dzg;
                du[row] = skip * dyg + dt * gb;
                let dx = (gha + uv * gb) * dsp;
                ddelta[row] = dx;
                d_skip += dyg * uv;
                d_bias += dx;
            }
        }
        if (dp.kc_lo > 0u) {  // more chunks follow in another dispatch
            for (var n = 0u; n < N; n++) {
                carry[cb + n] = g[n];
                carry[cb + N + n] = da[n];
            }
            carry[cb + 2u * N] = d_skip;
            carry[cb + 2u * N + 1u] = d_bias;
        } else {
            let pp = (b * dp.channels + d) * (N + 2u);
            for (var n = 0u; n < N; n++) { param_part[pp + n] = da[n] * a[n]; }  // ∂/∂A_log = ∂/∂A · A
            param_part[pp + N] = d_skip;
            param_part[pp + N + 1u] = d_bias;
        }
    }
}

// --- CPU adapters with 8-lane subgroups: the direct walks with loads shared across channels ------------------
// As the direct kernels (one invocation per (batch row, channel) walking time, no barriers or workgroup memory),
// but for N ≤ 16 with the state in four vec4 registers (a State16; states past N stay 0) and the 8 lanes of
// a subgroup on 8 consecutive channels of one batch row (Dc is padded to whole subgroups; lanes past Dc
// compute on the last channel and store nothing). Why (Mesa 22.3 lavapipe, measured with micro-kernels):
// every storage load or store there is a loop over the SIMD lanes (~1.5 ns per lane), a loop over a private
// array with a dynamic index goes through memory the same way, while arithmetic on registers and
// subgroupBroadcast from a constant lane cost ~0.02 ns per lane. So B_t and C_t, the same for all channels,
// are loaded once per subgroup (lane l holds states l and 8 + l) and broadcast; the sums of dB and dC over
// the subgroup's channels are a reduce-scatter butterfly of subgroupShuffleXor (subgroupAdd costs ~2 ns there);
// and the per-state loops of the direct kernels become straight-line vec4 code. The backward keeps one scratch
// slot (16 words, as 4 vec4) per SUBCHUNK = 4 steps and recomputes each sub-chunk's states into registers
// (below). Saved states and the scratch move as vec4 (about two scalars' price there) where N allows it; no
// `if` that a step rarely takes sits in a step loop (lavapipe runs every `if` body: docs/architecture.md).
// The wrapper (ops/selective_scan.py) takes these where Runtime.subgroup_size is 8. Same saved format
// (states [B, n_chunks, Dc, N], last_state); dB_part, dC_part [Dc / 8 rounded up, B, L, N]; the scratch
// scratch4 [ceil(min(chunk, L) / 4), B · padded Dc / 8, 4, 8] vec4 (slot 0 unused: sub-chunk 0 starts from the
// saved state); carry, param_part as in the direct backward. Measured on lavapipe, tiny shape (B 8, L 64, Dc 128,
// N 16, chunk 128), one worker thread's CPU per call, minimum of 12 rounds, 4 process pairs interleaved with
// c8c2f4f's kernels on a loaded machine (load 3.5-3.9), 2026-12-02 00:06 UTC: forward 3.09-5.22 -> 1.98-3.22 ms
// (0.38-0.66x pair by pair), backward with its sums 8.7-15.7 -> 7.0-11.9 ms (0.45-0.82x).
const SG_N: u32 = 16u;  // SUBGROUP_MAX_STATE in the wrapper

struct State16 { g0: vec4<f32>, g1: vec4<f32>, g2: vec4<f32>, g3: vec4<f32> }

fn s_splat(x: f32) -> State16 { return State16(vec4<f32>(x), vec4<f32>(x), vec4<f32>(x), vec4<f32>(x)); }
fn s_add(a: State16, b: State16) -> State16 { return State16(a.g0 + b.g0, a.g1 + b.g1, a.g2 + b.g2, a.g3 + b.g3); }
fn s_mul(a: State16, b: State16) -> State16 { return State16(a.g0 * b.g0, a.g1 * b.g1, a.g2 * b.g2, a.g3 * b.g3); }
fn s_scale(a: State16, x: f32) -> State16 { return State16(a.g0 * x, a.g1 * x, a.g2 * x, a.g3 * x); }
fn s_exp(a: State16) -> State16 { return State16(exp(a.g0), exp(a.g1), exp(a.g2), exp(a.g3)); }
fn s_dot(a: State16, b: State16) -> f32 { return dot(a.g0, b.g0) + dot(a.g1, b.g1) + dot(a.g2, b.g2) + dot(a.g3, b.g3); }
fn s_select(a: State16, b: State16, c: bool) -> State16 {
    return State16(select(a.g0, b.g0, c), select(a.g1, b.g1, c), select(a.g2, b.g2, c), select(a.g3, b.g3, c));
}

// Lanes 0-3 (lo) or 4-7 (hi) of v as one vec4, in every lane.
fn lanes_lo4(v: f32) -> vec4<f32> {
    return vec4<f32>(subgroupBroadcast(v, 0u), subgroupBroadcast(v, 1u), subgroupBroadcast(v, 2u), subgroupBroadcast(v, 3u));
}
fn lanes_hi4(v: f32) -> vec4<f32> {
    return vec4<f32>(subgroupBroadcast(v, 4u), subgroupBroadcast(v, 5u), subgroupBroadcast(v, 6u), subgroupBroadcast(v, 7u));
}
// B_t or C_t (row bc of [B, L, N]) in every lane: lane l loads states l and 8 + l (0 past N).
fn shared_B(bc: u32, lane: u32) -> State16 {
    let v0 = select(0.0, B[bc + min(lane, N - 1u)], lane < N);
    var v1 = 0.0;
    if (N > 8u) { v1 = select(0.0, B[bc + min(8u + lane, N - 1u)], 8u + lane < N); }
    return State16(lanes_lo4(v0), lanes_hi4(v0), lanes_lo4(v1), lanes_hi4(v1));
}
fn shared_C(bc: u32, lane: u32) -> State16 {
    let v0 = select(0.0, C[bc + min(lane, N - 1u)], lane < N);
    var v1 = 0.0;
    if (N > 8u) { v1 = select(0.0, C[bc + min(8u + lane, N - 1u)], 8u + lane < N); }
    return State16(lanes_lo4(v0), lanes_hi4(v0), lanes_lo4(v1), lanes_hi4(v1));
}

// A State16 <-> N words of a buffer goes through this private array (a dynamic index: used once per chunk).
var<private> words: array<f32, SG_N>;
fn from_words() -> State16 {
    return State16(vec4<f32>(words[0], words[1], words[2], words[3]), vec4<f32>(words[4], words[5], words[6], words[7]),
                   vec4<f32>(words[8], words[9], words[10], words[11]), vec4<f32>(words[12], words[13], words[14], words[15]));
}
fn to_words(a: State16) {
    words[0] = a.g0.x; words[1] = a.g0.y; words[2] = a.g0.z; words[3] = a.g0.w;
    words[4] = a.g1.x; words[5] = a.g1.y; words[6] = a.g1.z; words[7] = a.g1.w;
    words[8] = a.g2.x; words[9] = a.g2.y; words[10] = a.g2.z; words[11] = a.g2.w;
    words[12] = a.g3.x; words[13] = a.g3.y; words[14] = a.g3.z; words[15] = a.g3.w;
}

// A scratch slot: invocation i's 16 states at slot s are the vec4s (s · lanes / 8 + i / 8) · 32 + g · 8 + i % 8,
// g < 4 (states 4g .. 4g + 3; lanes = B · padded Dc): a subgroup's slot is 512 contiguous bytes and one vec4
// access of its 8 lanes touches 128 of them. (A layout [invocation][slot][n] put each lane 4 KiB from the next,
// so a load's 8 lines shared one L1 set.) e is the vec4 of group 0.
fn scratch_store(e: u32, a: State16) {
    scratch4[e] = a.g0;
    scratch4[e + 8u] = a.g1;
    if (N > 8u) {
        scratch4[e + 16u] = a.g2;
        scratch4[e + 24u] = a.g3;
    }
}
fn scratch_load(e: u32) -> State16 {
    var hi0 = vec4<f32>(0.0);
    var hi1 = vec4<f32>(0.0);
    if (N > 8u) {
        hi0 = scratch4[e + 16u];
        hi1 = scratch4[e + 24u];
    }
    return State16(scratch4[e], scratch4[e + 8u], hi0, hi1);
}

// Σ over the 8 lanes of a State16, reduce-scattered: lane l ends with the sums of states 2l and 2l + 1. Each
// butterfly level keeps the half of its values named by one bit of the lane and adds its partner's copy of
// that half (lanes 4 apart trade states 0-7 / 8-15, then 2 apart 4-state halves, then 1 apart pairs): 10
// shuffles instead of lanes_sum's 48, and every lane stores 2 words instead of lanes 0-3 storing 4.
fn lanes_sum_scatter(a: State16, lane: u32) -> vec2<f32> {
    let lo = (lane & 4u) == 0u;
    let k0 = select(a.g2, a.g0, lo) + subgroupShuffleXor(select(a.g0, a.g2, lo), 4u);
    let k1 = select(a.g3, a.g1, lo) + subgroupShuffleXor(select(a.g1, a.g3, lo), 4u);
    let mid = (lane & 2u) == 0u;
    let m = select(k1, k0, mid) + subgroupShuffleXor(select(k0, k1, mid), 2u);
    let first = (lane & 1u) == 0u;
    return select(m.zw, m.xy, first) + subgroupShuffleXor(select(m.xy, m.zw, first), 1u);
}

// Lane l's two words (states 2l, 2l + 1 below N) of the subgroup's dB and dC sums to the partials at e.
fn store_scattered(e: u32, lane: u32, db: vec2<f32>, dc: vec2<f32>) {
    let n = 2u * lane;
    if (n < N) { dB_part[e + n] = db.x; dC_part[e + n] = dc.x; }
    if (n + 1u < N) { dB_part[e + n + 1u] = db.y; dC_part[e + n + 1u] = dc.y; }
}

// The N states at word sb of [.., N] saved states (sb a multiple of N): four vec4 accesses where N is a multiple
// of 4, else N scalar ones through `words`.
fn save_states(sb: u32, a: State16) {
    if (N % 4u == 0u) {
        let e = sb / 4u;
        states4[e] = a.g0;
        if (N > 4u) { states4[e + 1u] = a.g1; }
        if (N > 8u) { states4[e + 2u] = a.g2; }
        if (N > 12u) { states4[e + 3u] = a.g3; }
    } else {
        to_words(a);
        for (var n = 0u; n < N; n++) { states[sb + n] = words[n]; }
    }
}
fn load_saved_states(sb: u32) -> State16 {
    if (N % 4u == 0u) {
        let e = sb / 4u;
        var a = State16(saved_states4[e], vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
        if (N > 4u) { a.g1 = saved_states4[e + 1u]; }
        if (N > 8u) { a.g2 = saved_states4[e + 2u]; }
        if (N > 12u) { a.g3 = saved_states4[e + 3u]; }
        return a;
    }
    for (var n = 0u; n < SG_N; n++) { words[n] = select(0.0, saved_states[sb + min(n, N - 1u)], n < N); }
    return from_words();
}

// A uniform parameter that Mesa 22.3 lavapipe cannot inline. Lavapipe inlines the uniform values that decide
// branches and loop exits into a recompiled pipeline at every dispatch whose uniforms changed (here: every
// dispatch, the ring's offset moves), and stops only if its first inlined compile shrank the shader by less
// than half; its test (before − after < before / 2) is unsigned, so a compile that grew (loops unrolled) passes
// it and recompiles forever. A variant of the subgroup backward did: ~12 ms of CPU per dispatch on lavapipe's
// queue thread, invisible in the kernel's own time. A subgroup broadcast (an intrinsic, not an ALU op) hides
// the value from that search, for the price of one lane shuffle.
fn opaque(x: u32) -> u32 { return subgroupBroadcast(x, 0u); }

// A = −exp(A_log[d, :]) (0 past N, so those states never move).
fn neg_exp_A(d: u32) -> State16 {
    for (var n = 0u; n < SG_N; n++) { words[n] = select(0.0, -exp(A_log[d * N + min(n, N - 1u)]), n < N); }
    return from_words();
}

// Grid grid_1d(B · padded Dc) in workgroups of 64: invocation b · padded + d (padded = 8 · dp.ngroups).
@compute @workgroup_size(64)
fn selective_scan_forward_subgroup(@builtin(global_invocation_id) gid: vec3<u32>,
                                   @builtin(num_workgroups) nwg: vec3<u32>,
                                   @builtin(subgroup_invocation_id) lane: u32) {
    let i = gid.y * nwg.x * 64u + gid.x;
    let padded = 8u * dp.ngroups;
    if (i >= dp.batch * padded) { return; }  // whole subgroups (batch · padded is a multiple of 8)
    let b = i / padded;
    let valid = i % padded < dp.channels;
    let d = min(i % padded, dp.channels - 1u);
    let base = (b * dp.channels + d) * N;  // [B, Dc, N] index of (b, d, 0)
    let a = neg_exp_A(d);
    var h = s_splat(0.0);
    if (dp.seg_begin > 0u) {
        for (var n = 0u; n < SG_N; n++) { words[n] = select(0.0, last_state[base + min(n, N - 1u)], n < N); }
        h = from_words();
    }
    let bias = delta_bias[d];
    let skip = D[d];
    // Chunk by chunk, so the save at a chunk's start is in no step: lavapipe runs an `if` body every time, taken
    // or not, and a save inside the step loop cost its stores at every step.
    let chunk = opaque(dp.chunk);
    let seg_end = opaque(dp.seg_end);
    for (var t0 = opaque(dp.seg_begin); t0 < seg_end; t0 = min((t0 / chunk + 1u) * chunk, seg_end)) {
        if (t0 % chunk == 0u && valid) { save_states(((b * dp.nchunks + t0 / chunk) * dp.channels + d) * N, h); }
        for (var t = t0; t < min((t0 / chunk + 1u) * chunk, seg_end); t++) {
            let row = direct_row(b, t, d);
            let dt = softplus(delta[row] + bias);
            let uv = u[row];
            let bc = (b * dp.len + t) * N;
            h = s_add(s_mul(s_exp(s_scale(a, dt)), h), s_scale(shared_B(bc, lane), dt * uv));
            let acc = s_dot(shared_C(bc, lane), h);
            let zv = z[row];
            if (valid) { y[row] = (skip * uv + acc) * zv * sigmoid(zv); }
        }
    }
    if (valid) {
        to_words(h);
        for (var n = 0u; n < N; n++) { last_state[base + n] = words[n]; }
    }
}

// The backward's per-invocation values, private so that the step helpers below share them.
var<private> sg_b: u32;          // batch row
var<private> sg_d: u32;          // channel (clamped to the last one past Dc)
var<private> sg_lane: u32;
var<private> sg_valid: bool;     // the channel exists (lanes past Dc store nothing)
var<private> sg_grp: u32;        // the subgroup's channel group: the partials' slice
var<private> sg_a: State16;      // A[d, :]
var<private> sg_bias: f32;
var<private> sg_skip: f32;
var<private> sg_g: State16;      // g_t = ∂loss/∂h_t, carried backwards over steps and chunks
var<private> sg_da: State16;     // Σ_t g_t exp(Δ_t A) h_{t−1} Δ_t = ∂loss/∂A[d, :] for this batch row
var<private> sg_d_skip: f32;     // ∂loss/∂D
var<private> sg_d_bias: f32;     // ∂loss/∂delta_bias

// One step's delta_t + bias, Δ_t, u_t, exp(Δ_t A) and B_t, kept from sg_advance for the adjoint of the same step
// (it loads neither delta nor u again: 2 of its 6 loads per step).
struct StepTerms { x: f32, dt: f32, uv: f32, decay: State16, Bt: State16 }
var<private> sg_terms: StepTerms;

// h after step t from h before it (its terms left in sg_terms).
fn sg_advance(h: State16, t: u32) -> State16 {
    let row = direct_row(sg_b, t, sg_d);
    let x = delta[row] + sg_bias;
    let dt = softplus(x);
    let uv = u[row];
    sg_terms = StepTerms(x, dt, uv, s_exp(s_scale(sg_a, dt)), shared_B((sg_b * dp.len + t) * N, sg_lane));
    return s_add(s_mul(sg_terms.decay, h), s_scale(sg_terms.Bt, dt * uv));
}

// The adjoint of step t: h is h_t, prev h_{t−1}; g_t becomes g_{t−1}, the sums grow, du, ddelta, dz and the
// dB / dC partials of step t are written.
fn sg_adjoint(t: u32, h: State16, prev: State16, terms: StepTerms) {
    let row = direct_row(sg_b, t, sg_d);
    let uv = terms.uv;
    let zv = z[row];
    let dyv = dy[row];
    let gate = sigmoid(zv);
    let dyg = dyv * zv * gate;                            // dy through the gate
    let dzg = dyv * gate * (1.0 + zv * sigmoid(-zv));     // dz is this times the ungated y
    let x = terms.x;
    let dt = terms.dt;
    let dsp = select(sigmoid(x), 1.0, x > 20.0);          // ∂Δ/∂delta
    let dtu = dt * uv;
    let Bt = terms.Bt;
    let Ct = shared_C((sg_b * dp.len + t) * N, sg_lane);
    let yc = s_dot(Ct, h);                                // C_t·h_t
    let gn = s_add(sg_g, s_scale(Ct, dyg));
    let decay = terms.decay;
    let gh = s_mul(s_mul(gn, decay), prev);               // ∂loss/∂(Δ_t A)
    sg_da = s_add(sg_da, s_scale(gh, dt));
    let gha = s_dot(gh, sg_a);
    let gb = s_dot(gn, Bt);                               // ∂loss/∂(Δ_t u_t)
    let zero = s_splat(0.0);
    store_scattered(((sg_grp * dp.batch + sg_b) * dp.len + t) * N, sg_lane,
                    lanes_sum_scatter(s_select(zero, s_scale(gn, dtu), sg_valid), sg_lane),
                    lanes_sum_scatter(s_select(zero, s_scale(h, dyg), sg_valid), sg_lane));
    sg_g = s_mul(gn, decay);
    let dx = (gha + uv * gb) * dsp;
    if (sg_valid) {
        dz[row] = (sg_skip * uv + yc) * dzg;
        du[row] = sg_skip * dyg + dt * gb;
        ddelta[row] = dx;
    }
    sg_d_skip += dyg * uv;
    sg_d_bias += dx;
}

// Grid grid_1d(B · padded Dc) in workgroups of 64, as the forward. Per chunk: a walk over its steps stores
// the state entering every SUBCHUNK-th step in the scratch; then each sub-chunk of SUBCHUNK steps, last to
// first, recomputes its states into registers (h0 .. h4, the helpers written out SUBCHUNK times) and runs
// their adjoint. That walks the recurrence twice, but moves 2 · 16 / SUBCHUNK scratch words per step
// instead of 32 (the scratch was 2/3 of this kernel's time with one slot per step). Measured and not kept:
// chunk = SUBCHUNK (the forward saving every 4th state, so the backward walks nothing): 11.6 against 7.3 ms
// per backward at the tiny shape, though callgrind counted 11% fewer instructions.
const SUBCHUNK: u32 = 4u;
// Lavapipe runs the body of every `if` with a lane mask whether or not a lane takes it (it does not branch
// around bodies), so code that a shape never needs is compiled out by these constants rather than skipped:
// WALK false where chunk ≤ SUBCHUNK (every sub-chunk starts from a saved state: no walk, no scratch), TAIL false
// where every sub-chunk has SUBCHUNK steps (L and chunk multiples of it).
override WALK: bool = true;
override TAIL: bool = true;

@compute @workgroup_size(64)
fn selective_scan_backward_subgroup(@builtin(global_invocation_id) gid: vec3<u32>,
                                    @builtin(num_workgroups) nwg: vec3<u32>,
                                    @builtin(subgroup_invocation_id) lane: u32) {
    let i = gid.y * nwg.x * 64u + gid.x;
    let padded = 8u * dp.ngroups;
    if (i >= dp.batch * padded) { return; }
    sg_b = i / padded;
    sg_lane = lane;
    sg_valid = i % padded < dp.channels;
    sg_grp = (i % padded) / 8u;
    sg_d = min(i % padded, dp.channels - 1u);
    let d = sg_d;
    let slot0 = (i / 8u) * 32u + i % 8u;  // scratch vec4 of states 0-3 at slot 0
    let slot_vec4s = dp.batch * padded * 4u;
    let cb = (sg_b * dp.channels + d) * (2u * N + 2u);
    sg_a = neg_exp_A(d);
    sg_g = s_splat(0.0);
    sg_da = s_splat(0.0);
    sg_d_skip = 0.0;
    sg_d_bias = 0.0;
    let kc_lo = opaque(dp.kc_lo);
    let kc_hi = opaque(dp.kc_hi);
    let nchunks = opaque(dp.nchunks);
    if (kc_hi < nchunks) {  // resume from the carry of the dispatch before
        for (var n = 0u; n < SG_N; n++) { words[n] = select(0.0, carry[cb + min(n, N - 1u)], n < N); }
        sg_g = from_words();
        for (var n = 0u; n < SG_N; n++) { words[n] = select(0.0, carry[cb + N + min(n, N - 1u)], n < N); }
        sg_da = from_words();
        sg_d_skip = carry[cb + 2u * N];
        sg_d_bias = carry[cb + 2u * N + 1u];
    }
    sg_bias = delta_bias[d];
    sg_skip = D[d];
    for (var k = min(kc_hi, nchunks); k > kc_lo; k--) {
        let t0 = (k - 1u) * dp.chunk;
        let steps = min(dp.chunk, dp.len - t0);
        // The chunk's entry state is sub-chunk 0's; the walk stores those of the others (none at chunk ≤ 4).
        let entry = load_saved_states(((sg_b * dp.nchunks + k - 1u) * dp.channels + d) * N);
        if (WALK) {  // sub-chunk by sub-chunk (no `if` per step: see the forward), each storing the next one's entry
            var h = entry;
            let last = (steps - 1u) / SUBCHUNK * SUBCHUNK;  // the last sub-chunk's first step: the walk ends there
            for (var s = 0u; s < last; s += SUBCHUNK) {
                for (var k4 = 0u; k4 < SUBCHUNK; k4++) { h = sg_advance(h, t0 + s + k4); }
                scratch_store((s / SUBCHUNK + 1u) * slot_vec4s + slot0, h);
            }
        }
        for (var j = (steps + SUBCHUNK - 1u) / SUBCHUNK; j > 0u; j--) {
            let s0 = (j - 1u) * SUBCHUNK;
            let n_in = min(SUBCHUNK, steps - s0);
            let t = t0 + s0;
            var h0 = entry;
            if (WALK && j > 1u) { h0 = scratch_load((j - 1u) * slot_vec4s + slot0); }
            let h1 = sg_advance(h0, t);
            let k0 = sg_terms;
            var h2 = h1;
            var h3 = h1;
            var h4 = h1;
            var k1 = k0;
            var k2 = k0;
            var k3 = k0;
            if (!TAIL || n_in > 1u) { h2 = sg_advance(h1, t + 1u); k1 = sg_terms; }
            if (!TAIL || n_in > 2u) { h3 = sg_advance(h2, t + 2u); k2 = sg_terms; }
            if (!TAIL || n_in > 3u) { h4 = sg_advance(h3, t + 3u); k3 = sg_terms; }
            if (!TAIL || n_in > 3u) { sg_adjoint(t + 3u, h4, h3, k3); }
            if (!TAIL || n_in > 2u) { sg_adjoint(t + 2u, h3, h2, k2); }
            if (!TAIL || n_in > 1u) { sg_adjoint(t + 1u, h2, h1, k1); }
            sg_adjoint(t, h1, h0, k0);
        }
    }
    if (!sg_valid) { return; }
    if (kc_lo > 0u) {  // more chunks follow in another dispatch
        to_words(sg_g);
        for (var n = 0u; n < N; n++) { carry[cb + n] = words[n]; }
        to_words(sg_da);
        for (var n = 0u; n < N; n++) { carry[cb + N + n] = words[n]; }
        carry[cb + 2u * N] = sg_d_skip;
        carry[cb + 2u * N + 1u] = sg_d_bias;
    } else {
        let pp = (sg_b * dp.channels + d) * (N + 2u);
        to_words(s_mul(sg_da, sg_a));  // ∂/∂A_log = ∂/∂A · A
        for (var n = 0u; n < N; n++) { param_part[pp + n] = words[n]; }
        param_part[pp + N] = sg_d_skip;
        param_part[pp + N + 1u] = sg_d_bias;
    }
}
