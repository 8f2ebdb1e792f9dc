//! include texture
// Mamba-1 selective scan (S6), fused like mamba_ssm's selective_scan_fn with delta_softplus, and its exact
// backward. u, delta, z, y [B, L, Dc] (time-major rows); A_log [Dc, N]; B, C [B, L, N]; D, delta_bias [Dc]:
//   Δ = softplus(delta + delta_bias), A = −exp(A_log), h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t,
//   y_t = (C_t·h_t + D u_t) · silu(z_t).
//
// GPU kernels ("tiled" in the wrapper; forward, backward_walk, backward): LP = max(SUB, NP / 4) lanes per (batch row
// b, channel d), NP = N rounded up to a power of two, lane cl holding the 4 consecutive states 4cl .. 4cl + 3 in a
// vec4 register (those ≥ N stay 0: A, B, C and the saved states load as 0 there). A channel's lanes are an aligned
// block of a subgroup of SG lanes (LP ≤ SG; lanes numbered as the threads, as on NVIDIA and lavapipe), so a subgroup
// holds CPS = SG / LP channels (8 at N = 16 on NVIDIA) and a workgroup WG / LP; grid (ceil(Dc·LP / WG), B). No
// workgroup memory and no barriers: each subgroup walks time on its own (h, and in the backward the adjoint g, are
// registers carried from step to step), in sub-tiles of SUB = 4 steps. In a sub-tile lane s of a channel is the
// owner of step s: it loads that step's delta, u (z, dy) and computes Δ, Δ·u (the gate's and softplus's derivatives)
// once for the channel; subgroupShuffle broadcasts them to the channel's lanes. The sums over n of a sub-tile (C·h;
// in the backward also g·B and Σ gh·A) are one transposing butterfly over the channel's lanes that leaves step s's
// sums in lane s, which writes that step's y (dz, du, ddelta). The backward sums dB, dC over the subgroup's channels
// by a transposing butterfly per step that leaves each of the 2N sums in one lane (CPS = 8), stored as per-subgroup
// partials dB_part, dC_part [ceil(Dc / CPS), B, L, N] that selective_scan_sum_slices adds in a fixed order. Each
// sub-tile's loads are issued ahead: the forward and the adjoint walk sub-tiles in pairs with a load buffer each
// (even, odd), reloaded right after its sub-tile ran, so no load still in flight is ever copied (a rotation `ld =
// next; next = load` copies them at the loop's end, which waits for them); the walk issues one sub-tile ahead. A
// whole sub-tile (all but a segment's or a chunk's last) runs as straight-line code: the sub-tile helpers inlined
// with n_in = SUB, no branch between its steps. Nothing a lane holds is an array indexed by a loop counter (those
// can land in local memory): every value is a named register. Why this split: at the 130m shape (B 8, Dc 1536, N 16)
// there are only 49k lanes, 384 workgroups, ~3 per SM of an H200, so registers are cheap (up to ~168 per lane keeps
// every workgroup resident at once; the backward sits near that: loads two sub-tiles ahead cost it a second wave)
// while each barrier and round trip through workgroup memory lies on a walk's critical path (the workgroup-memory
// kernels these replaced: one state per thread, 5 barriers per tile of 8 steps, 4.5x slower).
// Memory: the forward saves only the state entering each chunk of `chunk` steps, states [B, n_chunks, Dc, N].
// The backward first walks every chunk of a segment at once from its saved entry state
// (selective_scan_backward_walk: the chunks are independent, one dispatch, chunks along the grid's z), storing
// the state entering every sub-tile in slots [B, Dc·LP / WG, chunks · chunk / SUB, WG] (vec4); then
// selective_scan_backward walks the segment's sub-tiles last to first: it recomputes a sub-tile's 4 states into
// registers (h0 .. h4) from its slot and runs their adjoint g_t = ∂loss/∂h_t = C_t dy'_t + exp(Δ_{t+1} A) g_{t+1}
// backwards (dy' = dy·silu(z)). Sums over batch rows (∂/∂A_log, ∂/∂D, ∂/∂delta_bias) go out as per-row
// partials (param_part); second dispatches add the partials in a fixed order, so results are deterministic and
// there are no atomics.
// Measured (H200, B 8, L 1024, Dc 1536, N 16, GPU timestamps, bench/scan.py, one process, round robin, 05:01
// UTC 2026-12-02): forward 0.269 ms, adjoint 0.526, walk 0.141; against a rotation of loads two sub-tiles ahead
// (forward) or one (adjoint) with a branch per step: 0.310 / 0.545 ms; straight-line whole sub-tiles with the
// rotation: 0.276 / 0.536. Earlier: the workgroup-memory kernels these replaced 0.499 (forward), 2.504
// (backward); the walk inside the backward dispatch 0.728 in all; loads not issued ahead +0.37 (forward), +0.09
// (backward); two sub-tiles ahead in the backward by a rotation +0.39 ms (a register cliff). Measured and
// removed: a chunk-parallel forward (every chunk's end state from h = 0 and its decay exp(A ΣΔ) in one dispatch,
// then each chunk's walk from the combined entry state: 8x the lanes, twice the exps): 0.092 + 0.190 ms, no
// faster than the serial walk (0.282 vs 0.269, same call); with 8x the lanes each pass runs at ~1 TB/s, bound by
// its instructions (an exp per state and step), so the extra pass costs what the parallelism saves.
// N, LP and SG are pipeline constants; the wrapper keeps LP ≤ SG (else the direct kernels run).

const WG: u32 = 128u;  // mirrored by the wrapper (mambactl/ops/selective_scan.py)
const CARRY: u32 = 10u;  // carry words per backward thread: g, ∂/∂A (4 each), ∂/∂D, ∂/∂delta_bias
const SUB: u32 = 4u;     // steps per sub-tile: one owner lane per step (LP ≥ SUB)

override N: u32 = 16u;   // state size
override LP: u32 = 4u;   // lanes per channel: max(SUB, NP / 4)
override SG: u32 = 32u;  // lanes per subgroup (Runtime.subgroup_size)
override ACCUMULATE: bool = false;

// Segments (Mesa llvmpipe caps one invocation's loop iterations at 65,535 in total, so there the wrapper splits
// the walk over time into dispatches; elsewhere one dispatch covers it): the forward runs steps [seg_begin,
// seg_end) (multiples of SUB), h entering from last_state when seg_begin > 0; the backward runs chunks kc_hi down
// to kc_lo + 1 (1-based), its carried sums entering from carry when kc_hi < nchunks and leaving there when
// kc_lo > 0.
struct ScanParams { batch: u32, len: u32, channels: u32, chunk: u32, nchunks: u32, seg_begin: u32, seg_end: u32,
                    kc_lo: u32, kc_hi: u32 }
// Sums over `slices` consecutive blocks of `count` elements.
struct SumParams { count: u32, slices: u32 }
struct ParamSumParams { count: u32, batch: u32, nstate: u32 }
// z_stride, z_col: z's row stride and first column (Mamba-1 decoding reads it in in_proj's output row); bc_stride,
// b_col, c_col: the same for B and C (in x_proj's output row).
struct StepParams { batch: u32, channels: u32, nstate: u32, z_stride: u32, z_col: u32, bc_stride: u32, b_col: u32,
                    c_col: u32 }

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
@group(0) @binding(16) var<storage, read_write> dB_part: array<f32>;  // [slices, B, L, N]
@group(0) @binding(17) var<storage, read_write> dC_part: array<f32>;  // [slices, B, L, N]
// [B, Dc, N + 2]: per batch row, ∂loss/∂A_log[d, :], then ∂loss/∂D[d], then ∂loss/∂delta_bias[d]
@group(0) @binding(18) var<storage, read_write> param_part: array<f32>;
@group(0) @binding(19) var<storage, read_write> tile_states: array<f32>;  // the CPU kernels' scratch
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
@group(0) @binding(30) var<storage, read_write> carry: array<f32>;  // backward segments' carried sums
// The GPU kernels' views: B and C as vec4 rows (bound to the same buffers; read where N = 4·LP) and the
// backward's state slots [B, Dc·LP / WG, L / SUB, WG] of vec4.
@group(0) @binding(32) var<storage, read> B4: array<vec4<f32>>;
@group(0) @binding(33) var<storage, read> C4: array<vec4<f32>>;
@group(0) @binding(34) var<storage, read_write> slots: array<vec4<f32>>;
// The subgroup kernels' vec4 views (lavapipe moves a vec4 for about the price of two scalar loads or stores:
// ~12 ns per 8-lane scalar load, ~24 per vec4, bench-style micro-kernels): states and saved_states as vec4 where
// N is a multiple of 4 (the wrapper binds the same tensors to both names), and the backward's scratch.
@group(0) @binding(35) var<storage, read_write> states4: array<vec4<f32>>;
@group(0) @binding(36) var<storage, read> saved_states4: array<vec4<f32>>;
@group(0) @binding(37) var<storage, read_write> scratch4: array<vec4<f32>>;
// The subgroup kernels (CPU adapters) read the per-step inputs through textures (texture.wgsl).
@group(0) @binding(38) var u_tex: texture_2d<f32>;
@group(0) @binding(39) var delta_tex: texture_2d<f32>;
@group(0) @binding(40) var z_tex: texture_2d<f32>;
@group(0) @binding(41) var dy_tex: texture_2d<f32>;
@group(0) @binding(42) var B_tex: texture_2d<f32>;
@group(0) @binding(43) var C_tex: texture_2d<f32>;
// selective_scan_sum_slices' texture and vec4 view (CPU adapters).
@group(0) @binding(44) var part_tex: texture_2d<f32>;
@group(0) @binding(45) var<storage, read_write> total4: array<vec4<f32>>;
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
    let bn = b * st.bc_stride + st.b_col;
    let cn = b * st.bc_stride + st.c_col;
    for (var n = 0u; n < st.nstate; n++) {
        let k = i * st.nstate + n;
        let h = exp(-dt * exp(A_log[d * st.nstate + n])) * state[k] + dt * B[bn + n] * uv;
        state[k] = h;
        acc += C[cn + n] * h;
    }
    let zv = z[b * st.z_stride + st.z_col + d];
    y[i] = acc * zv * sigmoid(zv);
}

// --- GPUs: lanes of a subgroup per channel (see the top) ---------------------------------------------------------
// The lane's 4 states of row `base` of B, C or saved_states, and of A (0 past N; clamped loads, no branches).
fn lane_states_B(base: u32, cl: u32) -> vec4<f32> {
    let n = 4u * cl;
    if (4u * LP == N) { return B4[(base + n) / 4u]; }
    return vec4<f32>(select(0.0, B[base + min(n, N - 1u)], n < N),
                     select(0.0, B[base + min(n + 1u, N - 1u)], n + 1u < N),
                     select(0.0, B[base + min(n + 2u, N - 1u)], n + 2u < N),
                     select(0.0, B[base + min(n + 3u, N - 1u)], n + 3u < N));
}
fn lane_states_C(base: u32, cl: u32) -> vec4<f32> {
    let n = 4u * cl;
    if (4u * LP == N) { return C4[(base + n) / 4u]; }
    return vec4<f32>(select(0.0, C[base + min(n, N - 1u)], n < N),
                     select(0.0, C[base + min(n + 1u, N - 1u)], n + 1u < N),
                     select(0.0, C[base + min(n + 2u, N - 1u)], n + 2u < N),
                     select(0.0, C[base + min(n + 3u, N - 1u)], n + 3u < N));
}
fn lane_states_saved(base: u32, cl: u32) -> vec4<f32> {
    let n = 4u * cl;
    if (4u * LP == N) {
        return vec4<f32>(saved_states[base + n], saved_states[base + n + 1u], saved_states[base + n + 2u],
                         saved_states[base + n + 3u]);
    }
    return vec4<f32>(select(0.0, saved_states[base + min(n, N - 1u)], n < N),
                     select(0.0, saved_states[base + min(n + 1u, N - 1u)], n + 1u < N),
                     select(0.0, saved_states[base + min(n + 2u, N - 1u)], n + 2u < N),
                     select(0.0, saved_states[base + min(n + 3u, N - 1u)], n + 3u < N));
}
fn lane_neg_exp_A(d: u32, cl: u32) -> vec4<f32> {
    let base = d * N;
    let n = 4u * cl;
    return vec4<f32>(select(0.0, -exp(A_log[base + min(n, N - 1u)]), n < N),
                     select(0.0, -exp(A_log[base + min(n + 1u, N - 1u)]), n + 1u < N),
                     select(0.0, -exp(A_log[base + min(n + 2u, N - 1u)]), n + 2u < N),
                     select(0.0, -exp(A_log[base + min(n + 3u, N - 1u)]), n + 3u < N));
}


// What the owner lane of a step computes for the channel (row: its [B, L, Dc] index).
struct OwnedStep { x: f32, dt: f32, uv: f32, dtu: f32, dyg: f32, dzg: f32, dsp: f32 }

fn owned_step(x: f32, uv: f32, zv: f32, dyv: f32, grad: bool) -> OwnedStep {
    var o: OwnedStep;
    o.x = x;
    o.uv = uv;
    o.dt = softplus(x);
    o.dtu = o.dt * uv;
    if (grad) {
        let gate = sigmoid(zv);
        o.dyg = dyv * zv * gate;                          // dy through the gate
        o.dzg = dyv * gate * (1.0 + zv * sigmoid(-zv));   // dz is this times the ungated y
        o.dsp = select(sigmoid(x), 1.0, x > 20.0);        // ∂Δ/∂delta
    }
    return o;
}

// The loads of a walk group (4 steps from row bc of B): the owner's delta + bias and u, B_t at the lane's states.
struct WalkLoads { x: f32, uv: f32, B0: vec4<f32>, B1: vec4<f32>, B2: vec4<f32>, B3: vec4<f32> }

fn walk_loads(row: u32, bias: f32, bc: u32, cl: u32) -> WalkLoads {
    return WalkLoads(delta[row] + bias, u[row], lane_states_B(bc, cl), lane_states_B(bc + N, cl),
                     lane_states_B(bc + 2u * N, cl), lane_states_B(bc + 3u * N, cl));
}

// The loads of a backward sub-tile: the owner's delta + bias, u, z, dy; the entry state (slot e); B_t, C_t of
// its steps (steps past n_in repeat the last: rows bc + i·N with i clamped).
struct SubLoads { x: f32, uv: f32, zv: f32, dyv: f32, h0: vec4<f32>, B0: vec4<f32>, B1: vec4<f32>, B2: vec4<f32>,
                  B3: vec4<f32>, C0: vec4<f32>, C1: vec4<f32>, C2: vec4<f32>, C3: vec4<f32> }

fn sub_loads(row: u32, bias: f32, e: u32, bc: u32, n_in: u32, cl: u32) -> SubLoads {
    let b1 = bc + min(1u, n_in - 1u) * N;
    let b2 = bc + min(2u, n_in - 1u) * N;
    let b3 = bc + min(3u, n_in - 1u) * N;
    return SubLoads(delta[row] + bias, u[row], z[row], dy[row], slots[e],
                    lane_states_B(bc, cl), lane_states_B(b1, cl), lane_states_B(b2, cl), lane_states_B(b3, cl),
                    lane_states_C(bc, cl), lane_states_C(b1, cl), lane_states_C(b2, cl), lane_states_C(b3, cl));
}

// The loads of the chunk's sub-tile jj (1-based; one before the last: whole) for the backward.
fn sub_loads_whole(b: u32, chunk_start: u32, jj: u32, dd: u32, bias: f32, scratch: u32, cl: u32) -> SubLoads {
    let t = chunk_start + (jj - 1u) * SUB;
    return sub_loads(row_index(b, t + min(cl, SUB - 1u), dd), bias, scratch + (jj - 1u) * WG, (b * p.len + t) * N,
                     SUB, cl);
}

// Σ over the subgroup's CPS channels of one step's dB (db) and dC (dc) at the lane's states, by a transposing
// butterfly over the channel bits of the lane (highest first: dB or dC, then the high and the low half of the
// lane's 4 states); each sum lands in one lane, which stores it at e = ((slice·B + b)·L + t)·N + 4q. The order
// of every addition is fixed by the lane numbers, so the partials are deterministic.
fn channel_sums_store(e: u32, cl: u32, lane: u32, db: vec4<f32>, dc: vec4<f32>, store: bool) {
    let n = 4u * cl;
    if (SG / LP == 1u) {
        if (store) {
            if (n < N) { dB_part[e] = db.x; dC_part[e] = dc.x; }
            if (n + 1u < N) { dB_part[e + 1u] = db.y; dC_part[e + 1u] = dc.y; }
            if (n + 2u < N) { dB_part[e + 2u] = db.z; dC_part[e + 2u] = dc.z; }
            if (n + 3u < N) { dB_part[e + 3u] = db.w; dC_part[e + 3u] = dc.w; }
        }
        return;
    }
    let is_c = (lane & (SG / 2u)) != 0u;
    let v4 = select(db, dc, is_c) + subgroupShuffleXor(select(dc, db, is_c), SG / 2u);
    if (SG / LP == 2u) {
        if (store) {
            if (is_c) {
                if (n < N) { dC_part[e] = v4.x; }
                if (n + 1u < N) { dC_part[e + 1u] = v4.y; }
                if (n + 2u < N) { dC_part[e + 2u] = v4.z; }
                if (n + 3u < N) { dC_part[e + 3u] = v4.w; }
            } else {
                if (n < N) { dB_part[e] = v4.x; }
                if (n + 1u < N) { dB_part[e + 1u] = v4.y; }
                if (n + 2u < N) { dB_part[e + 2u] = v4.z; }
                if (n + 3u < N) { dB_part[e + 3u] = v4.w; }
            }
        }
        return;
    }
    let hi = (lane & (SG / 4u)) != 0u;
    let v2 = select(v4.xy, v4.zw, hi) + subgroupShuffleXor(select(v4.zw, v4.xy, hi), SG / 4u);
    let j2 = n + select(0u, 2u, hi);
    if (SG / LP == 4u) {
        if (store) {
            if (is_c) {
                if (j2 < N) { dC_part[e + j2 - n] = v2.x; }
                if (j2 + 1u < N) { dC_part[e + j2 - n + 1u] = v2.y; }
            } else {
                if (j2 < N) { dB_part[e + j2 - n] = v2.x; }
                if (j2 + 1u < N) { dB_part[e + j2 - n + 1u] = v2.y; }
            }
        }
        return;
    }
    let odd = (lane & (SG / 8u)) != 0u;
    var v1 = select(v2.x, v2.y, odd) + subgroupShuffleXor(select(v2.y, v2.x, odd), SG / 8u);
    for (var m = SG / 16u; m >= LP; m >>= 1u) { v1 += subgroupShuffleXor(v1, m); }  // CPS > 8: plain butterflies
    let j1 = j2 + select(0u, 1u, odd);
    // One lane per sum stores (with CPS > 8 the lanes below SG / 8 above the channel's hold copies).
    if (store && (lane & (SG / 8u - 1u) & ~(LP - 1u)) == 0u && j1 < N) {
        if (is_c) { dC_part[e + j1 - n] = v1; } else { dB_part[e + j1 - n] = v1; }
    }
}

// The sums over n of a sub-tile: yc, gb, gha hold, per step s (component s), the lane's share of C_t·h_t,
// g_t·B_t and Σ_n gh_t A. A transposing butterfly over lane bits 1 and 0 (then plain ones over the channel's
// higher lane bits) leaves step (cl mod 4)'s three sums in lane cl: (yc, gb, gha).
fn lane_step_sums(cl: u32, yc: vec4<f32>, gb: vec4<f32>, gha: vec4<f32>) -> vec3<f32> {
    let hi = (cl & 2u) != 0u;
    let yc2 = select(yc.xy, yc.zw, hi) + subgroupShuffleXor(select(yc.zw, yc.xy, hi), 2u);
    let gb2 = select(gb.xy, gb.zw, hi) + subgroupShuffleXor(select(gb.zw, gb.xy, hi), 2u);
    let gha2 = select(gha.xy, gha.zw, hi) + subgroupShuffleXor(select(gha.zw, gha.xy, hi), 2u);
    let odd = (cl & 1u) != 0u;
    let mine = vec3<f32>(select(yc2.x, yc2.y, odd), select(gb2.x, gb2.y, odd), select(gha2.x, gha2.y, odd));
    let other = vec3<f32>(select(yc2.y, yc2.x, odd), select(gb2.y, gb2.x, odd), select(gha2.y, gha2.x, odd));
    var s = mine + subgroupShuffleXor(other, 1u);
    for (var m = SUB; m < LP; m <<= 1u) { s += subgroupShuffleXor(s, m); }
    return s;
}

// Σ over the channel's LP lanes (a butterfly; every lane gets the same sum).
fn channel_sum(v: vec2<f32>) -> vec2<f32> {
    var s = v;
    for (var m = 1u; m < LP; m <<= 1u) { s += subgroupShuffleXor(s, m); }
    return s;
}

// The adjoint of one step, private so that the step helper shares them.
var<private> lb_g: vec4<f32>;   // g = ∂loss/∂h, carried backwards over steps and chunks
var<private> lb_da: vec4<f32>;  // Σ_t g_t exp(Δ_t A) h_{t−1} Δ_t = ∂loss/∂A[d, n] for this batch row

// Step t of a sub-tile, backwards: h = h_t, prev = h_{t−1}; (dt, dtu, dyg) of the step (broadcast from its
// owner). Updates g and the ∂/∂A sum, stores the step's dB / dC partials and returns the lane's shares of
// (C_t·h_t, g_t·B_t, Σ_n gh_t A).
fn lanes_adjoint_step(h: vec4<f32>, prev: vec4<f32>, decay: vec4<f32>, Bt: vec4<f32>, Ct: vec4<f32>, a: vec4<f32>,
                      dt: f32, dtu: f32, dyg: f32, e: u32, cl: u32, lane: u32, live: f32, store: bool) -> vec3<f32> {
    let gn = lb_g + dyg * Ct;
    let gh = gn * decay * prev;  // ∂loss/∂(Δ_t A)
    lb_da += gh * dt;
    channel_sums_store(e, cl, lane, gn * (dtu * live), h * (dyg * live), store);
    lb_g = gn * decay;
    return vec3<f32>(dot(Ct, h), dot(gn, Bt), dot(gh, a));
}

// The forward (grid (ceil(Dc·LP / WG), B)): steps [seg_begin, seg_end) in sub-tiles of SUB steps, the owner lane
// of each step computing Δ and Δ·u for the channel (broadcast by subgroupShuffle) and writing its y from the
// sub-tile's sums over n (one transposing butterfly, as lane_step_sums). Saves the state entering each chunk
// and the last state as the CPU adapters' forwards.
struct FwdLoads { x: f32, uv: f32, zv: f32, B0: vec4<f32>, B1: vec4<f32>, B2: vec4<f32>, B3: vec4<f32>, C0: vec4<f32>,
                  C1: vec4<f32>, C2: vec4<f32>, C3: vec4<f32> }

fn fwd_loads(row: u32, bias: f32, bc: u32, n_in: u32, cl: u32) -> FwdLoads {
    let b1 = bc + min(1u, n_in - 1u) * N;
    let b2 = bc + min(2u, n_in - 1u) * N;
    let b3 = bc + min(3u, n_in - 1u) * N;
    return FwdLoads(delta[row] + bias, u[row], z[row], lane_states_B(bc, cl), lane_states_B(b1, cl),
                    lane_states_B(b2, cl), lane_states_B(b3, cl), lane_states_C(bc, cl), lane_states_C(b1, cl),
                    lane_states_C(b2, cl), lane_states_C(b3, cl));
}

// The loads of the forward's sub-tile at step t (steps before `end`).
fn fwd_loads_at(b: u32, t: u32, end: u32, dd: u32, bias: f32, cl: u32) -> FwdLoads {
    let n_in = min(SUB, end - t);
    return fwd_loads(row_index(b, t + min(cl, n_in - 1u), dd), bias, (b * p.len + t) * N, n_in, cl);
}

// Σ over the channel's lanes of the 4 steps' shares (component s: step s); lane cl gets step cl mod 4's sum.
fn lane_step_sum(cl: u32, v: vec4<f32>) -> f32 {
    let hi = (cl & 2u) != 0u;
    let v2 = select(v.xy, v.zw, hi) + subgroupShuffleXor(select(v.zw, v.xy, hi), 2u);
    let odd = (cl & 1u) != 0u;
    var s = select(v2.x, v2.y, odd) + subgroupShuffleXor(select(v2.y, v2.x, odd), 1u);
    for (var m = SUB; m < LP; m <<= 1u) { s += subgroupShuffleXor(s, m); }
    return s;
}

fn lane_states_store_states(e: u32, cl: u32, h: vec4<f32>) {
    let n = 4u * cl;
    if (n < N) { states[e + n] = h.x; }
    if (n + 1u < N) { states[e + n + 1u] = h.y; }
    if (n + 2u < N) { states[e + n + 2u] = h.z; }
    if (n + 3u < N) { states[e + n + 3u] = h.w; }
}
fn lane_states_store_last(e: u32, cl: u32, h: vec4<f32>) {
    let n = 4u * cl;
    if (n < N) { last_state[e + n] = h.x; }
    if (n + 1u < N) { last_state[e + n + 1u] = h.y; }
    if (n + 2u < N) { last_state[e + n + 2u] = h.z; }
    if (n + 3u < N) { last_state[e + n + 3u] = h.w; }
}

// The forward walks with exp2(Δ · A log2(e)): the scaled A once per lane saves a multiply per state and step.
const LOG2E: f32 = 1.4426950408889634;

// A forward sub-tile of n_in steps from h (exp2 of Δ·a2, a2 = A log2(e)): the state after it and the lane's
// shares of C_t·h_t (component s: step s).
struct FwdTile { h: vec4<f32>, yc: vec4<f32> }

fn forward_sub_tile(h0: vec4<f32>, ld: FwdLoads, o: OwnedStep, a2: vec4<f32>, first: u32, n_in: u32) -> FwdTile {
    var h = h0;
    var yc = vec4<f32>(0.0);
    h = exp2(subgroupShuffle(o.dt, first) * a2) * h + subgroupShuffle(o.dtu, first) * ld.B0;
    yc.x = dot(ld.C0, h);
    if (n_in > 1u) {
        h = exp2(subgroupShuffle(o.dt, first + 1u) * a2) * h + subgroupShuffle(o.dtu, first + 1u) * ld.B1;
        yc.y = dot(ld.C1, h);
    }
    if (n_in > 2u) {
        h = exp2(subgroupShuffle(o.dt, first + 2u) * a2) * h + subgroupShuffle(o.dtu, first + 2u) * ld.B2;
        yc.z = dot(ld.C2, h);
    }
    if (n_in > 3u) {
        h = exp2(subgroupShuffle(o.dt, first + 3u) * a2) * h + subgroupShuffle(o.dtu, first + 3u) * ld.B3;
        yc.w = dot(ld.C3, h);
    }
    return FwdTile(h, yc);
}

// A forward lane's constants: batch row, channel (dd: clamped to the last past Dc), lane in the channel, the
// channel's lane 0, A log2(e), delta_bias, D.
struct FwdLane { b: u32, d: u32, dd: u32, cl: u32, first: u32, valid: bool, a2: vec4<f32>, bias: f32, skip: f32 }

// The forward's sub-tile at step t (steps before `end`) from h and its loads: saves h where t starts a chunk,
// walks it and writes its y. -> h after it.
fn forward_emit(h0: vec4<f32>, t: u32, end: u32, ld: FwdLoads, w: FwdLane) -> vec4<f32> {
    if (t % p.chunk == 0u && w.valid) {
        lane_states_store_states(((w.b * p.nchunks + t / p.chunk) * p.channels + w.d) * N, w.cl, h0);
    }
    let n_in = min(SUB, end - t);  // uniform
    let own_row = row_index(w.b, t + min(w.cl, n_in - 1u), w.dd);
    let o = owned_step(ld.x, ld.uv, 0.0, 0.0, false);
    var tile: FwdTile;
    if (n_in == SUB) { tile = forward_sub_tile(h0, ld, o, w.a2, w.first, SUB); }  // straight-line steps
    else { tile = forward_sub_tile(h0, ld, o, w.a2, w.first, n_in); }
    let acc = lane_step_sum(w.cl, tile.yc);
    if (w.cl < n_in && w.valid) { y[own_row] = (w.skip * ld.uv + acc) * ld.zv * sigmoid(ld.zv); }
    return tile.h;
}

// Steps [begin, end) (begin a multiple of SUB) from h in pairs of sub-tiles, each with a load buffer of its own
// (even, odd) reloaded right after its sub-tile ran, so no load still in flight is ever copied. -> h after.
fn forward_walk_pairs(h0: vec4<f32>, begin: u32, end: u32, w: FwdLane) -> vec4<f32> {
    var h = h0;
    var even: FwdLoads;
    var odd: FwdLoads;
    if (begin < end) { even = fwd_loads_at(w.b, begin, end, w.dd, w.bias, w.cl); }
    if (begin + SUB < end) { odd = fwd_loads_at(w.b, begin + SUB, end, w.dd, w.bias, w.cl); }
    for (var t = begin; t < end; t += 2u * SUB) {
        h = forward_emit(h, t, end, even, w);
        if (t + 2u * SUB < end) { even = fwd_loads_at(w.b, t + 2u * SUB, end, w.dd, w.bias, w.cl); }
        if (t + SUB < end) {
            h = forward_emit(h, t + SUB, end, odd, w);
            if (t + 3u * SUB < end) { odd = fwd_loads_at(w.b, t + 3u * SUB, end, w.dd, w.bias, w.cl); }
        }
    }
    return h;
}

// The forward's entry point: h entering from last_state when seg_begin > 0, then the walk.
@compute @workgroup_size(128)
fn selective_scan_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let thread = lid.x;
    let cl = thread % LP;
    let d = wid.x * (WG / LP) + thread / LP;
    let dd = min(d, p.channels - 1u);
    let w = FwdLane(wid.y, d, dd, cl, thread % SG - cl, d < p.channels, lane_neg_exp_A(dd, cl) * LOG2E,
                    delta_bias[dd], D[dd]);
    let sb = (w.b * p.channels + dd) * N;
    var h = vec4<f32>(0.0);
    if (p.seg_begin > 0u) {
        let n = 4u * cl;
        h = vec4<f32>(select(0.0, last_state[sb + min(n, N - 1u)], n < N),
                      select(0.0, last_state[sb + min(n + 1u, N - 1u)], n + 1u < N),
                      select(0.0, last_state[sb + min(n + 2u, N - 1u)], n + 2u < N),
                      select(0.0, last_state[sb + min(n + 3u, N - 1u)], n + 3u < N));
    }
    h = forward_walk_pairs(h, p.seg_begin, p.seg_end, w);
    if (w.valid) { lane_states_store_last(sb, cl, h); }
}

// Grid (ceil(Dc·LP / WG), B, kc_hi − kc_lo): the walk of chunk k = kc_lo + wid.z (0-based) from its saved entry
// state, storing the state entering each of its sub-tiles at slots[((b·groups + group)·(kc_hi − kc_lo) +
// wid.z)·per_chunk + i][thread], each walk group's loads issued one group ahead.
@compute @workgroup_size(128)
fn selective_scan_backward_walk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                                @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let k = p.kc_lo + wid.z;  // chunks kc_lo .. kc_hi − 1 (0-based), the backward segment's
    let thread = lid.x;
    let cl = thread % LP;
    let first = thread % SG - cl;  // the channel's lane 0
    let dd = min(wid.x * (WG / LP) + thread / LP, p.channels - 1u);
    let a = lane_neg_exp_A(dd, cl);
    let bias = delta_bias[dd];
    let chunk_start = k * p.chunk;
    let last = (min(p.chunk, p.len - chunk_start) - 1u) / SUB * SUB;  // the last sub-tile's first step
    let per_chunk = (min(p.chunk, p.len) + SUB - 1u) / SUB;
    let e0 = ((b * nwg.x + wid.x) * (p.kc_hi - p.kc_lo) + wid.z) * per_chunk * WG + thread;
    var h = lane_states_saved(((b * p.nchunks + k) * p.channels + dd) * N, cl);
    var next: WalkLoads;
    if (last > 0u) {
        next = walk_loads(row_index(b, chunk_start + min(cl, SUB - 1u), dd), bias, (b * p.len + chunk_start) * N, cl);
    }
    for (var s0 = 0u; s0 < last; s0 += SUB) {  // whole sub-tiles only
        let t = chunk_start + s0;
        slots[e0 + (s0 / SUB) * WG] = h;
        let w = next;
        if (s0 + SUB < last) {
            next = walk_loads(row_index(b, t + SUB + min(cl, SUB - 1u), dd), bias, (b * p.len + t + SUB) * N, cl);
        }
        let o = owned_step(w.x, w.uv, 0.0, 0.0, false);
        h = exp(subgroupShuffle(o.dt, first) * a) * h + subgroupShuffle(o.dtu, first) * w.B0;
        h = exp(subgroupShuffle(o.dt, first + 1u) * a) * h + subgroupShuffle(o.dtu, first + 1u) * w.B1;
        h = exp(subgroupShuffle(o.dt, first + 2u) * a) * h + subgroupShuffle(o.dtu, first + 2u) * w.B2;
        h = exp(subgroupShuffle(o.dt, first + 3u) * a) * h + subgroupShuffle(o.dtu, first + 3u) * w.B3;
    }
    slots[e0 + (last / SUB) * WG] = h;
}

// The adjoint of a backward sub-tile of n_in steps (loads ld, the owner's terms o): updates g and the ∂/∂A sum,
// writes the steps' dz, du, ddelta and dB / dC partials (e: the partials' index of its first step) and returns
// the lane's step's (dy'·u, ddelta) for the ∂/∂D, ∂/∂delta_bias sums (0 for lanes past n_in).
fn adjoint_sub_tile(ld: SubLoads, o: OwnedStep, n_in: u32, a: vec4<f32>, skip: f32, first: u32, cl: u32, lane: u32,
                    e: u32, own_row: u32, valid: bool, live: f32, slice_ok: bool) -> vec2<f32> {
    // Steps past n_in repeat the last one (their results are not used).
    let i1 = min(1u, n_in - 1u);
    let i2 = min(2u, n_in - 1u);
    let i3 = min(3u, n_in - 1u);
    let dt0 = subgroupShuffle(o.dt, first);
    let dt1 = subgroupShuffle(o.dt, first + i1);
    let dt2 = subgroupShuffle(o.dt, first + i2);
    let dt3 = subgroupShuffle(o.dt, first + i3);
    let dtu0 = subgroupShuffle(o.dtu, first);
    let dtu1 = subgroupShuffle(o.dtu, first + i1);
    let dtu2 = subgroupShuffle(o.dtu, first + i2);
    let dtu3 = subgroupShuffle(o.dtu, first + i3);
    let decay0 = exp(dt0 * a);
    let decay1 = exp(dt1 * a);
    let decay2 = exp(dt2 * a);
    let decay3 = exp(dt3 * a);
    let h0 = ld.h0;
    let h1 = decay0 * h0 + dtu0 * ld.B0;
    let h2 = decay1 * h1 + dtu1 * ld.B1;
    let h3 = decay2 * h2 + dtu2 * ld.B2;
    let h4 = decay3 * h3 + dtu3 * ld.B3;
    var r3 = vec3<f32>(0.0);
    var r2 = vec3<f32>(0.0);
    var r1 = vec3<f32>(0.0);
    if (n_in > 3u) {
        r3 = lanes_adjoint_step(h4, h3, decay3, ld.B3, ld.C3, a, dt3, dtu3, subgroupShuffle(o.dyg, first + 3u),
                                e + 3u * N, cl, lane, live, slice_ok);
    }
    if (n_in > 2u) {
        r2 = lanes_adjoint_step(h3, h2, decay2, ld.B2, ld.C2, a, dt2, dtu2, subgroupShuffle(o.dyg, first + 2u),
                                e + 2u * N, cl, lane, live, slice_ok);
    }
    if (n_in > 1u) {
        r1 = lanes_adjoint_step(h2, h1, decay1, ld.B1, ld.C1, a, dt1, dtu1, subgroupShuffle(o.dyg, first + 1u),
                                e + N, cl, lane, live, slice_ok);
    }
    let r0 = lanes_adjoint_step(h1, h0, decay0, ld.B0, ld.C0, a, dt0, dtu0, subgroupShuffle(o.dyg, first),
                                e, cl, lane, live, slice_ok);
    let own = lane_step_sums(cl, vec4<f32>(r0.x, r1.x, r2.x, r3.x), vec4<f32>(r0.y, r1.y, r2.y, r3.y),
                             vec4<f32>(r0.z, r1.z, r2.z, r3.z));  // (yc, gb, gha) of step cl
    if (cl >= n_in) { return vec2<f32>(0.0); }
    let dx = (own.z + o.uv * own.y) * o.dsp;
    if (valid) {
        dz[own_row] = (skip * o.uv + own.x) * o.dzg;
        du[own_row] = skip * o.dyg + o.dt * own.y;
        ddelta[own_row] = dx;
    }
    return vec2<f32>(o.dyg * o.uv, dx);
}

// The chunk's backward sub-tile j (1-based; `steps` in the chunk) from its loads: its adjoint.
fn adjoint_sub_tile_at(b: u32, chunk_start: u32, steps: u32, j: u32, ld: SubLoads, a: vec4<f32>, skip: f32, first: u32,
                       cl: u32, lane: u32, dd: u32, slice: u32, valid: bool, live: f32, slice_ok: bool) -> vec2<f32> {
    let s0 = (j - 1u) * SUB;
    let n_in = min(SUB, steps - s0);  // uniform
    let t = chunk_start + s0;
    let own_row = row_index(b, t + min(cl, n_in - 1u), dd);
    let o = owned_step(ld.x, ld.uv, ld.zv, ld.dyv, true);
    let e = ((slice * p.batch + b) * p.len + t) * N + 4u * cl;
    if (n_in == SUB) {  // straight-line steps
        return adjoint_sub_tile(ld, o, SUB, a, skip, first, cl, lane, e, own_row, valid, live, slice_ok);
    }
    return adjoint_sub_tile(ld, o, n_in, a, skip, first, cl, lane, e, own_row, valid, live, slice_ok);
}

// Grid (ceil(Dc·LP / WG), B): the adjoint, chunks last to first, each from the slots the walk stored.
@compute @workgroup_size(128)
fn selective_scan_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let thread = lid.x;
    let cl = thread % LP;
    let lane = thread % SG;
    let first = lane - cl;  // the channel's lane 0
    let d = wid.x * (WG / LP) + thread / LP;
    let valid = d < p.channels;
    let dd = min(d, p.channels - 1u);  // lanes past Dc compute on the last channel and store nothing
    let live = select(0.0, 1.0, valid);
    // The subgroup's slice of the partials; a subgroup with no channel inside Dc stores none.
    let slice = d / (SG / LP);
    let slice_ok = slice * (SG / LP) < p.channels;
    let a = lane_neg_exp_A(dd, cl);
    let bias = delta_bias[dd];
    let skip = D[dd];
    let per_chunk = (min(p.chunk, p.len) + SUB - 1u) / SUB;  // slots per chunk
    lb_g = vec4<f32>(0.0);
    lb_da = vec4<f32>(0.0);
    var sums = vec2<f32>(0.0);  // this lane's steps' Σ dy'·u (∂loss/∂D) and Σ ddelta (∂loss/∂delta_bias)
    let ci = ((b * nwg.x + wid.x) * WG + thread) * CARRY;
    if (p.kc_hi < p.nchunks) {
        lb_g = vec4<f32>(carry[ci], carry[ci + 1u], carry[ci + 2u], carry[ci + 3u]);
        lb_da = vec4<f32>(carry[ci + 4u], carry[ci + 5u], carry[ci + 6u], carry[ci + 7u]);
        sums = vec2<f32>(carry[ci + 8u], carry[ci + 9u]);
    }
    for (var k = min(p.kc_hi, p.nchunks); k > p.kc_lo; k--) {
        let chunk_start = (k - 1u) * p.chunk;
        let steps = min(p.chunk, p.len - chunk_start);
        let nsub = (steps + SUB - 1u) / SUB;
        let last = (nsub - 1u) * SUB;  // the last sub-tile's first step
        // The chunk's slots (the walk's of this segment's chunks).
        let scratch = ((b * nwg.x + wid.x) * (p.kc_hi - p.kc_lo) + k - 1u - p.kc_lo) * per_chunk * WG + thread;
        // Sub-tiles in pairs, each one's loads issued into a buffer of its own (even: the chunk's last sub-tile,
        // odd: the one before) right after that buffer's sub-tile ran, so no load still in flight is copied
        // (a rotation next -> current copies them at the loop's end, which waits for them). Three buffers, or
        // loads issued before the sub-tile they follow, are more registers than 3 workgroups per SM allow.
        var even = sub_loads(row_index(b, chunk_start + last + min(cl, steps - last - 1u), dd), bias,
                             scratch + (nsub - 1u) * WG, (b * p.len + chunk_start + last) * N, steps - last, cl);
        var odd: SubLoads;
        if (nsub > 1u) { odd = sub_loads_whole(b, chunk_start, nsub - 1u, dd, bias, scratch, cl); }
        for (var j = nsub; j > 0u; j = select(0u, j - 2u, j > 2u)) {
            sums += adjoint_sub_tile_at(b, chunk_start, steps, j, even, a, skip, first, cl, lane, dd, slice, valid,
                                        live, slice_ok);
            if (j > 2u) { even = sub_loads_whole(b, chunk_start, j - 2u, dd, bias, scratch, cl); }
            if (j > 1u) {
                sums += adjoint_sub_tile_at(b, chunk_start, steps, j - 1u, odd, a, skip, first, cl, lane, dd, slice,
                                            valid, live, slice_ok);
                if (j > 3u) { odd = sub_loads_whole(b, chunk_start, j - 3u, dd, bias, scratch, cl); }
            }
        }
    }
    if (p.kc_lo > 0u) {  // uniform: more chunks follow in another dispatch
        carry[ci] = lb_g.x; carry[ci + 1u] = lb_g.y; carry[ci + 2u] = lb_g.z; carry[ci + 3u] = lb_g.w;
        carry[ci + 4u] = lb_da.x; carry[ci + 5u] = lb_da.y; carry[ci + 6u] = lb_da.z; carry[ci + 7u] = lb_da.w;
        carry[ci + 8u] = sums.x;
        carry[ci + 9u] = sums.y;
        return;
    }
    let channel_sums = channel_sum(sums);
    if (!valid) { return; }
    let pb = (b * p.channels + d) * (N + 2u);
    let n = 4u * cl;
    let dA_log_part = lb_da * a;  // ∂/∂A_log = ∂/∂A · A
    if (n < N) { param_part[pb + n] = dA_log_part.x; }
    if (n + 1u < N) { param_part[pb + n + 1u] = dA_log_part.y; }
    if (n + 2u < N) { param_part[pb + n + 2u] = dA_log_part.z; }
    if (n + 3u < N) { param_part[pb + n + 3u] = dA_log_part.w; }
    if (cl == 0u) {
        param_part[pb + N] = channel_sums.x;
        param_part[pb + N + 1u] = channel_sums.y;
    }
}

// total[i] = Σ_k part[k·count + i] (dB, dC from the per-workgroup partials) in a fixed order: four running sums
// over k ≡ 0, 1, 2, 3 (mod 4), added as (s0 + s1) + (s2 + s3). Four loads in flight per thread where one running
// sum issues each load only after the last one arrived (~1.2 TB/s on an H200). TEXTURED (CPU adapters, count a
// multiple of 4): invocation i sums texel i of every slice of part_tex and stores vec4 i of total4 (the same
// buffer as total), the same sums per element; a texel fetch is a gather where a buffer load is a loop over the
// lanes per component. Grid grid_1d(count), or grid_1d(count / 4) when TEXTURED.
override TEXTURED: bool = false;
fn slice_part(k: u32, i: u32, count: u32) -> vec4<f32> {
    if (TEXTURED) { return texel(part_tex, k * (count / 4u) + i); }
    return vec4<f32>(part[k * count + i], 0.0, 0.0, 0.0);
}
@compute @workgroup_size(256)
fn selective_scan_sum_slices(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    let count = select(q.count, hidden(part_tex, q.count), TEXTURED);  // hidden: lavapipe recompiled it at every
    // dispatch without (texture.wgsl)
    let slices = select(q.slices, hidden(part_tex, q.slices), TEXTURED);
    if (i >= select(count, count / 4u, TEXTURED)) { return; }
    var s0 = vec4<f32>(0.0);
    var s1 = vec4<f32>(0.0);
    var s2 = vec4<f32>(0.0);
    var s3 = vec4<f32>(0.0);
    var k = 0u;
    for (; k + 4u <= slices; k += 4u) {
        s0 += slice_part(k, i, count);
        s1 += slice_part(k + 1u, i, count);
        s2 += slice_part(k + 2u, i, count);
        s3 += slice_part(k + 3u, i, count);
    }
    if (k < slices) { s0 += slice_part(k, i, count); }
    if (k + 1u < slices) { s1 += slice_part(k + 1u, i, count); }
    if (k + 2u < slices) { s2 += slice_part(k + 2u, i, count); }
    let s = (s0 + s1) + (s2 + s3);
    if (TEXTURED) { total4[i] = s; } else { total[i] = s.x; }
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

// z_stride, z_col (dz_stride, dz_col): z's (dz's) row stride and first column, so Mamba-1 reads z in place in
// in_proj's output and writes dz beside the conv's dx in in_proj's gradient (Dc and 0 for a [B, L, Dc] tensor).
struct DirectParams { batch: u32, len: u32, channels: u32, chunk: u32, nchunks: u32, seg_begin: u32, seg_end: u32,
                      kc_lo: u32, kc_hi: u32, ngroups: u32, per_thread: u32, z_stride: u32, z_col: u32,
                      dz_stride: u32, dz_col: u32 }
@group(0) @binding(31) var<uniform> dp: DirectParams;

fn direct_row(b: u32, t: u32, d: u32) -> u32 { return (b * dp.len + t) * dp.channels + d; }
fn z_row(b: u32, t: u32, d: u32) -> u32 { return (b * dp.len + t) * dp.z_stride + dp.z_col + d; }
fn dz_row(b: u32, t: u32, d: u32) -> u32 { return (b * dp.len + t) * dp.dz_stride + dp.dz_col + d; }

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
        let zv = z[z_row(b, t, d)];
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
                let zv = z[z_row(b, t, d)];
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
                dz[dz_row(b, t, d)] = (skip * uv + yc) * dzg;
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
// B_t or C_t (row bc of [B, L, N], in the texture t) in every lane: lane l loads states l and 8 + l (0 past N).
fn shared_state(t: texture_2d<f32>, bc: u32, lane: u32) -> State16 {
    let v0 = select(0.0, texture_elem(t, bc + min(lane, N - 1u)), lane < N);
    var v1 = 0.0;
    if (N > 8u) { v1 = select(0.0, texture_elem(t, bc + min(8u + lane, N - 1u)), 8u + lane < N); }
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
            let dt = softplus(texture_elem(delta_tex, row) + bias);
            let uv = texture_elem(u_tex, row);
            let bc = (b * dp.len + t) * N;
            h = s_add(s_mul(s_exp(s_scale(a, dt)), h), s_scale(shared_state(B_tex, bc, lane), dt * uv));
            let acc = s_dot(shared_state(C_tex, bc, lane), h);
            let zv = texture_elem(z_tex, z_row(b, t, d));
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
    let x = texture_elem(delta_tex, row) + sg_bias;
    let dt = softplus(x);
    let uv = texture_elem(u_tex, row);
    sg_terms = StepTerms(x, dt, uv, s_exp(s_scale(sg_a, dt)), shared_state(B_tex, (sg_b * dp.len + t) * N, sg_lane));
    return s_add(s_mul(sg_terms.decay, h), s_scale(sg_terms.Bt, dt * uv));
}

// The adjoint of step t: h is h_t, prev h_{t−1}; g_t becomes g_{t−1}, the sums grow, du, ddelta, dz and the
// dB / dC partials of step t are written.
fn sg_adjoint(t: u32, h: State16, prev: State16, terms: StepTerms) {
    let row = direct_row(sg_b, t, sg_d);
    let uv = terms.uv;
    let zv = texture_elem(z_tex, z_row(sg_b, t, sg_d));
    let dyv = texture_elem(dy_tex, row);
    let gate = sigmoid(zv);
    let dyg = dyv * zv * gate;                            // dy through the gate
    let dzg = dyv * gate * (1.0 + zv * sigmoid(-zv));     // dz is this times the ungated y
    let x = terms.x;
    let dt = terms.dt;
    let dsp = select(sigmoid(x), 1.0, x > 20.0);          // ∂Δ/∂delta
    let dtu = dt * uv;
    let Bt = terms.Bt;
    let Ct = shared_state(C_tex, (sg_b * dp.len + t) * N, sg_lane);
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
        dz[dz_row(sg_b, t, sg_d)] = (sg_skip * uv + yc) * dzg;
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
