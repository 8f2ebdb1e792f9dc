// Mamba-1 selective scan (S6), fused like mamba_ssm's selective_scan_fn with delta_softplus, and its exact
// backward. u, delta, z, y [B, L, Dc] (time-major rows); A_log [Dc, N]; B, C [B, L, N]; D, delta_bias [Dc]:
//   Δ = softplus(delta + delta_bias), A = −exp(A_log), h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t,
//   y_t = (C_t·h_t + D u_t) · silu(z_t).
//
// GPU kernels: Q threads per (batch b, channel d) walk time in order, each holding a block of NVT ≤ 4 vec4s of
// the channel's states in registers (vec4 jj = blk·NVT + j holds states 4·jj .. 4·jj + 3; states past N have
// a = 0 and B = C = 0, so they stay 0). The vec4s are named variables (h0 .. h3, ...), each step's work on one
// written once in a function taking pointers to them, because an array indexed by a loop counter stays in
// local memory wherever the driver does not unroll the loop (on the H200 a first version with such arrays ran
// 5× slower than the kernels it replaced). A workgroup is CW channels of one batch row, WG = CW·Q threads.
// At N ≤ 16 (Q = 1) the sums over n (y, du, ddelta, dz) stay inside a thread; with Q > 1 the threads' partial
// sums meet in workgroup memory. Only the sums over channels (dB, dC) always cross threads. Time goes in
// tiles of TS steps: a tile's B_t and C_t, which all the workgroup's channels use, are staged in workgroup
// memory by all threads at once, double-buffered so that a tile costs one barrier in the forward; each thread
// stages its channel's per-step inputs (Δ, u, z, ...), eight steps per pass so that their loads are in flight
// together (one step per pass would wait a global-load latency per step: the loop is not unrolled). Per state
// and step a thread issues about six instructions (one exp), where a thread per (b, d, n) with the sums over n
// across threads (the previous design) issued about three times as many.
// N, NV, NVP, Q, NVT, CW, WG and TS are pipeline constants (the workgroup arrays are sized by them); the
// wrapper picks them so that workgroup memory fits the device's limit.
// Memory: the forward saves only the state entering each chunk of `chunk` steps, states [B, n_chunks, Dc, N].
// The backward walks the chunks last to first: it recomputes the tile entry states of a chunk into tile_states
// (a global scratch [B, Dc / CW, tiles per chunk, N, CW], small enough to stay in L2), then for each tile, last
// to first, recomputes the tile's states h_t into h_tile and runs the adjoint
// g_t = ∂loss/∂h_t = C_t dy'_t + exp(Δ_{t+1} A) g_{t+1} backwards (dy' = dy·silu(z)), writing g_t into g_tile;
// after one barrier the workgroup sums dC_t[n] = Σ_c h_t[c, n] dy'_t[c] and dB_t[n] = Σ_c g_t[c, n] Δ_t u_t[c]
// over its channels from those tiles. Sums over channels go out as per-workgroup partials (dB_part, dC_part)
// and sums over batch as per-batch-row partials (param_part); second dispatches add them in a fixed order,
// so results are deterministic and there are no atomics.

override N: u32 = 16u;    // state size
override NV: u32 = 4u;    // ceil(N / 4): vec4s of state per channel
override Q: u32 = 1u;     // threads per channel
override NVT: u32 = 4u;   // ceil(NV / Q) ≤ 4: vec4s of state per thread
override NVP: u32 = 4u;   // Q·NVT ≥ NV: vec4s per channel in the workgroup tiles (the pad is zero)
override CW: u32 = 32u;   // channels per workgroup
override WG: u32 = 32u;   // CW·Q: threads per workgroup
override TS: u32 = 8u;    // steps per tile
override ACCUMULATE: bool = false;

// Segments (Mesa llvmpipe caps one invocation's loop iterations at 65,535 in total, so there the wrapper splits
// the walk over time into dispatches; elsewhere one dispatch covers it): the forward runs steps [seg_begin,
// seg_end) (multiples of TS), h entering from last_state when seg_begin > 0; the backward runs chunks kc_hi down to
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
@group(0) @binding(16) var<storage, read_write> dB_part: array<f32>;  // [Dc / CW, B, L, N]
@group(0) @binding(17) var<storage, read_write> dC_part: array<f32>;  // [Dc / CW, B, L, N]
// [B, Dc, N + 2]: per batch row, ∂loss/∂A_log[d, :], then ∂loss/∂D[d], then ∂loss/∂delta_bias[d]
@group(0) @binding(18) var<storage, read_write> param_part: array<f32>;
@group(0) @binding(19) var<storage, read_write> tile_states: array<f32>;  // [B, Dc / CW, tiles per chunk, N, CW]
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
@group(0) @binding(30) var<storage, read_write> carry: array<f32>;  // [B, Dc, 2N + 2]: backward segments
// B_t and C_t of a tile's steps, index ((buffer·TS + s)·2 + (0: B, 1: C))·NVP + jj (jj: vec4 of states); zero
// past N and past the tile's last step.
var<workgroup> bc_tile: array<vec4<f32>, 4u * TS * NVP>;
// A thread's own per-step inputs, index s·WG + thread (only that thread reads them).
var<workgroup> dt_own: array<f32, TS * WG>;         // Δ_t
var<workgroup> u_own: array<f32, TS * WG>;          // u_t
// gate_own: the forward's z_t; the backward's dy_t·silu'(z_t) (dz_t is this times the ungated y_t).
var<workgroup> gate_own: array<f32, TS * WG>;
var<workgroup> dsoftplus_own: array<f32, TS * WG>;  // ∂Δ_t/∂delta_t
// Per-step factors that the channel sums read across threads, double-buffered as bc_tile: index
// (buffer·TS + s)·(CW + 1) + c (`factor_index`; the pad puts the steps that the sums read at once in distinct banks).
// dyg_tile: dy'_t = dy_t·silu(z_t), the gradient reaching y before the gate; dtu_tile: Δ_t u_t.
var<workgroup> dyg_tile: array<f32, 2u * TS * (CW + 1u)>;
var<workgroup> dtu_tile: array<f32, 2u * TS * (CW + 1u)>;
// The backward's h_t and g_t of the tile's steps (g_tile holds exp(Δ_t A) until the adjoint reaches step t, so
// the adjoint takes no exp), index (s·NVP + jj)·(CW + 1) + c: the pad of one vec4 per row puts the channel
// sums' reads (row s·NVP + jj by one thread, one channel at a time) in distinct banks.
var<workgroup> h_tile: array<vec4<f32>, TS * NVP * (CW + 1u)>;
var<workgroup> g_tile: array<vec4<f32>, TS * NVP * (CW + 1u)>;
// Q > 1: each thread's part of the sums over n, index (buffer·TS + s)·WG + thread (the forward's C_t·h_t; the
// backward's C_t·h_t, Σ_n g B and Σ_n g exp(ΔA) h A, buffer 0 only).
var<workgroup> part_y: array<f32, 2u * TS * WG>;
var<workgroup> part_gb: array<f32, TS * WG>;
var<workgroup> part_gha: array<f32, TS * WG>;

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
// The four states of vec4 jj: which exist (n < N), and their indices base + n·stride (clamped to N − 1, so a
// masked lane reads in bounds).
fn lanes(jj: u32) -> vec4<bool> {
    let n = vec4<u32>(4u * jj) + vec4<u32>(0u, 1u, 2u, 3u);
    return n < vec4<u32>(N);
}
fn idx4(base: u32, stride: u32, jj: u32) -> vec4<u32> {
    let n = min(vec4<u32>(4u * jj) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(N - 1u));
    return vec4<u32>(base) + n * stride;
}

fn load4_A(d: u32, jj: u32) -> vec4<f32> {
    let i = idx4(d * N, 1u, jj);
    return select(vec4<f32>(0.0), -exp(vec4<f32>(A_log[i.x], A_log[i.y], A_log[i.z], A_log[i.w])), lanes(jj));
}
fn load4_last_state(base: u32, jj: u32) -> vec4<f32> {
    let i = idx4(base, 1u, jj);
    return select(vec4<f32>(0.0), vec4<f32>(last_state[i.x], last_state[i.y], last_state[i.z], last_state[i.w]),
                  lanes(jj));
}
fn load4_saved(base: u32, jj: u32) -> vec4<f32> {
    let i = idx4(base, 1u, jj);
    return select(vec4<f32>(0.0), vec4<f32>(saved_states[i.x], saved_states[i.y], saved_states[i.z],
                                            saved_states[i.w]), lanes(jj));
}
fn load4_carry(base: u32, jj: u32) -> vec4<f32> {
    let i = idx4(base, 1u, jj);
    return select(vec4<f32>(0.0), vec4<f32>(carry[i.x], carry[i.y], carry[i.z], carry[i.w]), lanes(jj));
}
fn load4_scratch(base: u32, jj: u32) -> vec4<f32> {  // tile_states, states CW apart
    let i = idx4(base, CW, jj);
    return select(vec4<f32>(0.0), vec4<f32>(tile_states[i.x], tile_states[i.y], tile_states[i.z],
                                            tile_states[i.w]), lanes(jj));
}
fn store4_states(base: u32, jj: u32, v: vec4<f32>) {
    let i = idx4(base, 1u, jj);
    let m = lanes(jj);
    if (m.x) { states[i.x] = v.x; }
    if (m.y) { states[i.y] = v.y; }
    if (m.z) { states[i.z] = v.z; }
    if (m.w) { states[i.w] = v.w; }
}
fn store4_last_state(base: u32, jj: u32, v: vec4<f32>) {
    let i = idx4(base, 1u, jj);
    let m = lanes(jj);
    if (m.x) { last_state[i.x] = v.x; }
    if (m.y) { last_state[i.y] = v.y; }
    if (m.z) { last_state[i.z] = v.z; }
    if (m.w) { last_state[i.w] = v.w; }
}
fn store4_carry(base: u32, jj: u32, v: vec4<f32>) {
    let i = idx4(base, 1u, jj);
    let m = lanes(jj);
    if (m.x) { carry[i.x] = v.x; }
    if (m.y) { carry[i.y] = v.y; }
    if (m.z) { carry[i.z] = v.z; }
    if (m.w) { carry[i.w] = v.w; }
}
fn store4_scratch(base: u32, jj: u32, v: vec4<f32>) {
    let i = idx4(base, CW, jj);
    let m = lanes(jj);
    if (m.x) { tile_states[i.x] = v.x; }
    if (m.y) { tile_states[i.y] = v.y; }
    if (m.z) { tile_states[i.z] = v.z; }
    if (m.w) { tile_states[i.w] = v.w; }
}
fn store4_param_part(base: u32, jj: u32, v: vec4<f32>) {
    let i = idx4(base, 1u, jj);
    let m = lanes(jj);
    if (m.x) { param_part[i.x] = v.x; }
    if (m.y) { param_part[i.y] = v.y; }
    if (m.z) { param_part[i.z] = v.z; }
    if (m.w) { param_part[i.w] = v.w; }
}

// Element i of a bc_tile buffer whose steps start at t0 (zero past t_end).
fn bc_item(b: u32, t0: u32, t_end: u32, i: u32) -> vec4<f32> {
    let t = t0 + i / (2u * NVP);
    let jj = i % NVP;
    let k = idx4((b * p.len + min(t, p.len - 1u)) * N, 1u, jj);
    let m = lanes(jj) & vec4<bool>(t < t_end);
    if ((i / NVP) % 2u == 1u) { return select(vec4<f32>(0.0), vec4<f32>(C[k.x], C[k.y], C[k.z], C[k.w]), m); }
    return select(vec4<f32>(0.0), vec4<f32>(B[k.x], B[k.y], B[k.z], B[k.w]), m);
}

// Stage B_t and C_t of batch row b for steps [t0, t_end) into buffer `buf` of bc_tile, two elements per thread
// and pass: a pass's loads are in flight together (a loop's next pass issues only after this one's stores).
fn stage_bc(b: u32, t0: u32, t_end: u32, buf: u32, thread: u32) {
    let base = buf * 2u * TS * NVP;
    let elements = 2u * TS * NVP;
    for (var i = thread; i < elements; i += 2u * WG) {
        let i1 = i + WG;
        let v0 = bc_item(b, t0, t_end, i);
        let v1 = bc_item(b, t0, t_end, min(i1, elements - 1u));
        bc_tile[base + i] = v0;
        if (i1 < elements) { bc_tile[base + i1] = v1; }
    }
}

// Rows of steps t .. t + 3 of channel d (clamped to `last`), and four values of a [B, L, Dc] input at them.
fn rows4(b: u32, d: u32, t: u32, last: u32) -> vec4<u32> {
    let ts = min(vec4<u32>(t) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
    return (vec4<u32>(b * p.len) + ts) * p.channels + vec4<u32>(d);
}
fn delta4(rw: vec4<u32>) -> vec4<f32> { return vec4<f32>(delta[rw.x], delta[rw.y], delta[rw.z], delta[rw.w]); }
fn u4(rw: vec4<u32>) -> vec4<f32> { return vec4<f32>(u[rw.x], u[rw.y], u[rw.z], u[rw.w]); }
fn z4(rw: vec4<u32>) -> vec4<f32> { return vec4<f32>(z[rw.x], z[rw.y], z[rw.z], z[rw.w]); }
fn dy4(rw: vec4<u32>) -> vec4<f32> { return vec4<f32>(dy[rw.x], dy[rw.y], dy[rw.z], dy[rw.w]); }

// A thread stages its channel's per-step inputs eight steps per pass (all their loads first, in flight
// together, then the stores), for steps [t0, t_end) of the tile; `own_*` stores one step at index i of the
// own tiles.
fn own_forward(i: u32, delta_v: f32, uv: f32, zv: f32, bias: f32) {
    dt_own[i] = softplus(delta_v + bias);
    u_own[i] = uv;
    gate_own[i] = zv;
}
fn stage_forward_inputs(b: u32, d: u32, t0: u32, t_end: u32, x: u32, bias: f32) {
    for (var t = t0; t < t_end; t += 8u) {
        let r0 = rows4(b, d, t, t_end - 1u);
        let r1 = rows4(b, d, t + 4u, t_end - 1u);
        let e0 = delta4(r0);
        let e1 = delta4(r1);
        let v0 = u4(r0);
        let v1 = u4(r1);
        let w0 = z4(r0);
        let w1 = z4(r1);
        let i = (t - t0) * WG + x;
        own_forward(i, e0.x, v0.x, w0.x, bias);
        if (t + 1u < t_end) { own_forward(i + WG, e0.y, v0.y, w0.y, bias); }
        if (t + 2u < t_end) { own_forward(i + 2u * WG, e0.z, v0.z, w0.z, bias); }
        if (t + 3u < t_end) { own_forward(i + 3u * WG, e0.w, v0.w, w0.w, bias); }
        if (t + 4u < t_end) { own_forward(i + 4u * WG, e1.x, v1.x, w1.x, bias); }
        if (t + 5u < t_end) { own_forward(i + 5u * WG, e1.y, v1.y, w1.y, bias); }
        if (t + 6u < t_end) { own_forward(i + 6u * WG, e1.z, v1.z, w1.z, bias); }
        if (t + 7u < t_end) { own_forward(i + 7u * WG, e1.w, v1.w, w1.w, bias); }
    }
}

fn own_entry(i: u32, delta_v: f32, uv: f32, bias: f32) {
    dt_own[i] = softplus(delta_v + bias);
    u_own[i] = uv;
}
fn stage_entry_inputs(b: u32, d: u32, t0: u32, t_end: u32, x: u32, bias: f32) {
    for (var t = t0; t < t_end; t += 8u) {
        let r0 = rows4(b, d, t, t_end - 1u);
        let r1 = rows4(b, d, t + 4u, t_end - 1u);
        let e0 = delta4(r0);
        let e1 = delta4(r1);
        let v0 = u4(r0);
        let v1 = u4(r1);
        let i = (t - t0) * WG + x;
        own_entry(i, e0.x, v0.x, bias);
        if (t + 1u < t_end) { own_entry(i + WG, e0.y, v0.y, bias); }
        if (t + 2u < t_end) { own_entry(i + 2u * WG, e0.z, v0.z, bias); }
        if (t + 3u < t_end) { own_entry(i + 3u * WG, e0.w, v0.w, bias); }
        if (t + 4u < t_end) { own_entry(i + 4u * WG, e1.x, v1.x, bias); }
        if (t + 5u < t_end) { own_entry(i + 5u * WG, e1.y, v1.y, bias); }
        if (t + 6u < t_end) { own_entry(i + 6u * WG, e1.z, v1.z, bias); }
        if (t + 7u < t_end) { own_entry(i + 7u * WG, e1.w, v1.w, bias); }
    }
}

// The backward's factors of one step: own tiles at i, and (thread blk = 0 of the channel) dy' and Δu at ib.
fn own_grad(i: u32, ib: u32, lead: bool, zv: f32, dyv: f32, delta_v: f32, uv: f32, bias: f32) {
    let gate = sigmoid(zv);
    let x_pre = delta_v + bias;
    let dt = softplus(x_pre);
    if (lead) {
        dyg_tile[ib] = dyv * zv * gate;
        dtu_tile[ib] = dt * uv;
    }
    gate_own[i] = dyv * gate * (1.0 + zv * sigmoid(-zv));  // 1 − σ(z) = σ(−z), no cancellation
    dt_own[i] = dt;
    u_own[i] = uv;
    dsoftplus_own[i] = select(sigmoid(x_pre), 1.0, x_pre > 20.0);
}
fn stage_grad_inputs(b: u32, d: u32, t0: u32, t_end: u32, buf: u32, x: u32, c: u32, lead: bool, bias: f32) {
    for (var t = t0; t < t_end; t += 8u) {
        let r0 = rows4(b, d, t, t_end - 1u);
        let r1 = rows4(b, d, t + 4u, t_end - 1u);
        let w0 = z4(r0);
        let w1 = z4(r1);
        let g0 = dy4(r0);
        let g1 = dy4(r1);
        let e0 = delta4(r0);
        let e1 = delta4(r1);
        let v0 = u4(r0);
        let v1 = u4(r1);
        let s = t - t0;
        let i = s * WG + x;
        let ib = factor_index(buf, s, c);
        let o = CW + 1u;  // factor_index's stride per step
        own_grad(i, ib, lead, w0.x, g0.x, e0.x, v0.x, bias);
        if (t + 1u < t_end) { own_grad(i + WG, ib + o, lead, w0.y, g0.y, e0.y, v0.y, bias); }
        if (t + 2u < t_end) { own_grad(i + 2u * WG, ib + 2u * o, lead, w0.z, g0.z, e0.z, v0.z, bias); }
        if (t + 3u < t_end) { own_grad(i + 3u * WG, ib + 3u * o, lead, w0.w, g0.w, e0.w, v0.w, bias); }
        if (t + 4u < t_end) { own_grad(i + 4u * WG, ib + 4u * o, lead, w1.x, g1.x, e1.x, v1.x, bias); }
        if (t + 5u < t_end) { own_grad(i + 5u * WG, ib + 5u * o, lead, w1.y, g1.y, e1.y, v1.y, bias); }
        if (t + 6u < t_end) { own_grad(i + 6u * WG, ib + 6u * o, lead, w1.z, g1.z, e1.z, v1.z, bias); }
        if (t + 7u < t_end) { own_grad(i + 7u * WG, ib + 7u * o, lead, w1.w, g1.w, e1.w, v1.w, bias); }
    }
}

fn factor_index(buf: u32, s: u32, c: u32) -> u32 { return (buf * TS + s) * (CW + 1u) + c; }

// Index of step s's B_t (its C_t follows NVP later) in bc_tile.
fn bc_index(buf: u32, s: u32) -> u32 { return (buf * TS + s) * 2u * NVP; }

// One step of one vec4 of states: h ← exp(Δ A) h + Δ u B; -> C·h.
fn advance(h: ptr<function, vec4<f32>>, a: vec4<f32>, dt: f32, dtu: f32, bv: vec4<f32>, cv: vec4<f32>) -> f32 {
    let hn = exp(dt * a) * (*h) + dtu * bv;
    *h = hn;
    return dot(cv, hn);
}

// The backward's states pass for one vec4: as `advance`, also keeping h_t and exp(Δ_t A) at `slot` of h_tile
// and g_tile.
fn advance_kept(h: ptr<function, vec4<f32>>, a: vec4<f32>, dt: f32, dtu: f32, bv: vec4<f32>, cv: vec4<f32>,
                slot: u32) -> f32 {
    let decay = exp(dt * a);
    let hn = decay * (*h) + dtu * bv;
    *h = hn;
    h_tile[slot] = hn;
    g_tile[slot] = decay;  // for the adjoint, which overwrites it with g_t
    return dot(cv, hn);
}

// One adjoint step of one vec4: g_t = g + dy' C_t (kept at `slot` of g_tile for dB), ∂/∂A += g_t exp(Δ_t A)
// h_{t−1} Δ_t, g ← g_t exp(Δ_t A). -> (Σ g_t B_t, Σ g_t exp(Δ_t A) h_{t−1} A) over the four states.
fn adjoint(g: ptr<function, vec4<f32>>, da: ptr<function, vec4<f32>>, a: vec4<f32>, dt: f32, dyg: f32,
           bv: vec4<f32>, cv: vec4<f32>, h_prev: vec4<f32>, slot: u32) -> vec2<f32> {
    let decay = g_tile[slot];  // exp(Δ_t A), from the states' pass
    let gt = *g + dyg * cv;
    let gh = gt * decay * h_prev;  // ∂loss/∂(Δ_t A)
    *da += gh * dt;
    g_tile[slot] = gt;
    *g = gt * decay;
    return vec2<f32>(dot(gt, bv), dot(gh, a));
}

// Grid (ceil(Dc / CW), B). Thread x: channel c = x / Q of the workgroup's, state block blk = x % Q.
@compute @workgroup_size(WG)
fn selective_scan_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let x = lid.x;
    let c = x / Q;
    let blk = x % Q;
    let d = wid.x * CW + c;
    let live = d < p.channels;
    let sbase = (b * p.channels + d) * N;  // (b, d, 0) in [B, Dc, N]
    let j0 = blk * NVT;                    // this thread's first vec4 of states
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var h0 = vec4<f32>(0.0);
    var h1 = vec4<f32>(0.0);
    var h2 = vec4<f32>(0.0);
    var h3 = vec4<f32>(0.0);
    var bias = 0.0;
    var skip = 0.0;
    if (live) {
        a0 = load4_A(d, j0);
        if (NVT > 1u) { a1 = load4_A(d, j0 + 1u); }
        if (NVT > 2u) { a2 = load4_A(d, j0 + 2u); }
        if (NVT > 3u) { a3 = load4_A(d, j0 + 3u); }
        if (p.seg_begin > 0u) {
            h0 = load4_last_state(sbase, j0);
            if (NVT > 1u) { h1 = load4_last_state(sbase, j0 + 1u); }
            if (NVT > 2u) { h2 = load4_last_state(sbase, j0 + 2u); }
            if (NVT > 3u) { h3 = load4_last_state(sbase, j0 + 3u); }
        }
        bias = delta_bias[d];
        skip = D[d];
    }
    var buf = 0u;
    for (var t0 = p.seg_begin; t0 < p.seg_end; t0 += TS) {
        let t_end = min(t0 + TS, p.seg_end);
        stage_bc(b, t0, t_end, buf, x);
        if (live) { stage_forward_inputs(b, d, t0, t_end, x, bias); }
        workgroupBarrier();  // bc_tile[buf] is staged; the other buffer may be refilled from here on
        if (live) {
            for (var t = t0; t < t_end; t++) {
                let s = t - t0;
                let i = s * WG + x;
                if (t % p.chunk == 0u) {
                    let cs = ((b * p.nchunks + t / p.chunk) * p.channels + d) * N;
                    store4_states(cs, j0, h0);
                    if (NVT > 1u) { store4_states(cs, j0 + 1u, h1); }
                    if (NVT > 2u) { store4_states(cs, j0 + 2u, h2); }
                    if (NVT > 3u) { store4_states(cs, j0 + 3u, h3); }
                }
                let dt = dt_own[i];
                let uv = u_own[i];
                let dtu = dt * uv;
                let bi = bc_index(buf, s) + j0;  // B_t of vec4 j0; C_t NVP later
                var yc = advance(&h0, a0, dt, dtu, bc_tile[bi], bc_tile[bi + NVP]);
                if (NVT > 1u) { yc += advance(&h1, a1, dt, dtu, bc_tile[bi + 1u], bc_tile[bi + NVP + 1u]); }
                if (NVT > 2u) { yc += advance(&h2, a2, dt, dtu, bc_tile[bi + 2u], bc_tile[bi + NVP + 2u]); }
                if (NVT > 3u) { yc += advance(&h3, a3, dt, dtu, bc_tile[bi + 3u], bc_tile[bi + NVP + 3u]); }
                if (Q == 1u) {
                    let zv = gate_own[i];
                    y[row_index(b, t, d)] = (yc + skip * uv) * zv * sigmoid(zv);
                } else {
                    part_y[buf * TS * WG + i] = yc;
                }
            }
        }
        if (Q > 1u) {
            workgroupBarrier();  // part_y[buf] is complete (double-buffered: the next tile writes the other)
            if (live && blk == 0u) {
                for (var t = t0; t < t_end; t++) {
                    let i = (t - t0) * WG + x;
                    var yc = 0.0;
                    for (var m = 0u; m < Q; m++) { yc += part_y[buf * TS * WG + i + m]; }  // threads x .. x + Q − 1
                    let zv = gate_own[i];
                    y[row_index(b, t, d)] = (yc + skip * u_own[i]) * zv * sigmoid(zv);
                }
            }
        }
        buf ^= 1u;
    }
    // The final state seeds recurrent decoding after a parallel prefill.
    if (live) {
        store4_last_state(sbase, j0, h0);
        if (NVT > 1u) { store4_last_state(sbase, j0 + 1u, h1); }
        if (NVT > 2u) { store4_last_state(sbase, j0 + 2u, h2); }
        if (NVT > 3u) { store4_last_state(sbase, j0 + 3u, h3); }
    }
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
// Grid (ceil(Dc / CW), B), threads as the forward's.
@compute @workgroup_size(WG)
fn selective_scan_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                           @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let x = lid.x;
    let c = x / Q;
    let blk = x % Q;
    let d = wid.x * CW + c;
    let live = d < p.channels;
    let j0 = blk * NVT;
    let nch = min(CW, p.channels - wid.x * CW);  // channels of this workgroup inside Dc
    let part_row = wid.x * p.batch + b;         // this workgroup's slice of dB_part / dC_part
    let tiles_per_chunk = (min(p.chunk, p.len) + TS - 1u) / TS;
    let scratch = (b * nwg.x + wid.x) * tiles_per_chunk * N * CW + c;  // + (tile·N + n)·CW in tile_states
    let cb = (b * p.channels + d) * (2u * N + 2u);  // this channel's row of carry: g, ∂/∂A, ∂/∂D, ∂/∂delta_bias
    let resume = live && p.kc_hi < p.nchunks;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    // g_t = ∂loss/∂h_t, carried backwards over tiles and chunks
    var g0 = vec4<f32>(0.0);
    var g1 = vec4<f32>(0.0);
    var g2 = vec4<f32>(0.0);
    var g3 = vec4<f32>(0.0);
    // Σ_t g_t exp(Δ_t A) h_{t−1} Δ_t = ∂loss/∂A[d, :] for this batch row
    var da0 = vec4<f32>(0.0);
    var da1 = vec4<f32>(0.0);
    var da2 = vec4<f32>(0.0);
    var da3 = vec4<f32>(0.0);
    var h0 = vec4<f32>(0.0);
    var h1 = vec4<f32>(0.0);
    var h2 = vec4<f32>(0.0);
    var h3 = vec4<f32>(0.0);
    // Σ_t dy'_t u_t = ∂loss/∂D and Σ_t ddelta_t = ∂loss/∂delta_bias, kept by the channel's thread blk = 0.
    var d_skip = 0.0;
    var d_bias = 0.0;
    var bias = 0.0;
    var skip = 0.0;
    if (live) {
        a0 = load4_A(d, j0);
        if (NVT > 1u) { a1 = load4_A(d, j0 + 1u); }
        if (NVT > 2u) { a2 = load4_A(d, j0 + 2u); }
        if (NVT > 3u) { a3 = load4_A(d, j0 + 3u); }
        if (resume) {
            g0 = load4_carry(cb, j0);
            da0 = load4_carry(cb + N, j0);
            if (NVT > 1u) { g1 = load4_carry(cb, j0 + 1u); da1 = load4_carry(cb + N, j0 + 1u); }
            if (NVT > 2u) { g2 = load4_carry(cb, j0 + 2u); da2 = load4_carry(cb + N, j0 + 2u); }
            if (NVT > 3u) { g3 = load4_carry(cb, j0 + 3u); da3 = load4_carry(cb + N, j0 + 3u); }
            if (blk == 0u) {
                d_skip = carry[cb + 2u * N];
                d_bias = carry[cb + 2u * N + 1u];
            }
        }
        bias = delta_bias[d];
        skip = D[d];
    }
    let step_rows = NVP * (CW + 1u);  // h_tile / g_tile rows per step
    var buf = 0u;
    for (var kc = min(p.kc_hi, p.nchunks); kc > p.kc_lo; kc--) {
        let chunk_start = (kc - 1u) * p.chunk;
        let chunk_end = min(chunk_start + p.chunk, p.len);
        let ntiles = (chunk_end - chunk_start + TS - 1u) / TS;
        // The entry state of every tile of the chunk, recomputed from the chunk's saved entry state. Tile jt's
        // goes to tile_states before the walk over tile jt − 1 ... 0 ends (the last tile's end state is not
        // needed); every tile walked is whole: only the chunk's last may be shorter.
        if (live) {
            let cs = ((b * p.nchunks + kc - 1u) * p.channels + d) * N;
            h0 = load4_saved(cs, j0);
            if (NVT > 1u) { h1 = load4_saved(cs, j0 + 1u); }
            if (NVT > 2u) { h2 = load4_saved(cs, j0 + 2u); }
            if (NVT > 3u) { h3 = load4_saved(cs, j0 + 3u); }
        }
        for (var jt = 0u; jt < ntiles; jt++) {
            if (jt > 0u) {
                let t0 = chunk_start + (jt - 1u) * TS;
                stage_bc(b, t0, t0 + TS, buf, x);
                if (live) { stage_entry_inputs(b, d, t0, t0 + TS, x, bias); }
                workgroupBarrier();
                if (live) {
                    for (var s = 0u; s < TS; s++) {
                        let dt = dt_own[s * WG + x];
                        let dtu = dt * u_own[s * WG + x];
                        let bi = bc_index(buf, s) + j0;
                        h0 = exp(dt * a0) * h0 + dtu * bc_tile[bi];
                        if (NVT > 1u) { h1 = exp(dt * a1) * h1 + dtu * bc_tile[bi + 1u]; }
                        if (NVT > 2u) { h2 = exp(dt * a2) * h2 + dtu * bc_tile[bi + 2u]; }
                        if (NVT > 3u) { h3 = exp(dt * a3) * h3 + dtu * bc_tile[bi + 3u]; }
                    }
                }
                buf ^= 1u;
            }
            if (live) {
                let sb = scratch + jt * N * CW;
                store4_scratch(sb, j0, h0);
                if (NVT > 1u) { store4_scratch(sb, j0 + 1u, h1); }
                if (NVT > 2u) { store4_scratch(sb, j0 + 2u, h2); }
                if (NVT > 3u) { store4_scratch(sb, j0 + 3u, h3); }
            }
        }
        // The tiles, last to first.
        for (var jt = ntiles; jt > 0u; jt--) {
            let t0 = chunk_start + (jt - 1u) * TS;
            let t_end = min(t0 + TS, chunk_end);
            stage_bc(b, t0, t_end, buf, x);
            if (live) { stage_grad_inputs(b, d, t0, t_end, buf, x, c, blk == 0u, bias); }
            workgroupBarrier();  // bc_tile[buf], dyg_tile[buf] and dtu_tile[buf] are staged
            if (live) {
                // The tile's states (and from them dz, which needs the ungated y_t), from its entry state.
                let sb = scratch + (jt - 1u) * N * CW;
                h0 = load4_scratch(sb, j0);
                if (NVT > 1u) { h1 = load4_scratch(sb, j0 + 1u); }
                if (NVT > 2u) { h2 = load4_scratch(sb, j0 + 2u); }
                if (NVT > 3u) { h3 = load4_scratch(sb, j0 + 3u); }
                let e0 = h0;  // h_{t0 − 1}: the adjoint's h_{t−1} at the tile's first step
                let e1 = h1;
                let e2 = h2;
                let e3 = h3;
                for (var t = t0; t < t_end; t++) {
                    let s = t - t0;
                    let i = s * WG + x;
                    let dt = dt_own[i];
                    let dtu = dt * u_own[i];
                    let bi = bc_index(buf, s) + j0;
                    let slot = s * step_rows + j0 * (CW + 1u) + c;  // h_tile / g_tile of vec4 j0 at step s
                    var yc = advance_kept(&h0, a0, dt, dtu, bc_tile[bi], bc_tile[bi + NVP], slot);
                    if (NVT > 1u) {
                        yc += advance_kept(&h1, a1, dt, dtu, bc_tile[bi + 1u], bc_tile[bi + NVP + 1u], slot + CW + 1u);
                    }
                    if (NVT > 2u) {
                        yc += advance_kept(&h2, a2, dt, dtu, bc_tile[bi + 2u], bc_tile[bi + NVP + 2u],
                                           slot + 2u * (CW + 1u));
                    }
                    if (NVT > 3u) {
                        yc += advance_kept(&h3, a3, dt, dtu, bc_tile[bi + 3u], bc_tile[bi + NVP + 3u],
                                           slot + 3u * (CW + 1u));
                    }
                    if (Q == 1u) {
                        dz[row_index(b, t, d)] = (yc + skip * u_own[i]) * gate_own[i];
                    } else {
                        part_y[i] = yc;
                    }
                }
                // The adjoint, last step to first; step s reads h_{s−1} from h_tile (the entry state e for the first).
                for (var t = t_end; t > t0; t--) {
                    let s = t - 1u - t0;
                    let i = s * WG + x;
                    let dt = dt_own[i];
                    let uv = u_own[i];
                    let dyg = dyg_tile[factor_index(buf, s, c)];
                    let bi = bc_index(buf, s) + j0;
                    let slot = s * step_rows + j0 * (CW + 1u) + c;
                    let first = s == 0u;
                    let prev = select(slot, slot - step_rows, s > 0u);  // h_{s−1}'s slot (unused at s = 0)
                    var sums = adjoint(&g0, &da0, a0, dt, dyg, bc_tile[bi], bc_tile[bi + NVP],
                                       select(h_tile[prev], e0, first), slot);
                    if (NVT > 1u) {
                        let o = CW + 1u;
                        sums += adjoint(&g1, &da1, a1, dt, dyg, bc_tile[bi + 1u], bc_tile[bi + NVP + 1u],
                                        select(h_tile[prev + o], e1, first), slot + o);
                    }
                    if (NVT > 2u) {
                        let o = 2u * (CW + 1u);
                        sums += adjoint(&g2, &da2, a2, dt, dyg, bc_tile[bi + 2u], bc_tile[bi + NVP + 2u],
                                        select(h_tile[prev + o], e2, first), slot + o);
                    }
                    if (NVT > 3u) {
                        let o = 3u * (CW + 1u);
                        sums += adjoint(&g3, &da3, a3, dt, dyg, bc_tile[bi + 3u], bc_tile[bi + NVP + 3u],
                                        select(h_tile[prev + o], e3, first), slot + o);
                    }
                    // sums.x = Σ_n g_t B_t = ∂loss/∂(Δ_t u_t); sums.y = Σ_n g_t exp(Δ_t A) h_{t−1} A
                    if (Q == 1u) {
                        let row = row_index(b, t - 1u, d);
                        du[row] = skip * dyg + dt * sums.x;
                        let dx = (sums.y + uv * sums.x) * dsoftplus_own[i];
                        ddelta[row] = dx;
                        d_skip += dyg * uv;
                        d_bias += dx;
                    } else {
                        part_gb[i] = sums.x;
                        part_gha[i] = sums.y;
                    }
                }
            }
            workgroupBarrier();  // h_tile, g_tile and the parts are complete
            // Q > 1: the channel's thread blk = 0 adds its threads' parts of the sums over n.
            if (Q > 1u && live && blk == 0u) {
                for (var t = t0; t < t_end; t++) {
                    let i = (t - t0) * WG + x;
                    var ycs = 0.0;
                    var gbs = 0.0;
                    var ghs = 0.0;
                    for (var m = 0u; m < Q; m++) {
                        ycs += part_y[i + m];
                        gbs += part_gb[i + m];
                        ghs += part_gha[i + m];
                    }
                    let uv = u_own[i];
                    let dyg = dyg_tile[factor_index(buf, t - t0, c)];
                    let row = row_index(b, t, d);
                    dz[row] = (ycs + skip * uv) * gate_own[i];
                    du[row] = skip * dyg + dt_own[i] * gbs;
                    let dx = (ghs + uv * gbs) * dsoftplus_own[i];
                    ddelta[row] = dx;
                    d_skip += dyg * uv;
                    d_bias += dx;
                }
            }
            // Sums over the workgroup's channels, one (step, vec4 of states) per thread:
            // dC_t[n] = Σ_c h_t[c, n] dy'_t[c], dB_t[n] = Σ_c g_t[c, n] Δ_t u_t[c].
            for (var i = x; i < (t_end - t0) * NV; i += WG) {
                let s = i / NV;
                let jj = i % NV;
                let rb = (s * NVP + jj) * (CW + 1u);
                let fb = factor_index(buf, s, 0u);
                var dc = vec4<f32>(0.0);
                var db = vec4<f32>(0.0);
                for (var cc = 0u; cc < nch; cc++) {
                    dc += h_tile[rb + cc] * dyg_tile[fb + cc];
                    db += g_tile[rb + cc] * dtu_tile[fb + cc];
                }
                let out = (part_row * p.len + t0 + s) * N;
                let k = idx4(out, 1u, jj);
                let m = lanes(jj);
                if (m.x) { dC_part[k.x] = dc.x; dB_part[k.x] = db.x; }
                if (m.y) { dC_part[k.y] = dc.y; dB_part[k.y] = db.y; }
                if (m.z) { dC_part[k.z] = dc.z; dB_part[k.z] = db.z; }
                if (m.w) { dC_part[k.w] = dc.w; dB_part[k.w] = db.w; }
            }
            buf ^= 1u;
        }
    }
    if (!live) { return; }
    if (p.kc_lo > 0u) {  // more chunks follow in another dispatch
        store4_carry(cb, j0, g0);
        store4_carry(cb + N, j0, da0);
        if (NVT > 1u) { store4_carry(cb, j0 + 1u, g1); store4_carry(cb + N, j0 + 1u, da1); }
        if (NVT > 2u) { store4_carry(cb, j0 + 2u, g2); store4_carry(cb + N, j0 + 2u, da2); }
        if (NVT > 3u) { store4_carry(cb, j0 + 3u, g3); store4_carry(cb + N, j0 + 3u, da3); }
        if (blk == 0u) {
            carry[cb + 2u * N] = d_skip;
            carry[cb + 2u * N + 1u] = d_bias;
        }
        return;
    }
    let pp = (b * p.channels + d) * (N + 2u);  // ∂/∂A_log = ∂/∂A · A
    store4_param_part(pp, j0, da0 * a0);
    if (NVT > 1u) { store4_param_part(pp, j0 + 1u, da1 * a1); }
    if (NVT > 2u) { store4_param_part(pp, j0 + 2u, da2 * a2); }
    if (NVT > 3u) { store4_param_part(pp, j0 + 3u, da3 * a3); }
    if (blk == 0u) {
        param_part[pp + N] = d_skip;
        param_part[pp + N + 1u] = d_bias;
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
