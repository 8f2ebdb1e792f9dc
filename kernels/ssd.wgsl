// The SSD scan (state space duality), chunked as mamba_ssm's ssd_minimal / Triton ssd_combined, and its exact
// backward: a general core and Mamba-2's thin composition around it. The core, per batch b and head h (headdim
// P, state P × N, heads h share group h / (H / G) of B, C), with the per-step log-decay a_t = adt_t ≤ 0 and the
// input scale s_t given directly:
//   S_t = exp(a_t) S_{t−1} + s_t x_t B_tᵀ,  y_t = S_t C_t (+ D x_t when the core has D);
// with HAS_DIAG a per-step diagonal weight d_t replaces s_t in step t's own term of y_t (not in the state):
//   y_t = exp(a_t) S_{t−1} C_t + d_t (C_t·B_t) x_t (+ D x_t)   (Mamba-3 SISO: s = γ + δ_{t+1}, d = γ).
// Its backward: the diagonal of the pair sums is weighted by d in M_Y and M_DCB (so dB, dC, which read dCB, follow);
// M_DXD leaves t = s out of its pair phase and adds d_s (C_s·B_s) dy_s to dx in its epilogue (so dscale = x·dxd
// keeps only what s reaches), and ∂d_s = (C_s·B_s)(x_s·dy_s). The diagonal has no decay: ∂a is unchanged.
// Mamba-2 (ssd_mamba2_prep / ssd_mamba2_backward): s_t = Δ_t = clamp(softplus(dt_raw_t + dt_bias), dt_min,
// dt_max), a_t = Δ_t A, A = −exp(A_log); its chain rule: ∂/∂Δ = ∂/∂s + A ∂/∂a, ∂/∂A = Σ Δ ∂/∂a.
// Layouts: x, y, dy [B, L, H, P] and B, C [B, L, G, N] (rows of the in_proj / conv matrices); adt, scale,
// dt_raw [B, L, H].
//
// Chunks of Q steps; cs_r = Σ_{s ≤ r} a_s within a chunk (cs_end = cs_{Q−1}), E_c the state entering chunk c:
//   y_r = Σ_{o ≤ r} exp(cs_r − cs_o) (C_r·B_o) s_o x_o + exp(cs_r) E_c C_r + D x_r   (ssd_tile M_CB, M_Y)
//   E_{c+1} = exp(cs_end) E_c + Σ_o exp(cs_end − cs_o) s_o x_o B_oᵀ                  (M_STATE + passing)
// Every chunk-level product is ssd_tile (the tile engine at the end of this file: batched 64 × 64 GEMM tiles
// with the mask and scales applied while staging; C Bᵀ formed once per group; ssd_tile_lanes is the same engine
// for CPU adapters, one 8-lane subgroup a tile). Chunk states go in order in
// their own dispatch (each thread walks the chunks for its own state elements; on Mesa llvmpipe, whose loop
// budget cuts long walks, in several: seg_lo / seg_hi), so no workgroup waits on another.
//
// Backward, with dE_c = ∂loss/∂E_c and dS_c = dE_{c+1} (zero for the last chunk):
//   dE_c = Σ_r exp(cs_r) dy_r C_rᵀ + exp(cs_end) dE_{c+1}                    (M_STATE GRAD + reverse passing)
//   dxd_o = ∂/∂(s_o x_o) = Σ_{t ≥ o} exp(cs_t − cs_o)(B_o·C_t) dy_t + exp(cs_end − cs_o) dS_c B_o   (M_DXD)
//   dC_t = Σ_{o ≤ t} dCB_to B_o + Σ_heads exp(cs_t) E_cᵀ dy_t                                      (M_DC)
//   dB_o = Σ_{t ≥ o} dCB_to C_t + Σ_heads exp(cs_end − cs_o) dS_cᵀ s_o x_o                         (M_DB)
//   dCB_to = Σ_heads exp(cs_t − cs_o) s_o dy_t·x_o  (o ≤ t; per group, M_DCB)
// Then dx = s dxd + D dy, ∂loss/∂s_o = x_o·dxd_o, and a_σ is inside the decay of every term that passes
// step σ:
//   ∂loss/∂a_σ = Σ_{o < σ ≤ t} T_to + Σ_{t ≥ σ} dy_t·y_off_t + Σ_{o < σ} s_o x_o·dxd_state_o + W_c,
//   T_to = exp(Σ_{o<k≤t} a_k)(C_t·B_o)(dy_t·s_o x_o),  y_off_t = exp(cs_t) E_c C_t,
//   dxd_state_o = exp(cs_end − cs_o) dS_c B_o,  W_c = exp(cs_end)⟨E_c, dS_c⟩;
// dy_t·y_off_t comes from M_DC (C_t·(exp(cs_t) E_hᵀ dy_t): its state phase, head by head, before the pairs),
// s_o x_o·dxd_state_o from M_DXD
// between its two K phases, the crossing sums Σ_{o<σ≤t} T_to from M_DCB (per head, beside dCB), W_c from the
// reverse passing; ssd_rows_backward adds them up. These are direct sums, as mamba_ssm's "stable" ddA
// kernels: the shorter identity ∂loss/∂cs_r = dy_r·(y_r − D x_r) − s_r x_r·dxd_r cancels large near-diagonal
// terms and loses ∂a to float32 rounding when the decay is strong.
// Decays are never differences of chunk-long cumsums either (their rounding, |cs|·2⁻²⁴, would swamp a small
// difference late in a strongly decaying chunk): ssd_prep writes direct sums (all a ≤ 0, so every partial sum
// is accurate to its own size): the chunk prefix cs_r, the chunk suffix Σ_{s>r} a_s (= cs_end − cs_r), and
// prefix / suffix sums within sub-blocks of SUB steps; a pair decay Σ_{o<s≤r} a_s is a difference of two
// sums within one sub-block, or sub-block suffix + the whole sub-blocks between + sub-block prefix (the
// blockwise form of ssd_minimal's stable segsum).
// The forward saves only E (O(B·H·P·N·L/Q)); the decays (and Mamba-2's Δ) are recomputed. Sums over
// workgroups go out as partials added in a fixed order by a later dispatch: deterministic, no atomics.
// Positions past L (the last chunk's padding) have s = a = 0 and read x = B = C = dy = 0, and every exp is of
// a value ≤ 0, so nothing there can become inf or NaN.

const WG: u32 = 256u;          // threads of the 1-D kernels; ssd_prep / ssd_rows_backward give each a segment
const MAX_CHUNK: u32 = 1024u;  // = WG · 4: the longest chunk those two kernels hold in workgroup memory
const TILE: u32 = 64u;
const SUB: u32 = 16u;          // sub-block of the pair decays; TILE / SUB = 4 per tile
// Rows of `dec`.
const SCALE: u32 = 0u;
const CS: u32 = 1u;
const SFX: u32 = 2u;
const LO: u32 = 3u;
const RLO: u32 = 4u;
const DIAG: u32 = 5u;          // the diagonal weight (= SCALE without HAS_DIAG)
const ROWS: u32 = 6u;

override GRAD: bool = false;      // ssd_tile M_STATE: dy, C, exp(cs_r) (dE) instead of x, B, exp(cs_end − cs_r) s_r
override ACCUMULATE: bool = false;
override HAS_D: bool = true;      // ssd_rows_backward: the core has a D skip (dx += D dy, ∂D partials)
// The core has a diagonal weight: step t's own term in y_t takes diag_t instead of scale_t (ssd_prep reads it;
// ssd_tile M_Y, M_DXD, M_DCB use it; ssd_rows_backward writes ∂diag).
override HAS_DIAG: bool = false;
override NPARAM: u32 = 1u;        // ssd_param_grads: parameters per partial (1 or 2)

// seg_lo, seg_hi: the part of a walk one dispatch takes (ssd_state_passing(_backward): chunks; ssd_param_grads:
// (batch, chunk) partials), all of it but on Mesa llvmpipe, whose loop budget (65,535 loop iterations per
// invocation, mambactl/ops/checks.py) splits long walks into dispatch segments that carry their sums in a buffer.
// dt_stride, dt_col: ssd_step's dt_raw row stride and first column (in_proj's output row in Mamba-2's decoding).
struct Dims { batch: u32, len: u32, heads: u32, ngroups: u32, headdim: u32, nstate: u32, chunk: u32, nchunks: u32,
              dt_min: f32, dt_max: f32, seg_lo: u32, seg_hi: u32, dt_stride: u32, dt_col: u32 }

@group(0) @binding(0) var<uniform> d: Dims;
@group(0) @binding(2) var<storage, read> dt_raw: array<f32>;        // [B, L, H]
@group(0) @binding(3) var<storage, read> dt_bias: array<f32>;       // [H]
@group(0) @binding(4) var<storage, read> A_log: array<f32>;         // [H]
// [B, H, nchunks, 6, Q] per position r of a chunk: the scale s_r; cs_r = Σ_{s≤r} a_s; Σ_{s>r} a_s; the sums over
// s ≤ r and over s > r within r's sub-block of SUB steps; the diagonal weight (rows SCALE, CS, SFX, LO, RLO, DIAG).
@group(0) @binding(5) var<storage, read_write> dec_out: array<f32>;
@group(0) @binding(6) var<storage, read> dec: array<f32>;
@group(0) @binding(9) var<storage, read_write> states: array<f32>;  // [B, nchunks, H, P, N]
@group(0) @binding(14) var<storage, read> skip: array<f32>;         // D [H]
@group(0) @binding(15) var<storage, read_write> out: array<f32>;
@group(0) @binding(17) var<storage, read> saved_states: array<f32>; // E [B, nchunks, H, P, N]
@group(0) @binding(18) var<storage, read_write> w_part: array<f32>;  // [B, H, nchunks, ceil(P·N / pass_span())]: W_c
@group(0) @binding(19) var<storage, read> b_in: array<f32>;
@group(0) @binding(20) var<storage, read> c_in: array<f32>;
@group(0) @binding(21) var<storage, read> x: array<f32>;
// [B, H, nchunks, npairs, Q]: M_DCB's crossing sums per tile pair (M_DXD with HAS_DIAG: its ∂diag pieces, see row_part3)
@group(0) @binding(23) var<storage, read_write> x_part: array<f32>;
@group(0) @binding(27) var<storage, read_write> ddt_raw: array<f32>;
// Per (batch, chunk, head) partials of parameter gradients: [B, nchunks, H, NPARAM] (the core: ∂D; Mamba-2's
// chain rule: ∂A_log, ∂dt_bias), added in order by ssd_param_grads into grad_0 (, grad_1) [H].
@group(0) @binding(28) var<storage, read_write> param_part: array<f32>;
@group(0) @binding(29) var<storage, read_write> grad_0: array<f32>;
@group(0) @binding(31) var<storage, read_write> grad_1: array<f32>;
// [B, H, P, N]: S after the last step, as vec4s (ssd_state_passing's 16-byte accesses)
@group(0) @binding(32) var<storage, read_write> last_state: array<vec4<f32>>;
@group(0) @binding(33) var<storage, read_write> ssm_state: array<f32>;   // ssd_step: [B, H, P, N], in place
// [B, H, nchunks, ceil(N / 64), Q]: U_r = dy_r·y_off_r by 64-column tiles of N (ssd_tile M_DC: U_r =
// C_r·(exp(cs_r) E_hᵀ dy_r))
@group(0) @binding(35) var<storage, read_write> u_part: array<f32>;
// A segmented walk's running sums between its dispatches: ssd_state_passing_backward's dE [B, H, P·N],
// ssd_param_grads' [H, 3].
@group(0) @binding(36) var<storage, read_write> carry: array<f32>;
@group(0) @binding(37) var<storage, read> adt_in: array<f32>;          // [B, L, H]: the core's log-decay (≤ 0)
@group(0) @binding(38) var<storage, read> scale_in: array<f32>;        // [B, L, H]: the core's input scale
@group(0) @binding(39) var<storage, read_write> dadt: array<f32>;      // [B, L, H]
@group(0) @binding(40) var<storage, read_write> dscale: array<f32>;    // [B, L, H]
@group(0) @binding(41) var<storage, read_write> adt_out: array<f32>;   // ssd_mamba2_prep: Δ A
@group(0) @binding(42) var<storage, read_write> scale_out: array<f32>; // ssd_mamba2_prep: Δ
@group(0) @binding(56) var<storage, read> diag_in: array<f32>;         // [B, L, H]: the diagonal weight (HAS_DIAG)
@group(0) @binding(57) var<storage, read_write> ddiag: array<f32>;     // [B, L, H] (HAS_DIAG)
// [B, H, nchunks, ceil(P / 64), Q]: M_DXD's ∂diag pieces (C_s·B_s)(x_s·dy_s) by 64-column tiles of P (HAS_DIAG),
// read here by ssd_rows_backward; ssd_tile writes them through its x_part binding (which M_DXD does not use
// otherwise), so that ssd_tile binds no more storage buffers than it did before the diagonal weight
@group(0) @binding(54) var<storage, read_write> row_part3: array<f32>;

// Workgroup memory: the module's kernels share ssd_tile's arrays (declared with the tile engine below) instead of
// declaring their own. Every pipeline of this module seems to be given all of the module's workgroup arrays: on
// the H200, 768 B more of them (the diagonal weight's three row tables) made every ssd_tile mode, M_CB included,
// ~1.5× slower. So: exclusive_prefix / workgroup_sum use t_mid (WG floats), ssd_prep t_red (MAX_CHUNK floats),
// and what a thread keeps for its own positions stays in registers (ssd_prep, ssd_rows_backward: at most MAX_SEG
// positions a thread).
const MAX_SEG: u32 = 4u;  // = MAX_CHUNK / WG: positions per thread in ssd_prep / ssd_rows_backward

fn sigmoid(v: f32) -> f32 { return 1.0 / (1.0 + exp(-v)); }

// log(1 + e) for e >= 0. WGSL only promises log an absolute error of 2^-21 on [0.5, 2] (llvmpipe uses that
// freedom), a large relative error when 1 + e is near 1, so below e = 1/4 the series e − e²/2 + … − e¹²/12 is
// summed instead (truncation < 5e-9 relative); above it log(1 + e) >= 0.22 keeps the error below 3e-6.
fn log1p_of(e: f32) -> f32 {
    if (e >= 0.25) { return log(1.0 + e); }
    return e * (1.0 - e * (0.5 - e * (1.0 / 3.0 - e * (0.25 - e * (0.2 - e * (1.0 / 6.0 - e * (1.0 / 7.0 - e * (0.125 - e * (1.0 / 9.0 - e * (0.1 - e * (1.0 / 11.0 - e / 12.0)))))))))));
}

// PyTorch's softplus (threshold 20).
fn softplus(v: f32) -> f32 {
    if (v > 20.0) { return v; }
    return log1p_of(exp(v));
}

// Σ_{i < t} v_i over the workgroup's threads (t a permutation of 0..WG−1), in a fixed order (Hillis–Steele).
fn exclusive_prefix(v: f32, t: u32) -> f32 {
    t_mid[t] = v;
    workgroupBarrier();
    for (var off = 1u; off < WG; off <<= 1u) {
        var add = 0.0;
        if (t >= off) { add = t_mid[t - off]; }
        workgroupBarrier();
        t_mid[t] += add;
        workgroupBarrier();
    }
    var before = 0.0;
    if (t > 0u) { before = t_mid[t - 1u]; }
    workgroupBarrier();  // the buffer is reused by the next call
    return before;
}

fn workgroup_sum(v: f32, t: u32) -> f32 {
    t_mid[t] = v;
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half >>= 1u) {
        if (t < half) { t_mid[t] += t_mid[t + half]; }
        workgroupBarrier();
    }
    let total = t_mid[0];
    workgroupBarrier();
    return total;
}

fn dec_base(b: u32, h: u32, c: u32) -> u32 { return ((b * d.heads + h) * d.nchunks + c) * ROWS * d.chunk; }

// The decay sums of `dec` for every position of a chunk from the per-step log-decays adt (padding: scale = 0
// and adt = 0 there). Thread t owns the consecutive positions [t·seg, (t + 1)·seg). Grid (nchunks, H, B).
@compute @workgroup_size(256)
fn ssd_prep(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = wid.x;
    let h = wid.y;
    let b = wid.z;
    let t = lid.x;
    let seg = (d.chunk + WG - 1u) / WG;
    let q = d.chunk;
    let base = dec_base(b, h, c);
    var run = 0.0;
    var run_at = vec4<f32>(0.0);  // the running sum at each of this thread's positions
    for (var i = 0u; i < MAX_SEG; i++) {  // constant trip counts: run_at stays in registers
        let r = t * seg + i;
        let pos = c * q + r;
        if (i < seg && r < q) {
            var sc = 0.0;
            var a = 0.0;
            var dg = 0.0;
            if (pos < d.len) {
                let k = (b * d.len + pos) * d.heads + h;
                sc = scale_in[k];
                a = adt_in[k];
                dg = sc;
                if (HAS_DIAG) { dg = diag_in[k]; }
            }
            dec_out[base + SCALE * q + r] = sc;
            dec_out[base + DIAG * q + r] = dg;
            t_red[r] = a;
            run += a;
            run_at[i] = run;
        }
    }
    let before = exclusive_prefix(run, t);          // Σ a over the earlier threads' segments
    let after = exclusive_prefix(run, WG - 1u - t); // and over the later ones
    var suffix = after;
    for (var k = 0u; k < MAX_SEG; k++) {  // this thread's positions, last first
        let i = seg - 1u - min(k, seg - 1u);
        let r = t * seg + i;
        if (k < seg && r < q) {
            dec_out[base + CS * q + r] = before + run_at[i];
            dec_out[base + SFX * q + r] = suffix;
            suffix += t_red[r];
        }
    }
    // Sub-block sums, one thread per sub-block (the prefix calls' barriers made t_red's a visible).
    if (t < (q + SUB - 1u) / SUB) {
        let r0 = t * SUB;
        let r1 = min(r0 + SUB, q);
        var acc = 0.0;
        for (var r = r0; r < r1; r++) {
            acc += t_red[r];
            dec_out[base + LO * q + r] = acc;
        }
        acc = 0.0;
        for (var r = r1; r > r0; r--) {
            dec_out[base + RLO * q + r - 1u] = acc;
            acc += t_red[r - 1u];
        }
    }
}


fn cs_end_of(b: u32, h: u32, c: u32) -> f32 { return dec[dec_base(b, h, c) + CS * d.chunk + d.chunk - 1u]; }

// In place: the states each chunk adds become the states entering each chunk, E_0 = 0,
// E_{c+1} = exp(cs_end_c) E_c + added_c; E_nchunks, the state after the last step, goes to last_state
// [B, H, P, N] (the recurrent decoding state). Chunks [seg_lo, seg_hi), E_seg_lo carried in last_state from the
// previous segment. Each thread owns four consecutive state elements of one head (one 16-byte access each), and
// each chunk's loads are issued PASS_BUFFERS − 1 chunks before they are needed: a walk that issues its next load
// only after the recurrence step that waits for the previous one waits a whole memory latency per chunk. Chunk
// c's inputs (its added states and cs_end) go into buffer c mod PASS_BUFFERS right after chunk c − PASS_BUFFERS
// ran, so while chunk c waits, chunks c + 1 .. c + PASS_BUFFERS − 1 are in flight. The buffers are named
// registers taken in turn by straight-line code (one loop iteration per PASS_BUFFERS chunks), each refilled after
// its chunk's step has read it: a rotation (`cur = next; next = load`) copies a load still in flight at the
// loop's end, which waits for it (the forward "a chunk ahead" that measured equal, docs/performance.md), and an
// array indexed by a loop counter can land in local memory. cs_end is buffered raw, its exp taken when the chunk
// runs (an exp at the load would wait for it).
// H200, 2026-12-02 (bench/ssd.py --variants round robin in one process, GPU timestamps; B 8, L 1024, H 24, P 64,
// N 128; that round's other kernels ran ~1.6× slower than usual, so compare within it), ms per call: Mamba-3 SISO
// (G 24, chunk 64, 16 chunks) the walk before this one (one element a thread, one chunk's loads at a time) 0.461;
// one element a thread with 1 / 2 / 4 / 8 buffers 0.111 / 0.106 / 0.092 / 0.093; four strided (e0 + j·WG, scalar)
// with 1 / 2 / 4 0.090 / 0.094 / 0.092; a vec4 with 1 / 2 / 4 / 8 0.080 / 0.084 / 0.079 / 0.089. Mamba-2 (G 1,
// chunk 128, 8 chunks): 0.154; 0.043 / 0.038 / 0.038 / 0.039; 0.034 / 0.035 / 0.035; 0.031 / 0.032 / 0.033 /
// 0.037. Kept: a vec4 and 4 buffers (the best at Mamba-3, within 0.002 ms of the best at Mamba-2).
// PASS_SCALAR, for P·N not a multiple of 4 (a head's slab then need not start on a vec4): the same four
// consecutive elements a thread, grid and walk, by scalar accesses (components of the vec4 views). The simplest
// correct fallback: only the access width changes, where padding each slab to a multiple of 4 would change the
// states' layout that ssd_tile shares. Not measured (off the shapes above).
const PASS_BUFFERS: u32 = 4u;
override PASS_SCALAR: bool = false;

// `states` as vec4s, for ssd_state_passing's 16-byte accesses (ssd_state_passing_backward reads `states`).
@group(0) @binding(58) var<storage, read_write> statesv: array<vec4<f32>>;

// A thread's state elements: the head (b, h), the first one's offset in a head's [P·N] slab, and which of its
// four exist (without PASS_SCALAR all four or none).
struct PassLanes { b: u32, h: u32, off: u32, has: vec4<bool> }
// One chunk's inputs, loaded ahead: this thread's added states and the chunk's cs_end.
struct PassBuffer { added: vec4<f32>, cs_end: f32 }

// PASS_SCALAR: element k of statesv (of last_state if `last`).
fn pass_get(k: u32, last: bool) -> f32 {
    if (last) { return last_state[k >> 2u][k & 3u]; }
    return statesv[k >> 2u][k & 3u];
}
fn pass_set(k: u32, v: f32, last: bool) {
    if (last) { last_state[k >> 2u][k & 3u] = v; } else { statesv[k >> 2u][k & 3u] = v; }
}

// This thread's elements of the [P·N] slab at element `slab` of statesv (of last_state if `last`); 0 where they
// do not exist.
fn pass_load(slab: u32, w: PassLanes, last: bool) -> vec4<f32> {
    let k = slab + w.off;
    var v = vec4<f32>(0.0);
    if (!PASS_SCALAR) {
        if (w.has.x) {
            if (last) { v = last_state[k >> 2u]; } else { v = statesv[k >> 2u]; }
        }
        return v;
    }
    if (w.has.x) { v.x = pass_get(k, last); }
    if (w.has.y) { v.y = pass_get(k + 1u, last); }
    if (w.has.z) { v.z = pass_get(k + 2u, last); }
    if (w.has.w) { v.w = pass_get(k + 3u, last); }
    return v;
}
fn pass_store(slab: u32, w: PassLanes, v: vec4<f32>, last: bool) {
    let k = slab + w.off;
    if (!PASS_SCALAR) {
        if (w.has.x) {
            if (last) { last_state[k >> 2u] = v; } else { statesv[k >> 2u] = v; }
        }
        return;
    }
    if (w.has.x) { pass_set(k, v.x, last); }
    if (w.has.y) { pass_set(k + 1u, v.y, last); }
    if (w.has.z) { pass_set(k + 2u, v.z, last); }
    if (w.has.w) { pass_set(k + 3u, v.w, last); }
}

fn pass_chunk_slab(w: PassLanes, c: u32) -> u32 {
    return ((w.b * d.nchunks + c) * d.heads + w.h) * d.headdim * d.nstate;
}

// Chunk c's inputs into *buf when c is in this segment: loads only, nothing here waits for them.
fn pass_fill(buf: ptr<function, PassBuffer>, c: u32, w: PassLanes) {
    if (c < d.seg_hi) { *buf = PassBuffer(pass_load(pass_chunk_slab(w, c), w, false), cs_end_of(w.b, w.h, c)); }
}

// Chunk c, when in this segment, from *buf: E_c out, E = exp(cs_end)·E + added (a product, then a sum), then
// chunk c + PASS_BUFFERS's inputs into the buffer just read.
fn pass_turn(run: ptr<function, vec4<f32>>, buf: ptr<function, PassBuffer>, c: u32, w: PassLanes) {
    if (c < d.seg_hi) {
        pass_store(pass_chunk_slab(w, c), w, *run, false);
        *run = exp((*buf).cs_end) * *run + (*buf).added;
        pass_fill(buf, c + PASS_BUFFERS, w);
    }
}

// Grid (ceil(P·N / pass_span()), H, B).
@compute @workgroup_size(256)
fn ssd_state_passing(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let pn = d.headdim * d.nstate;
    let off = wid.x * pass_span() + 4u * lid.x;
    let w = PassLanes(wid.z, wid.y, off, vec4<u32>(off) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(pn));
    let last_slab = (w.b * d.heads + w.h) * pn;
    var run = vec4<f32>(0.0);
    if (d.seg_lo > 0u) { run = pass_load(last_slab, w, true); }
    var buf0: PassBuffer;
    var buf1: PassBuffer;
    var buf2: PassBuffer;
    var buf3: PassBuffer;
    let lo = d.seg_lo;
    pass_fill(&buf0, lo, w);
    pass_fill(&buf1, lo + 1u, w);
    pass_fill(&buf2, lo + 2u, w);
    pass_fill(&buf3, lo + 3u, w);
    for (var c = lo; c < d.seg_hi; c += PASS_BUFFERS) {
        pass_turn(&run, &buf0, c, w);
        pass_turn(&run, &buf1, c + 1u, w);
        pass_turn(&run, &buf2, c + 2u, w);
        pass_turn(&run, &buf3, c + 3u, w);
    }
    // The padding past L has s = a = 0 (no decay, nothing added), so this is the state after step L − 1.
    pass_store(last_slab, w, run, true);
}

// ssd_state_passing_backward gives each thread PASS_ELEMS state elements e0 + j·WG (coalesced), the components of
// vec4s (a private array measured slower), and sums W_c for W_BATCH chunks at once: one tree over t_red's four
// rows of WG floats, each row in workgroup_sum's order (the same bits for any segmentation). H200, B 8, L 1024,
// H 24, P 64, N 128, per layer: Mamba-2 (chunk 128) 0.133 ms at 1 element and 1 chunk a sum, 0.057 at 4 and 1,
// 0.050 at 2 and 4, 0.045 at 4 and 4; Mamba-3 SISO (chunk 64) 0.256 / 0.105 / 0.091 / 0.078 (at 4 and 4: 3.4 /
// 3.7 TB/s of three passes over the states).
const PASS_ELEMS: u32 = 4u;
const W_BATCH: u32 = 4u;
fn pass_span() -> u32 { return WG * PASS_ELEMS; }
// Whether element j (e0 + j·WG) of this thread exists.
fn pass_has(j: u32, e0: u32, pn: u32) -> bool { return e0 + j * WG < pn; }

// The workgroup sums of the pending products (component j: the j-th chunk of the batch, chunk c_first − j) into
// w_part, for the first `pending` of them (uniform over the workgroup).
fn flush_w(pend: vec4<f32>, pending: u32, c_first: u32, b: u32, h: u32, t: u32, slot: u32, slots: u32) {
    t_red[t] = pend.x;
    t_red[WG + t] = pend.y;
    t_red[2u * WG + t] = pend.z;
    t_red[3u * WG + t] = pend.w;
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half >>= 1u) {
        if (t < half) {
            t_red[t] += t_red[t + half];
            t_red[WG + t] += t_red[WG + t + half];
            t_red[2u * WG + t] += t_red[2u * WG + t + half];
            t_red[3u * WG + t] += t_red[3u * WG + t + half];
        }
        workgroupBarrier();
    }
    if (t < pending) {
        let c = c_first - t;
        w_part[((b * d.heads + h) * d.nchunks + c) * slots + slot] = exp(cs_end_of(b, h, c)) * t_red[t * WG];
    }
    workgroupBarrier();  // t_red is reused by the next batch
}

// In place, last chunk to first: the in-chunk parts of dE become dS_c = dE_{c+1}, with
// dE_c = part_c + exp(cs_end_c) dE_{c+1}; and W_c = exp(cs_end_c)⟨E_c, dS_c⟩ per workgroup of pass_span()
// state elements goes to w_part. Chunks [seg_lo, seg_hi), dE_seg_hi carried in `carry` from the previous
// segment (the later chunks). A chunk's loads are issued before the workgroup sum of the chunk after it, so
// they are in flight during its barriers. Elements that do not exist stay 0. Grid (ceil(P·N / pass_span()), H, B).
@compute @workgroup_size(256)
fn ssd_state_passing_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                              @builtin(local_invocation_id) lid: vec3<u32>) {
    let pn = d.headdim * d.nstate;
    let e0 = wid.x * pass_span() + lid.x;
    let h = wid.y;
    let b = wid.z;
    let ci = (b * d.heads + h) * pn + e0;
    let has = vec4<bool>(pass_has(0u, e0, pn), pass_has(1u, e0, pn), pass_has(2u, e0, pn), pass_has(3u, e0, pn));
    var run = vec4<f32>(0.0);
    var part = vec4<f32>(0.0);   // the next chunk's in-chunk part of dE and saved state E
    var saved = vec4<f32>(0.0);
    if (d.seg_hi < d.nchunks) {
        if (has.x) { run.x = carry[ci]; }
        if (has.y) { run.y = carry[ci + WG]; }
        if (has.z) { run.z = carry[ci + 2u * WG]; }
        if (has.w) { run.w = carry[ci + 3u * WG]; }
    }
    var k = ((b * d.nchunks + d.seg_hi - 1u) * d.heads + h) * pn + e0;  // chunk c − 1's elements
    if (d.seg_hi > d.seg_lo) {
        if (has.x) { part.x = states[k]; saved.x = saved_states[k]; }
        if (has.y) { part.y = states[k + WG]; saved.y = saved_states[k + WG]; }
        if (has.z) { part.z = states[k + 2u * WG]; saved.z = saved_states[k + 2u * WG]; }
        if (has.w) { part.w = states[k + 3u * WG]; saved.w = saved_states[k + 3u * WG]; }
    }
    var pend = vec4<f32>(0.0);  // this batch's products ⟨dS_c, E_c⟩ (this thread's part), component = slot
    var pending = 0u;
    for (var c = d.seg_hi; c > d.seg_lo; c--) {
        let decay = exp(cs_end_of(b, h, c - 1u));
        let this_part = part;
        pend = select(pend, vec4<f32>(dot(run, saved)), vec4<u32>(0u, 1u, 2u, 3u) == vec4<u32>(pending));
        pending += 1u;
        if (has.x) { states[k] = run.x; }
        if (has.y) { states[k + WG] = run.y; }
        if (has.z) { states[k + 2u * WG] = run.z; }
        if (has.w) { states[k + 3u * WG] = run.w; }
        if (c - 1u > d.seg_lo) {  // chunk c − 2's inputs
            k -= d.heads * pn;
            if (has.x) { part.x = states[k]; saved.x = saved_states[k]; }
            if (has.y) { part.y = states[k + WG]; saved.y = saved_states[k + WG]; }
            if (has.z) { part.z = states[k + 2u * WG]; saved.z = saved_states[k + 2u * WG]; }
            if (has.w) { part.w = states[k + 3u * WG]; saved.w = saved_states[k + 3u * WG]; }
        }
        if (pending == W_BATCH || c - 1u == d.seg_lo) {
            flush_w(pend, pending, c - 2u + pending, b, h, lid.x, wid.x, nwg.x);
            pending = 0u;
        }
        run = this_part + decay * run;
    }
    if (d.seg_lo > 0u) {
        if (has.x) { carry[ci] = run.x; }
        if (has.y) { carry[ci + WG] = run.y; }
        if (has.z) { carry[ci + 2u * WG] = run.z; }
        if (has.w) { carry[ci + 3u * WG] = run.w; }
    }
}

// Per (chunk, head, batch), from ssd_tile's per-row pieces: dscale_σ = x_σ·dxd_σ (HAS_DIAG: ddiag_σ from
// row_part3's tiles of P) and
// dadt_σ = ∂loss/∂a_σ = X_σ + Σ_{t ≥ σ} U_t + Σ_{o < σ} V_o + W_c (the header has the derivation): X from
// the crossing rows of the tile pairs (x_part [B, H, nchunks, npairs, Q]; pairs whose row tile lies past the chunk's
// end were never written), U_t = dy_t·y_off_t and x·dxd and V_o = s_o x_o·dxd_state_o by 64-column tiles of P
// (u_part, row_part, row_part2 [B, H, nchunks, ceil(P / 64), Q]), W_c from w_part; with HAS_D this chunk's ∂D
// partial (the tiles' Σ dy·x, tile_part) into param_part. Thread t owns positions [t·seg, (t + 1)·seg) for the
// scans. Grid (nchunks, H, B).
@compute @workgroup_size(256)
fn ssd_rows_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = wid.x;
    let h = wid.y;
    let b = wid.z;
    let t = lid.x;
    let q = d.chunk;
    let seg = (q + WG - 1u) / WG;
    let steps = min(q, d.len - c * q);
    let tiles_p = (d.headdim + TILE - 1u) / TILE;
    let u_tiles = (d.nstate + TILE - 1u) / TILE;  // U by M_DC's column tiles of N
    let tiles_q = (q + TILE - 1u) / TILE;
    let npairs = tiles_q * (tiles_q + 1u) / 2u;
    let live_rows = (steps + TILE - 1u) / TILE;  // row tiles with any valid position
    let state_tiles = (d.headdim * d.nstate + pass_span() - 1u) / pass_span();
    let bhc = (b * d.heads + h) * d.nchunks + c;
    var w_term = 0.0;
    for (var k = 0u; k < state_tiles; k++) { w_term += w_part[bhc * state_tiles + k]; }
    var u_run = 0.0;  // Σ U over this thread's positions
    var v_run = 0.0;  // Σ V likewise
    var u_at = vec4<f32>(0.0);   // U, V and x·dxd at this thread's positions (registers: constant trip counts)
    var v_at = vec4<f32>(0.0);
    var xd_at = vec4<f32>(0.0);
    for (var i = 0u; i < MAX_SEG; i++) {
        let r = t * seg + i;
        if (i < seg && r < steps) {
            var uu = 0.0;
            var vv = 0.0;
            var xd = 0.0;
            for (var k = 0u; k < tiles_p; k++) {
                let j = (bhc * tiles_p + k) * q + r;
                vv += row_part2[j];
                xd += row_part[j];
            }
            for (var k = 0u; k < u_tiles; k++) { uu += u_part[(bhc * u_tiles + k) * q + r]; }
            u_at[i] = uu;
            v_at[i] = vv;
            xd_at[i] = xd;
            u_run += uu;
            v_run += vv;
        }
    }
    let u_after = exclusive_prefix(u_run, WG - 1u - t);  // Σ U over the later threads' positions
    let v_before = exclusive_prefix(v_run, t);           // Σ V over the earlier ones
    var v_prefix = v_before;
    for (var i = 0u; i < MAX_SEG; i++) {  // v_at[i] becomes Σ_{o < r} V_o
        let r = t * seg + i;
        if (i < seg && r < steps) {
            let vr = v_at[i];
            v_at[i] = v_prefix;
            v_prefix += vr;
        }
    }
    var u_suffix = u_after;
    for (var kk = 0u; kk < MAX_SEG; kk++) {  // this thread's positions, last first
        let i = seg - 1u - min(kk, seg - 1u);
        let r = t * seg + i;
        if (kk < seg && r < steps) {
            u_suffix += u_at[i];
            var crossing = 0.0;
            for (var k = 0u; k < live_rows * (live_rows + 1u) / 2u; k++) {
                crossing += x_part[(bhc * npairs + k) * q + r];
            }
            let k = (b * d.len + c * q + r) * d.heads + h;
            dadt[k] = crossing + u_suffix + v_at[i] + w_term;
            dscale[k] = xd_at[i];
            if (HAS_DIAG) {
                var dg = 0.0;
                for (var kt = 0u; kt < tiles_p; kt++) { dg += row_part3[(bhc * tiles_p + kt) * q + r]; }
                ddiag[k] = dg;
            }
        }
    }
    if (HAS_D && t == 0u) {
        let tiles = tiles_q * tiles_p;
        var total = 0.0;
        let first = ((b * d.nchunks + c) * d.heads + h) * tiles;
        for (var k = 0u; k < live_rows * tiles_p; k++) { total += tile_part[first + k]; }
        param_part[(b * d.nchunks + c) * d.heads + h] = total;
    }
}

// Mamba-2's prep, elementwise over [B, L, H]: Δ = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max) is the
// core's scale, and adt = Δ A with A = −exp(A_log). Grid grid_1d(B·L·H).
@compute @workgroup_size(256)
fn ssd_mamba2_prep(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * WG + gid.x;
    if (i >= d.batch * d.len * d.heads) { return; }
    let h = i % d.heads;
    let dt = clamp(softplus(dt_raw[i] + dt_bias[h]), d.dt_min, d.dt_max);
    scale_out[i] = dt;
    adt_out[i] = dt * -exp(A_log[h]);
}

// Mamba-2's chain rule from the core's dscale, dadt (scale = Δ, adt = Δ A): ∂loss/∂Δ = dscale + A dadt, then
// ddt_raw through the clamp and the softplus; per (chunk, head, batch) the partial sums of ∂A_log = A Σ Δ dadt
// and ∂dt_bias = Σ ddt_raw into param_part [B, nchunks, H, 2] (ssd_param_grads adds them in order). Thread t
// owns positions [t·seg, (t + 1)·seg) of the chunk. Grid (nchunks, H, B).
@compute @workgroup_size(256)
fn ssd_mamba2_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = wid.x;
    let h = wid.y;
    let b = wid.z;
    let t = lid.x;
    let q = d.chunk;
    let a = -exp(A_log[h]);
    let seg = (q + WG - 1u) / WG;
    let steps = min(q, d.len - c * q);
    var d_a = 0.0;
    var d_bias = 0.0;
    for (var i = 0u; i < seg; i++) {
        let r = t * seg + i;
        if (r < steps) {
            let k = (b * d.len + c * q + r) * d.heads + h;
            let pre = dt_raw[k] + dt_bias[h];
            let sp = softplus(pre);
            let dt = clamp(sp, d.dt_min, d.dt_max);
            let da = dadt[k];
            d_a += dt * da;
            var g = dscale[k] + a * da;
            if (sp < d.dt_min || sp > d.dt_max) { g = 0.0; }  // torch.clamp passes the gradient at the bounds
            g *= select(sigmoid(pre), 1.0, pre > 20.0);
            ddt_raw[k] = g;
            d_bias += g;
        }
    }
    let total_a = workgroup_sum(d_a, t);
    let total_bias = workgroup_sum(d_bias, t);
    if (t == 0u) {
        let k = ((b * d.nchunks + c) * d.heads + h) * 2u;
        param_part[k] = total_a * a;  // ∂/∂A_log = ∂/∂A · A
        param_part[k + 1u] = total_bias;
    }
}

// Per head: add the partials param_part [parts, H, NPARAM] into grad_0 (and grad_1 when NPARAM = 2) [H]
// (ACCUMULATE adds to them), in a fixed order: thread l of 64 sums the partials bc ≡ l (mod 64) in order, then
// a tree over the 64 (a walk of all of them in one thread waited on one load after another: ~20 µs a call at 64
// partials). Partials [seg_lo, seg_hi) of the B·nchunks; the 64 running sums carried in `carry`
// [H, NPARAM, 64] between segments, so any segmentation gives the same bits. Grid (H, 1, 1).
@compute @workgroup_size(64)
fn ssd_param_grads(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) l: u32) {
    let h = wid.x;
    var s0 = 0.0;
    var s1 = 0.0;
    if (d.seg_lo > 0u) {
        s0 = carry[(h * NPARAM) * 64u + l];
        if (NPARAM == 2u) { s1 = carry[(h * NPARAM + 1u) * 64u + l]; }
    }
    var first = d.seg_lo - d.seg_lo % 64u + l;
    if (first < d.seg_lo) { first += 64u; }
    for (var bc = first; bc < d.seg_hi; bc += 64u) {
        let k = (bc * d.heads + h) * NPARAM;
        s0 += param_part[k];
        if (NPARAM == 2u) { s1 += param_part[k + 1u]; }
    }
    if (d.seg_hi < d.batch * d.nchunks) {  // more segments to come (uniform over the workgroup)
        carry[(h * NPARAM) * 64u + l] = s0;
        if (NPARAM == 2u) { carry[(h * NPARAM + 1u) * 64u + l] = s1; }
        return;
    }
    t_mid[l] = s0;
    t_mid[64u + l] = s1;
    workgroupBarrier();
    for (var half = 32u; half > 0u; half >>= 1u) {
        if (l < half) {
            t_mid[l] += t_mid[l + half];
            t_mid[64u + l] += t_mid[64u + l + half];
        }
        workgroupBarrier();
    }
    if (l != 0u) { return; }
    var g0 = t_mid[0];
    var g1 = t_mid[64];
    if (ACCUMULATE) {
        g0 += grad_0[h];
        if (NPARAM == 2u) { g1 += grad_1[h]; }
    }
    grad_0[h] = g0;
    if (NPARAM == 2u) { grad_1[h] = g1; }
}

// One recurrent decoding step: Δ = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), S = exp(Δ A) S + Δ x Bᵀ,
// y = S C + D x, with x, y [B, H·P], dt_raw [B, H] (columns [dt_col, dt_col + H) of rows dt_stride apart), B, C
// [B, G·N] and ssm_state [B, H, P, N] read and updated. STEP_LANES threads take a row (b, h, p) of S, each the
// states n ≡ its lane (mod STEP_LANES) (consecutive threads, consecutive n), and a tree in t_mid adds their parts of
// y: on GPUs 32 (one thread walking all N states of its row was latency-bound: 26 µs a Mamba-2 layer on the H200,
// 24 workgroups busy); on CPU adapters 1, no tree (lavapipe's barriers cost more than the walk: 2.2× the time).
// Grid grid_1d(B·H·P·STEP_LANES, 256).
override STEP_LANES: u32 = 32u;

@compute @workgroup_size(256)
fn ssd_step(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) t: u32) {
    let i = (gid.y * nwg.x * 256u + gid.x) / STEP_LANES;  // the row of S
    let lane = t % STEP_LANES;
    let inside = i < d.batch * d.heads * d.headdim;
    let h = (i / d.headdim) % d.heads;
    var acc = 0.0;
    if (inside) {
        let b = i / (d.headdim * d.heads);
        let g = h / (d.heads / d.ngroups);
        let dt = clamp(softplus(dt_raw[b * d.dt_stride + d.dt_col + h] + dt_bias[h]), d.dt_min, d.dt_max);
        let decay = exp(dt * -exp(A_log[h]));
        let xd = dt * x[i];
        let bc = (b * d.ngroups + g) * d.nstate;
        for (var n = lane; n < d.nstate; n += STEP_LANES) {
            let k = i * d.nstate + n;
            let sv = decay * ssm_state[k] + xd * b_in[bc + n];
            ssm_state[k] = sv;
            acc += sv * c_in[bc + n];
        }
    }
    if (STEP_LANES > 1u) {
        t_mid[t] = acc;
        workgroupBarrier();
        for (var half = STEP_LANES / 2u; half > 0u; half >>= 1u) {
            if (lane < half) { t_mid[t] += t_mid[t + half]; }
            workgroupBarrier();
        }
        acc = t_mid[t];
    }
    if (inside && lane == 0u) { out[i] = acc + skip[h] * x[i]; }
}

// ==== The tile engine: every chunk-level product of the SSD as one batched, masked GEMM ====================
// ssd_tile computes one 64 × 64 output tile per 256-thread workgroup, each thread a 4 × 4 register block
// (rows 4·ty + i, columns 4·tx + j; a warp covers 8 column blocks × 4 row blocks, as linear.wgsl's matmul, so
// its shared reads are 8 consecutive vec4s or broadcasts), stepping K by 16 through double-buffered shared
// tiles (k-major vec4 rows, one barrier a step; the next step's operands are loaded from memory into registers
// while this one is multiplied), the 16 k steps written out so every shared index but the thread's is a
// constant. Each product has one or two K phases whose operands are read by mode-specific loaders that apply
// the decay mask and the scales while they stage (so no masked matrix is ever stored). MODE picks (per batch b,
// chunk c, head h or group g; t, s positions in the chunk, p < P, n < N, hpg = H / G heads per group):
//   M_CB     CB[t, s] = C_t·B_s                                 per group, tiles s ≤ t only
//   M_Y      y[t, p] = exp(cs_t) C_t·E[p] + Σ_{s ≤ t} CB[t, s] w_ts sc_s x_s[p] (+ D x_t[p]),
//            w_ts = exp(Σ a over (s, t])
//   M_STATE  S[p, n] = Σ_s v_s left_s[p] right_s[n]: x, B, v = exp(cs_end − cs_s) sc_s (the state a chunk
//            adds) or (GRAD) dy, C, v = exp(cs_s) (dE's in-chunk part)
//   M_DXD    dxd[s, p] = exp(cs_end − cs_s) B_s·dS[p] + Σ_{t ≥ s} CB[t, s] w_ts dy_t[p]; then
//            dx = sc dxd (+ D dy), and the row dots x_s·dxd_s (dscale), sc_s x_s·(state term) (V_s), ∂D's part
//            (HAS_DIAG: t > s only; dx += d_s CB[s, s] dy_s and ∂diag_s = CB[s, s] x_s·dy_s into x_part,
//            laid out as row_part)
//   M_DCB    dCB[t, s] = Σ_{heads of g} w_ts sc_s dy_t·x_s (s ≤ t), and per head the crossing sums of
//            T_ts = CB[t, s] w_ts sc_s dy_t·x_s (the pair terms of ∂loss/∂a; see ssd_dcb_crossing)
//   M_DB     dB[s, n] = Σ_{t ≥ s} dCB[t, s] C_t[n] + Σ_{heads, p} exp(cs_end − cs_s) sc_s x_s[p] dS[p, n]
//   M_DC     dC[t, n] = Σ_{s ≤ t} dCB[t, s] B_s[n] + Σ_{heads, p} exp(cs_t) dy_t[p] E[p, n]
// CB and dCB are per (b, chunk, group): C Bᵀ is formed once for all heads of a group (at G = 1 that is 24×
// fewer FLOPs than per head), and dB, dC take their sum over the group's heads as one K range of hpg·P (the
// group's heads are contiguous in x, dy and the states). The pair decays w_ts come from `dec`'s direct sums
// (the header: never differences of chunk-long cumsums), with the sums over whole sub-blocks between the
// workgroup's row sub-blocks and every sub-block of the chunk in t_mid.
const M_CB: u32 = 0u;
const M_Y: u32 = 1u;
const M_STATE: u32 = 2u;
const M_DXD: u32 = 3u;
const M_DCB: u32 = 4u;
const M_DB: u32 = 5u;
const M_DC: u32 = 6u;
override MODE: u32 = 0u;
override VEC4: bool = false;  // P, N, the chunk and L multiples of 4: every operand load is one vec4

// batch..nchunks as Dims; hsplit: M_DCB's workgroups per group (each takes heads_per_split of its heads,
// writing its own dCB plane; dB and dC add the planes in order).
// x_stride, x_col: x's row stride and first column (H·P and 0, or a wider matrix read in place: Mamba-3's
// in_proj output); dx_stride, dx_col: the same for M_DXD's dx (written into in_proj's gradient in place).
struct TileDims { batch: u32, len: u32, heads: u32, ngroups: u32, headdim: u32, nstate: u32, chunk: u32,
                  nchunks: u32, hsplit: u32, heads_per_split: u32, x_stride: u32, x_col: u32, dx_stride: u32,
                  dx_col: u32 }
@group(0) @binding(43) var<uniform> td: TileDims;
@group(0) @binding(44) var<storage, read> xv: array<vec4<f32>>;      // x [B, L, H, P], rows x_stride apart
@group(0) @binding(45) var<storage, read> dyv: array<vec4<f32>>;     // dy [B, L, H, P]
@group(0) @binding(46) var<storage, read> bv: array<vec4<f32>>;      // B [B, L, G, N]
@group(0) @binding(47) var<storage, read> cv: array<vec4<f32>>;      // C [B, L, G, N]
// CB [B, nchunks, G, Q, Q] (M_Y, M_DXD, M_DCB) or the dCB planes [hsplit, B, nchunks, G, Q, Q] (M_DB, M_DC)
@group(0) @binding(48) var<storage, read> pairv: array<vec4<f32>>;
@group(0) @binding(49) var<storage, read> stv: array<vec4<f32>>;     // E or dS [B, nchunks, H, P, N]
@group(0) @binding(50) var<storage, read_write> tile_out: array<vec4<f32>>;
// Row dots per 64-column tile of P: [B, H, nchunks, ceil(P / 64), Q] (M_Y: U; M_DXD: x·dxd, and V in row_part2)
@group(0) @binding(51) var<storage, read_write> row_part: array<f32>;
@group(0) @binding(52) var<storage, read_write> row_part2: array<f32>;
@group(0) @binding(53) var<storage, read_write> tile_part: array<f32>;  // M_DXD: Σ dy·x per workgroup (∂D)
@group(0) @binding(55) var<storage, read> decv: array<vec4<f32>>;       // `dec` again, for vec4 loads

const SROW: u32 = 17u;              // vec4s per staged k row: 16 + 1 of padding (transposed stores 2-way at most)
const B_OFF: u32 = 2u * 16u * SROW;  // B's two buffers follow A's
// A's and B's double-buffered tiles; M_DCB reuses the first 1024 vec4s as its 64 × 64 crossing tile F.
var<workgroup> stage: array<vec4<f32>, 2u * B_OFF>;
var<workgroup> t_red: array<f32, 1024>;    // row dots: [row][tx]; M_DCB: row and column partial sums
var<workgroup> t_row_lo: array<f32, 64>;   // the tile rows' sub-block prefix sums (LO)
var<workgroup> t_row_rlo: array<f32, 64>;  // and suffix sums (RLO)
// the state term's row factor: exp(cs) (M_Y), exp(cs_end − cs) (M_DXD); M_DCB with HAS_DIAG: the columns'
// diagonal weight (no new arrays: see the note on workgroup memory at the top)
var<workgroup> t_row_w: array<f32, 64>;
var<workgroup> t_row_sc: array<f32, 64>;   // the rows' scale s (M_DXD: dx = s dxd, V = s x·(state term))
// M_DCB: the tile columns' LO, RLO and scale; M_DXD with HAS_DIAG: the rows' C_s·B_s (CB's diagonal) in t_col_lo
// and their diagonal weight in t_col_rlo
var<workgroup> t_col_lo: array<f32, 64>;
var<workgroup> t_col_rlo: array<f32, 64>;
var<workgroup> t_col_sc: array<f32, 64>;
var<workgroup> t_mid: array<f32, 256>;     // [row sub-block (4)][chunk sub-block (≤ 64)]: Σ a strictly between

var<private> e_tx: u32;
var<private> e_ty: u32;
var<private> e_b: u32;
var<private> e_c: u32;
var<private> e_h: u32;      // the head (M_Y, M_STATE, M_DXD, M_DCB's current one)
var<private> e_g: u32;
var<private> e_m0: u32;     // the tile's first row and column
var<private> e_n0: u32;
var<private> e_t0: u32;     // the chunk's first position
var<private> e_steps: u32;  // valid positions in the chunk
var<private> e_kb1: u32;    // phase 1's K range [kb1, ke1), phase 2's [kb2, ke2)
var<private> e_ke1: u32;
var<private> e_kb2: u32;
var<private> e_ke2: u32;
var<private> e_steps1: u32;  // k steps of phase 1
var<private> e_pair_end: u32;   // M_DB, M_DC: the end of the pair phase's K range
var<private> e_state_end: u32;  // and of the state phase's (hpg·P)
var<private> e_acc: mat4x4<f32>;  // e_acc[i][j]: row 4·ty + i, column 4·tx + j
var<private> e_la: vec4<f32>;
var<private> e_lb: vec4<f32>;

fn count4(start: u32, limit: u32) -> u32 { return min(4u, limit - min(start, limit)); }


fn ld4_x(i: u32, valid: u32) -> vec4<f32> {
    if (VEC4) { return select(vec4<f32>(0.0), xv[select(0u, i >> 2u, valid > 0u)], valid > 0u); }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < valid; j++) { v[j] = xv[(i + j) >> 2u][(i + j) & 3u]; }
    return v;
}
fn ld4_dy(i: u32, valid: u32) -> vec4<f32> {
    if (VEC4) { return select(vec4<f32>(0.0), dyv[select(0u, i >> 2u, valid > 0u)], valid > 0u); }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < valid; j++) { v[j] = dyv[(i + j) >> 2u][(i + j) & 3u]; }
    return v;
}
fn ld4_b(i: u32, valid: u32) -> vec4<f32> {
    if (VEC4) { return select(vec4<f32>(0.0), bv[select(0u, i >> 2u, valid > 0u)], valid > 0u); }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < valid; j++) { v[j] = bv[(i + j) >> 2u][(i + j) & 3u]; }
    return v;
}
fn ld4_c(i: u32, valid: u32) -> vec4<f32> {
    if (VEC4) { return select(vec4<f32>(0.0), cv[select(0u, i >> 2u, valid > 0u)], valid > 0u); }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < valid; j++) { v[j] = cv[(i + j) >> 2u][(i + j) & 3u]; }
    return v;
}
fn ld4_st(i: u32, valid: u32) -> vec4<f32> {
    if (VEC4) { return select(vec4<f32>(0.0), stv[select(0u, i >> 2u, valid > 0u)], valid > 0u); }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < valid; j++) { v[j] = stv[(i + j) >> 2u][(i + j) & 3u]; }
    return v;
}
// CB (one plane) or the sum of the hsplit dCB planes, in plane order.
fn ld4_pair(i: u32, valid: u32, planes: u32) -> vec4<f32> {
    let plane = td.batch * td.nchunks * td.ngroups * td.chunk * td.chunk;
    var v = vec4<f32>(0.0);
    for (var sp = 0u; sp < planes; sp++) {
        let k = i + sp * plane;
        if (VEC4) {
            v += select(vec4<f32>(0.0), pairv[select(0u, k >> 2u, valid > 0u)], valid > 0u);
        } else {
            for (var j = 0u; j < valid; j++) { v[j] += pairv[(k + j) >> 2u][(k + j) & 3u]; }
        }
    }
    return v;
}

// Element (position pos of the chunk, head h, channel p) of x, of dy and y ([B, L, H, P]), and of dx.
fn e_xi(pos: u32, h: u32, p: u32) -> u32 {
    return (e_b * td.len + e_t0 + pos) * td.x_stride + td.x_col + h * td.headdim + p;
}
fn e_yi(pos: u32, h: u32, p: u32) -> u32 { return ((e_b * td.len + e_t0 + pos) * td.heads + h) * td.headdim + p; }
fn e_dxi(pos: u32, h: u32, p: u32) -> u32 {
    return (e_b * td.len + e_t0 + pos) * td.dx_stride + td.dx_col + h * td.headdim + p;
}
fn e_bci(pos: u32, n: u32) -> u32 { return ((e_b * td.len + e_t0 + pos) * td.ngroups + e_g) * td.nstate + n; }
fn e_pri(t: u32, s: u32) -> u32 {
    return (((e_b * td.nchunks + e_c) * td.ngroups + e_g) * td.chunk + t) * td.chunk + s;
}
fn e_sti(h: u32, p: u32, n: u32) -> u32 {
    return (((e_b * td.nchunks + e_c) * td.heads + h) * td.headdim + p) * td.nstate + n;
}
fn e_dec(h: u32, row: u32, r: u32) -> f32 {
    return dec[(((e_b * td.heads + h) * td.nchunks + e_c) * ROWS + row) * td.chunk + r];
}

// Four consecutive positions s0 .. s0 + 3 (s0 a multiple of 4) of row `row` of `dec` for head e_h: one vec4
// load where the chunk is a multiple of 4 (the row then starts on a vec4); past the chunk's end read as 0.
fn dec4(row: u32, s0: u32) -> vec4<f32> {
    let base = (((e_b * td.heads + e_h) * td.nchunks + e_c) * ROWS + row) * td.chunk;
    if (VEC4) { return select(vec4<f32>(0.0), decv[(base + min(s0, td.chunk - 4u)) >> 2u], s0 < td.chunk); }
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < count4(s0, td.chunk); j++) { v[j] = dec[base + s0 + j]; }
    return v;
}

// The sub-block sums of head h for the tile rows and t_mid for every chunk sub-block (tid < 256).
fn stage_row_decays(h: u32, tid: u32) {
    let q = td.chunk;
    if (tid < 64u) {
        let r = e_m0 + tid;
        var lo = 0.0;
        var rlo = 0.0;
        if (r < q) {
            lo = e_dec(h, LO, r);
            rlo = e_dec(h, RLO, r);
        }
        t_row_lo[tid] = lo;
        t_row_rlo[tid] = rlo;
    }
    let nsub = (q + SUB - 1u) / SUB;
    let i = tid / 64u;  // row sub-block of the tile
    let j = tid % 64u;  // chunk sub-block
    let kr = e_m0 / SUB + i;
    var between = 0.0;
    if (j < nsub) {
        for (var k = min(kr, j) + 1u; k < max(kr, j); k++) {
            if (k * SUB + SUB <= q) { between += e_dec(h, LO, k * SUB + SUB - 1u); }
        }
    }
    t_mid[i * 64u + j] = between;
}

// This thread's 4 elements of A for the k step at k0 (phase 1 or 2), as the loaders described above.
// K-contiguous A: row (t >> 2), k0 + 4 (t & 3) .. + 3; M-contiguous: rows 4 (t & 15) .. + 3 at k0 + (t >> 4).
fn fetch_a(t: u32, k0: u32, phase2: bool) -> vec4<f32> {
    let r = t >> 2u;
    let kk = k0 + (t & 3u) * 4u;
    let km = k0 + (t >> 4u);
    let m4 = (t & 15u) * 4u;
    let hpg = td.heads / td.ngroups;
    if (MODE == M_CB) {
        return ld4_c(e_bci(e_m0 + r, kk), select(0u, count4(kk, e_ke1), e_m0 + r < e_steps));
    }
    if (MODE == M_Y && !phase2) {
        return ld4_c(e_bci(e_m0 + r, kk), select(0u, count4(kk, e_ke1), e_m0 + r < e_steps)) * t_row_w[r];
    }
    if (MODE == M_Y) {  // CB[t, s] w_ts sc_s for s ≤ t
        // w_ts = exp(Σ a over (s, t]) by direct sums: within one sub-block LO_t − LO_s, else
        // RLO_s + (the whole sub-blocks between: t_mid) + LO_t. kk .. kk + 3 lie in one sub-block.
        let tpos = e_m0 + r;
        var v = ld4_pair(e_pri(tpos, kk), select(0u, count4(kk, e_ke2), tpos < e_steps), 1u);
        var sc = dec4(SCALE, kk);
        if (HAS_DIAG && tpos >= kk && tpos < min(kk + 4u, td.chunk)) { sc[tpos - kk] = e_dec(e_h, DIAG, tpos); }
        var decay = t_row_lo[r] + dec4(RLO, kk) + t_mid[(r / SUB) * 64u + kk / SUB];
        if (tpos / SUB == kk / SUB) { decay = t_row_lo[r] - dec4(LO, kk); }
        for (var j = 0u; j < 4u; j++) {
            let ok = kk + j <= tpos && tpos < e_steps;
            v[j] = select(0.0, v[j] * exp(min(decay[j], 0.0)) * sc[j], ok);
        }
        return v;
    }
    if (MODE == M_STATE) {  // left_s[p .. p + 3] v_s
        let s = km;
        var w = 0.0;
        if (s < e_ke1) { w = t_red[s]; }  // stage_state_weights
        let valid = select(0u, count4(e_m0 + m4, td.headdim), s < e_ke1);
        if (GRAD) { return ld4_dy(e_yi(min(s, e_steps - 1u), e_h, e_m0 + m4), valid) * w; }
        return ld4_x(e_xi(min(s, e_steps - 1u), e_h, e_m0 + m4), valid) * w;
    }
    if (MODE == M_DXD && !phase2) {
        return ld4_b(e_bci(e_m0 + r, kk), select(0u, count4(kk, e_ke1), e_m0 + r < e_steps)) * t_row_w[r];
    }
    if (MODE == M_DXD) {  // CB[t, s] w_ts for t ≥ s: rows s = m0 + m4 .. + 3 (one sub-block), k = t
        let tpos = km;
        let s0 = e_m0 + m4;
        var v = ld4_pair(e_pri(min(tpos, td.chunk - 1u), s0), select(0u, count4(s0, e_steps), tpos < e_ke2), 1u);
        let lo_t = e_dec(e_h, LO, min(tpos, td.chunk - 1u));
        let rows = vec4<f32>(t_row_lo[m4], t_row_lo[m4 + 1u], t_row_lo[m4 + 2u], t_row_lo[m4 + 3u]);
        let rrows = vec4<f32>(t_row_rlo[m4], t_row_rlo[m4 + 1u], t_row_rlo[m4 + 2u], t_row_rlo[m4 + 3u]);
        var decay = vec4<f32>(lo_t) + rrows + t_mid[(m4 / SUB) * 64u + min(tpos, td.chunk - 1u) / SUB];
        if (tpos / SUB == s0 / SUB) { decay = vec4<f32>(lo_t) - rows; }
        for (var j = 0u; j < 4u; j++) {
            // with HAS_DIAG the diagonal (t = s) is added in the epilogue, weighted by diag_s instead of sc_s
            let ok = (tpos > s0 + j || (!HAS_DIAG && tpos == s0 + j)) && tpos < e_ke2 && s0 + j < e_steps;
            v[j] = select(0.0, v[j] * exp(min(decay[j], 0.0)), ok);
        }
        return v;
    }
    if (MODE == M_DCB) {
        return ld4_dy(e_yi(e_m0 + r, e_h, kk), select(0u, count4(kk, td.headdim), e_m0 + r < e_steps));
    }
    if (MODE == M_DB && !phase2) {  // dCB[t, s .. s + 3]: rows s, k = t ≥ m0
        let tpos = km;
        return ld4_pair(e_pri(min(tpos, td.chunk - 1u), e_m0 + m4), select(0u, count4(e_m0 + m4, e_steps),
                        tpos < e_ke1), td.hsplit);
    }
    if (MODE == M_DC && phase2) {  // dCB[t, s .. s + 3]: rows t, k = s
        return ld4_pair(e_pri(e_m0 + r, kk), select(0u, count4(kk, e_pair_end), e_m0 + r < e_steps), td.hsplit);
    }
    // M_DB / M_DC state phase: K = (head of the group, p), contiguous in x / dy; a per-(row, head) weight.
    let row = e_m0 + r;
    let valid = select(0u, count4(kk, e_state_end), row < e_steps);
    let rr = min(row, td.chunk - 1u);
    var v = vec4<f32>(0.0);
    if (MODE == M_DB) { v = ld4_x(e_xi(min(row, e_steps - 1u), e_g * hpg, kk), valid); }
    else { v = ld4_dy(e_yi(min(row, e_steps - 1u), e_g * hpg, kk), valid); }
    if (VEC4) {  // P is a multiple of 4: the 4 elements are of one head
        let h = e_g * hpg + min(kk / td.headdim, hpg - 1u);
        var w = 0.0;
        if (MODE == M_DB) { w = exp(e_dec(h, SFX, rr)) * e_dec(h, SCALE, rr); } else { w = exp(e_dec(h, CS, rr)); }
        return v * w;
    }
    for (var j = 0u; j < valid; j++) {
        let h = e_g * hpg + (kk + j) / td.headdim;
        var w = 0.0;
        if (MODE == M_DB) { w = exp(e_dec(h, SFX, rr)) * e_dec(h, SCALE, rr); } else { w = exp(e_dec(h, CS, rr)); }
        v[j] *= w;
    }
    return v;
}

// This thread's 4 elements of B: K-contiguous B (stored [n][k]): column (t >> 2), k0 + 4 (t & 3) .. + 3;
// N-contiguous: columns 4 (t & 15) .. + 3 at k0 + (t >> 4).
fn fetch_b(t: u32, k0: u32, phase2: bool) -> vec4<f32> {
    let cn = t >> 2u;
    let kk = k0 + (t & 3u) * 4u;
    let km = k0 + (t >> 4u);
    let n4 = e_n0 + (t & 15u) * 4u;
    let hpg = td.heads / td.ngroups;
    if (MODE == M_CB) {
        return ld4_b(e_bci(e_n0 + cn, kk), select(0u, count4(kk, e_ke1), e_n0 + cn < e_steps));
    }
    if ((MODE == M_Y || MODE == M_DXD) && !phase2) {  // E[p] or dS[p]: column p, k = n
        return ld4_st(e_sti(e_h, e_n0 + cn, kk), select(0u, count4(kk, td.nstate), e_n0 + cn < td.headdim));
    }
    let kmc = min(km, e_steps - 1u);
    if (MODE == M_Y) { return ld4_x(e_xi(kmc, e_h, n4), select(0u, count4(n4, td.headdim), km < e_ke2)); }
    if (MODE == M_STATE) {
        let valid = select(0u, count4(n4, td.nstate), km < e_ke1);
        if (GRAD) { return ld4_c(e_bci(kmc, n4), valid); }
        return ld4_b(e_bci(kmc, n4), valid);
    }
    if (MODE == M_DXD) { return ld4_dy(e_yi(kmc, e_h, n4), select(0u, count4(n4, td.headdim), km < e_ke2)); }
    if (MODE == M_DCB) {
        return ld4_x(e_xi(e_n0 + cn, e_h, kk), select(0u, count4(kk, td.headdim), e_n0 + cn < e_steps));
    }
    if (MODE == M_DB && !phase2) { return ld4_c(e_bci(kmc, n4), select(0u, count4(n4, td.nstate), km < e_ke1)); }
    if (MODE == M_DC && phase2) {
        return ld4_b(e_bci(kmc, n4), select(0u, count4(n4, td.nstate), km < e_pair_end));
    }
    // dS or E of the group's heads: row k = (head, p) of [H·P, N] from the group's first head.
    let row = min(km, e_state_end - 1u);
    let i = (((e_b * td.nchunks + e_c) * td.heads + e_g * hpg) * td.headdim + row) * td.nstate + n4;
    return ld4_st(i, select(0u, count4(n4, td.nstate), km < e_state_end));
}

fn a_kcontig(phase2: bool) -> bool {
    if (MODE == M_STATE) { return false; }
    if (MODE == M_DXD && phase2) { return false; }
    if (MODE == M_DB && !phase2) { return false; }
    return true;
}

fn b_kcontig(phase2: bool) -> bool {
    if (MODE == M_CB || MODE == M_DCB) { return true; }
    if ((MODE == M_Y || MODE == M_DXD) && !phase2) { return true; }
    return false;
}

// Step `step`'s operands into registers, of phase 2 or 1 as `phase2` says: e_run calls it with a literal, so each
// of its loops is compiled for one phase's loaders only (H200: see e_run).
fn e_fetch(t: u32, step: u32, phase2: bool) {
    var k0 = e_kb1 + step * 16u;
    if (phase2) { k0 = e_kb2 + (step - e_steps1) * 16u; }
    e_la = fetch_a(t, k0, phase2);
    e_lb = fetch_b(t, k0, phase2);
}

fn e_commit(t: u32, buf: u32, phase2: bool) {
    if (a_kcontig(phase2)) {  // transpose: the four k values go to four k rows
        let m = t >> 2u;
        let k = (t & 3u) * 4u;
        let base = buf * 16u * SROW + m / 4u;
        stage[base + k * SROW][m % 4u] = e_la.x;
        stage[base + (k + 1u) * SROW][m % 4u] = e_la.y;
        stage[base + (k + 2u) * SROW][m % 4u] = e_la.z;
        stage[base + (k + 3u) * SROW][m % 4u] = e_la.w;
    } else {
        stage[(buf * 16u + (t >> 4u)) * SROW + (t & 15u)] = e_la;
    }
    if (b_kcontig(phase2)) {
        let n = t >> 2u;
        let k = (t & 3u) * 4u;
        let base = B_OFF + buf * 16u * SROW + n / 4u;
        stage[base + k * SROW][n % 4u] = e_lb.x;
        stage[base + (k + 1u) * SROW][n % 4u] = e_lb.y;
        stage[base + (k + 2u) * SROW][n % 4u] = e_lb.z;
        stage[base + (k + 3u) * SROW][n % 4u] = e_lb.w;
    } else {
        stage[B_OFF + (buf * 16u + (t >> 4u)) * SROW + (t & 15u)] = e_lb;
    }
}

// Step `step` staged into buffer `buf`, whichever phase it is in.
fn e_stage(t: u32, step: u32, buf: u32) {
    if (step >= e_steps1) {
        e_fetch(t, step, true);
        e_commit(t, buf, true);
    } else {
        e_fetch(t, step, false);
        e_commit(t, buf, false);
    }
}

fn e_kstep(buf: u32, k: u32) {
    let a = stage[(buf * 16u + k) * SROW + e_ty];
    let b = stage[B_OFF + (buf * 16u + k) * SROW + e_tx];
    e_acc = mat4x4<f32>(fma(vec4<f32>(a.x), b, e_acc[0]), fma(vec4<f32>(a.y), b, e_acc[1]),
                      fma(vec4<f32>(a.z), b, e_acc[2]), fma(vec4<f32>(a.w), b, e_acc[3]));
}

fn e_multiply(buf: u32) {
    e_kstep(buf, 0u); e_kstep(buf, 1u); e_kstep(buf, 2u); e_kstep(buf, 3u);
    e_kstep(buf, 4u); e_kstep(buf, 5u); e_kstep(buf, 6u); e_kstep(buf, 7u);
    e_kstep(buf, 8u); e_kstep(buf, 9u); e_kstep(buf, 10u); e_kstep(buf, 11u);
    e_kstep(buf, 12u); e_kstep(buf, 13u); e_kstep(buf, 14u); e_kstep(buf, 15u);
}

// Σ over the tile's 16 column blocks of this thread's per-row values, in order, for the 64 rows:
// returns the sum of row r = tid (valid for tid < 64). Ends with a barrier (t_red is reused).
fn row_sum(part: vec4<f32>, tid: u32) -> f32 {
    for (var i = 0u; i < 4u; i++) { t_red[(e_ty * 4u + i) * 16u + e_tx] = part[i]; }
    workgroupBarrier();
    var sum = 0.0;
    if (tid < 64u) {
        for (var k = 0u; k < 16u; k++) { sum += t_red[tid * 16u + k]; }
    }
    workgroupBarrier();
    return sum;
}

// Row dots of the accumulator with x over this thread's 4 columns.
fn row_dots_x() -> vec4<f32> {
    var part = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        let r = e_m0 + e_ty * 4u + i;
        let n = e_n0 + e_tx * 4u;
        let valid = select(0u, count4(n, td.headdim), r < e_steps);
        part[i] = dot(e_acc[i], ld4_x(e_xi(min(r, e_steps - 1u), e_h, n), valid));
    }
    return part;
}

// Row dots of the accumulator with C_t over this thread's 4 columns n (M_DC).
fn row_dots_c() -> vec4<f32> {
    var part = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        let r = e_m0 + e_ty * 4u + i;
        let n = e_n0 + e_tx * 4u;
        let valid = select(0u, count4(n, td.nstate), r < e_steps);
        part[i] = dot(e_acc[i], ld4_c(e_bci(min(r, e_steps - 1u), n), valid));
    }
    return part;
}

// K steps [first, last) of phase 1 then phase 2, added into e_acc (uniform trip counts: the barriers stay in
// uniform control flow). Its last multiply is not followed by a barrier: whoever reuses `stage` next must
// first pass one. One loop a phase, each compiled with that phase's loaders only (one loop choosing them step by
// step, and M_STATE's weights loaded each step: a Mamba-2 130m SSD layer 1.72 ms in the tiles, 1.46 with both
// changed; M_Y 0.321 -> 0.253, M_DB 0.206 -> 0.146; H200, 2026-12-03).
fn e_run(tid: u32, first: u32, last: u32) {
    if (first >= last) { return; }
    e_stage(tid, first, 0u);
    workgroupBarrier();
    var buf = 0u;
    let mid = clamp(e_steps1, first + 1u, last);  // phase 1's steps end at mid
    for (var s = first + 1u; s < mid; s++) { e_step(tid, s, buf, false); buf ^= 1u; }
    for (var s = mid; s < last; s++) { e_step(tid, s, buf, true); buf ^= 1u; }
    e_multiply(buf);
}

// Step s staged into the other buffer while buffer `buf` (the step before) is multiplied.
fn e_step(tid: u32, s: u32, buf: u32, phase2: bool) {
    e_fetch(tid, s, phase2);  // in flight while this step is multiplied
    e_multiply(buf);
    e_commit(tid, buf ^ 1u, phase2);
    workgroupBarrier();
}

fn zero_acc() { e_acc = mat4x4<f32>(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0)); }

fn store_row(i: u32, v: vec4<f32>, valid: u32) {
    if (VEC4) {
        if (valid > 0u) { tile_out[i >> 2u] = v; }
        return;
    }
    for (var j = 0u; j < valid; j++) { tile_out[(i + j) >> 2u][(i + j) & 3u] = v[j]; }
}

// Lower-triangular pair index x -> (row tile, column tile) with column ≤ row.
fn pair_tiles(idx: u32) -> vec2<u32> {
    var mt = u32((sqrt(8.0 * f32(idx) + 1.0) - 1.0) * 0.5);
    while (mt * (mt + 1u) / 2u > idx) { mt -= 1u; }
    while ((mt + 1u) * (mt + 2u) / 2u <= idx) { mt += 1u; }
    return vec2<u32>(mt, idx - mt * (mt + 1u) / 2u);
}

// M_DCB's crossing sums for head e_h from T in F (= stage's first 1024 vec4s as [t][(o + F_SKEW t) % 64] scalars:
// the skew spreads a column over the banks of a GPU's workgroup memory; ssd_tile_lanes sets it 0, so a row's 4
// columns of T are one vec4 store):
// X_σ = Σ_{t ≥ σ, s < σ} T_ts over this tile pair, into x_part row (pair, h) [B, H, nchunks, npairs, Q]
// (zero where the tile adds nothing). With row prefix sums F[t][o] = Σ_{s ≤ o} T_ts (direct sums):
//   σ in (n0, n0 + 64): Σ_{t ≥ σ} F[t][σ − 1 − n0];  σ in [n0 + 64, m0): Σ_t F[t][63];
//   σ in [m0, m0 + 64) when n0 < m0: Σ_{t ≥ σ} F[t][63].
override F_SKEW: u32 = 1u;
fn f_idx(t: u32, o: u32) -> u32 { return t * 64u + (o + F_SKEW * t) % 64u; }

// Its phases, separated by workgroup barriers (ssd_tile runs them once a thread, ssd_tile_lanes once a virtual
// thread tid < 256 each). Row prefix sums: 4 threads a row, 16 columns each,
fn crossing_rows(tid: u32) {
    let row = tid >> 2u;
    let quarter = tid & 3u;
    var run = 0.0;
    if (F_SKEW == 0u) {  // the quarter's 16 columns are 4 whole vec4s: the same sums in the same order
        let base = (row * 64u + quarter * 16u) >> 2u;
        for (var c = 0u; c < 4u; c++) {
            var v = stage[base + c];
            v.x += run;
            v.y += v.x;
            v.z += v.y;
            v.w += v.z;
            run = v.w;
            stage[base + c] = v;
        }
        t_red[tid] = run;
        return;
    }
    for (var o = quarter * 16u; o < quarter * 16u + 16u; o++) {
        let i = f_idx(row, o);
        run += stage[i >> 2u][i & 3u];
        stage[i >> 2u][i & 3u] = run;
    }
    t_red[tid] = run;
}

// then the earlier quarters' totals added;
fn crossing_rows_add(tid: u32) {
    let row = tid >> 2u;
    let quarter = tid & 3u;
    var before = 0.0;
    for (var k = 0u; k < quarter; k++) { before += t_red[row * 4u + k]; }
    if (F_SKEW == 0u) {
        let base = (row * 64u + quarter * 16u) >> 2u;
        for (var c = 0u; c < 4u; c++) { stage[base + c] += vec4<f32>(before); }
        return;
    }
    for (var o = quarter * 16u; o < quarter * 16u + 16u; o++) {
        let i = f_idx(row, o);
        stage[i >> 2u][i & 3u] += before;
    }
}

// column sums: 4 threads a column j (σ = n0 + 1 + j), 16 rows each; rows t ≥ σ on the diagonal tile;
fn crossing_cols(tid: u32) {
    let j = tid >> 2u;
    let quarter = tid & 3u;
    var first = 0u;
    if (e_m0 == e_n0) { first = j + 1u; }
    var col = 0.0;
    var last = 0.0;  // Σ over the quarter's rows t ≥ m0 + j of F[t][63] (the row-suffix range)
    for (var r = quarter * 16u; r < quarter * 16u + 16u; r++) {
        let i = f_idx(r, j);
        if (r >= first) { col += stage[i >> 2u][i & 3u]; }
        let i63 = f_idx(r, 63u);
        if (r >= j) { last += stage[i63 >> 2u][i63 & 3u]; }
    }
    t_red[256u + tid] = col;
    t_red[512u + tid] = last;
}

// the four quarters of each (tid < 64);
fn crossing_totals(tid: u32) {
    if (tid < 64u) {
        var cs = 0.0;
        var ls = 0.0;
        for (var k = 0u; k < 4u; k++) {
            cs += t_red[256u + tid * 4u + k];
            ls += t_red[512u + tid * 4u + k];
        }
        t_red[768u + tid] = cs;  // column part of σ = n0 + 1 + tid
        t_red[832u + tid] = ls;  // row-suffix part of σ = m0 + tid (ls of tid 0 is the tile total)
    }
}

// and X_σ out.
fn crossing_store(tid: u32, pair: u32, npairs: u32) {
    let q = td.chunk;
    let diag = e_m0 == e_n0;
    let out_base = (((e_b * td.heads + e_h) * td.nchunks + e_c) * npairs + pair) * q;
    for (var sigma = tid; sigma < q; sigma += 256u) {
        var v = 0.0;
        if (sigma > e_n0 && sigma < e_n0 + 64u) { v = t_red[768u + sigma - e_n0 - 1u]; }
        if (!diag) {
            if (sigma >= e_n0 + 64u && sigma < e_m0) { v = t_red[832u]; }
            if (sigma >= e_m0 && sigma < e_m0 + 64u) { v = t_red[832u + sigma - e_m0]; }
        }
        x_part[out_base + sigma] = v;
    }
}

fn ssd_dcb_crossing(tid: u32, pair: u32, npairs: u32) {
    crossing_rows(tid);
    workgroupBarrier();
    crossing_rows_add(tid);
    workgroupBarrier();
    crossing_cols(tid);
    workgroupBarrier();
    crossing_totals(tid);
    workgroupBarrier();
    crossing_store(tid, pair, npairs);
    workgroupBarrier();
}

// Where this workgroup's tile lies (sets e_b .. e_steps, the K ranges e_kb1 .. e_state_end, e_steps1), what
// ssd_tile and ssd_tile_lanes share; `live` false: nothing to compute (a row tile wholly in the padding, or
// M_STATE's rows past P; M_DXD's Σ dy·x slot is then zeroed by the invocation given `first`).
struct TileAt { live: bool, split: u32, npairs: u32, tiles_n: u32, row_at: u32, d_slot: u32, total: u32 }

fn tile_begin(wid: vec3<u32>, first: bool) -> TileAt {
    var at: TileAt;
    let q = td.chunk;
    let hpg = td.heads / td.ngroups;
    let tiles_q = (q + 63u) / 64u;
    at.npairs = tiles_q * (tiles_q + 1u) / 2u;
    e_b = wid.z;
    // Tile and (chunk, head / group) of this workgroup.
    at.tiles_n = (td.headdim + 63u) / 64u;  // M_Y, M_DXD: columns p
    if (MODE == M_STATE || MODE == M_DB || MODE == M_DC) { at.tiles_n = (td.nstate + 63u) / 64u; }
    at.split = 0u;
    if (MODE == M_CB || MODE == M_DCB) {
        let pt = pair_tiles(wid.x);
        e_m0 = pt.x * 64u;
        e_n0 = pt.y * 64u;
        var cg = wid.y;
        if (MODE == M_DCB) {
            at.split = wid.y % td.hsplit;
            cg = wid.y / td.hsplit;
        }
        e_c = cg / td.ngroups;
        e_g = cg % td.ngroups;
        e_h = e_g * hpg;
    } else {
        e_m0 = (wid.x / at.tiles_n) * 64u;
        e_n0 = (wid.x % at.tiles_n) * 64u;
        if (MODE == M_DB || MODE == M_DC) {
            e_c = wid.y / td.ngroups;
            e_g = wid.y % td.ngroups;
            e_h = e_g * hpg;
        } else {
            e_c = wid.y / td.heads;
            e_h = wid.y % td.heads;
            e_g = e_h / hpg;
        }
    }
    e_t0 = e_c * q;
    e_steps = min(q, td.len - e_t0);
    let row_base = ((e_b * td.heads + e_h) * td.nchunks + e_c) * at.tiles_n;
    at.row_at = (row_base + wid.x % at.tiles_n) * q;  // this tile's rows in the per-row pieces [.., tiles_n, Q]
    at.d_slot = ((e_b * td.nchunks + e_c) * td.heads + e_h) * tiles_q * at.tiles_n + wid.x;  // M_DXD's Σ dy·x
    // M_STATE's rows are P's; the others' are positions (a row tile wholly in the padding: uniform over the workgroup)
    at.live = select(e_m0 < e_steps, e_m0 < td.headdim, MODE == M_STATE);
    if (!at.live && MODE == M_DXD && first) { tile_part[at.d_slot] = 0.0; }

    // K ranges: phase 1 [kb1, ke1), phase 2 [kb2, ke2).
    e_kb1 = 0u;
    e_ke1 = 0u;
    e_kb2 = 0u;
    e_ke2 = 0u;
    let causal_end = min(e_m0 + 64u, e_steps);
    if (MODE == M_CB) { e_ke1 = td.nstate; }
    if (MODE == M_Y) { e_ke1 = td.nstate; e_ke2 = causal_end; }
    if (MODE == M_STATE) { e_ke1 = e_steps; }
    if (MODE == M_DXD) { e_ke1 = td.nstate; e_kb2 = e_m0; e_ke2 = e_steps; }
    if (MODE == M_DCB) { e_ke1 = td.headdim; }
    if (MODE == M_DB) { e_kb1 = e_m0; e_ke1 = e_steps; e_ke2 = hpg * td.headdim; }
    if (MODE == M_DC) { e_ke1 = hpg * td.headdim; e_ke2 = causal_end; }  // the state phase first (U), then pairs
    e_pair_end = e_ke1;
    e_state_end = e_ke2;
    if (MODE == M_DC) { e_pair_end = e_ke2; e_state_end = e_ke1; }
    e_steps1 = (e_ke1 - e_kb1 + 15u) / 16u;
    at.total = e_steps1 + (e_ke2 - e_kb2 + 15u) / 16u;
    return at;
}

// M_Y, M_DXD: the tile rows' factors and pair-decay tables (thread tid < 256; a barrier must follow).
fn stage_row_tables(tid: u32) {
    stage_row_decays(e_h, tid);
    if (tid < 64u) {
        let r = e_m0 + tid;
        var w = 0.0;
        var sc = 0.0;
        if (r < e_steps) {
            sc = e_dec(e_h, SCALE, r);
            if (MODE == M_Y) { w = exp(e_dec(e_h, CS, r)); } else { w = exp(e_dec(e_h, SFX, r)); }
        }
        t_row_w[tid] = w;
        t_row_sc[tid] = sc;
        if (MODE == M_DXD && HAS_DIAG) {
            var cbd = 0.0;
            var dg = 0.0;
            if (r < e_steps) {
                let i = e_pri(r, r);
                cbd = pairv[i >> 2u][i & 3u];
                dg = e_dec(e_h, DIAG, r);
            }
            t_col_lo[tid] = cbd;
            t_col_rlo[tid] = dg;
        }
    }
}

// M_STATE: the per-position weights of its K range (the chunk's steps) into t_red, exp(cs_s) (GRAD) or
// exp(cs_end − cs_s) s_s, once a workgroup instead of once a k step and thread (virtual thread tid < 256; a barrier
// must follow). Global loads of `dec` in the loader cost M_STATE ~20% on the H200.
fn stage_state_weights(tid: u32) {
    for (var s = tid; s < e_steps; s += 256u) {
        if (GRAD) { t_red[s] = exp(e_dec(e_h, CS, s)); } else { t_red[s] = exp(e_dec(e_h, SFX, s)) * e_dec(e_h, SCALE, s); }
    }
}

// M_DCB: head e_h's row and column tables of the tile pair (thread tid < 256; a barrier must follow).
fn stage_dcb_tables(tid: u32) {
    let q = td.chunk;
    if (tid < 64u) {
        let r = e_m0 + tid;
        let o = e_n0 + tid;
        var lo = 0.0;
        var clo = 0.0;
        var crlo = 0.0;
        var csc = 0.0;
        var cdg = 0.0;
        if (r < q) { lo = e_dec(e_h, LO, r); }
        if (o < q) {
            clo = e_dec(e_h, LO, o);
            crlo = e_dec(e_h, RLO, o);
            csc = e_dec(e_h, SCALE, o);
            if (HAS_DIAG) { cdg = e_dec(e_h, DIAG, o); }
        }
        t_row_lo[tid] = lo;
        t_col_lo[tid] = clo;
        t_col_rlo[tid] = crlo;
        t_col_sc[tid] = csc;
        t_row_w[tid] = cdg;
    } else if (tid < 80u) {
        let kr = e_m0 / SUB + (tid - 64u) / 4u;
        let ko = e_n0 / SUB + (tid - 64u) % 4u;
        var between = 0.0;
        for (var k = min(kr, ko) + 1u; k < max(kr, ko); k++) {
            if (k * SUB + SUB <= q) { between += e_dec(e_h, LO, k * SUB + SUB - 1u); }
        }
        t_mid[tid - 64u] = between;
    }
}

// M_DCB: head e_h's term of dCB on this thread's 4 × 4 block (e_acc = dy_t·x_s there), and T = that · CB into F.
// A row's 4 columns s at once: they lie in one sub-block of SUB, so the pair decay takes one form for all four
// (element by element, the indexing of e_acc and of the result by both loop variables cost lavapipe ~5× more).
fn dcb_block() -> mat4x4<f32> {
    let q = td.chunk;
    let o0 = e_tx * 4u;
    let s0 = e_n0 + o0;
    let s4 = vec4<u32>(s0) + vec4<u32>(0u, 1u, 2u, 3u);
    let col_lo = vec4<f32>(t_col_lo[o0], t_col_lo[o0 + 1u], t_col_lo[o0 + 2u], t_col_lo[o0 + 3u]);
    let col_rlo = vec4<f32>(t_col_rlo[o0], t_col_rlo[o0 + 1u], t_col_rlo[o0 + 2u], t_col_rlo[o0 + 3u]);
    var csc = vec4<f32>(t_col_sc[o0], t_col_sc[o0 + 1u], t_col_sc[o0 + 2u], t_col_sc[o0 + 3u]);
    let cdg = vec4<f32>(t_row_w[o0], t_row_w[o0 + 1u], t_row_w[o0 + 2u], t_row_w[o0 + 3u]);
    var g = mat4x4<f32>(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var i = 0u; i < 4u; i++) {
        let r = e_ty * 4u + i;
        let t = e_m0 + r;
        let cbv = ld4_pair(e_pri(min(t, q - 1u), s0), select(0u, count4(s0, q), t < e_steps), 1u);
        var dsum = vec4<f32>(t_row_lo[r]) - col_lo;
        if (t / SUB != s0 / SUB) { dsum = vec4<f32>(t_row_lo[r]) + col_rlo + vec4<f32>(t_mid[(r / SUB) * 4u + o0 / SUB]); }
        var w = csc;
        if (HAS_DIAG) { w = select(csc, cdg, s4 == vec4<u32>(t)); }  // step t's own term: weight diag_t
        let ok = s4 <= vec4<u32>(t) & vec4<bool>(t < e_steps);
        let gv = select(vec4<f32>(0.0), e_acc[i] * exp(min(dsum, vec4<f32>(0.0))) * w, ok);
        g[i] = gv;
        let tv = gv * cbv;
        if (F_SKEW == 0u) {
            stage[f_idx(r, o0) >> 2u] = tv;
            continue;
        }
        let f0 = f_idx(r, o0);
        let f1 = f_idx(r, o0 + 1u);
        let f2 = f_idx(r, o0 + 2u);
        let f3 = f_idx(r, o0 + 3u);
        stage[f0 >> 2u][f0 & 3u] = tv.x;
        stage[f1 >> 2u][f1 & 3u] = tv.y;
        stage[f2 >> 2u][f2 & 3u] = tv.z;
        stage[f3 >> 2u][f3 & 3u] = tv.w;
    }
    return g;
}

// M_DCB: this thread's block of the summed dCB into plane `split`.
fn dcb_store(dcb: mat4x4<f32>, split: u32) {
    let q = td.chunk;
    let plane = td.batch * td.nchunks * td.ngroups * q * q;
    for (var i = 0u; i < 4u; i++) {
        let t = e_m0 + e_ty * 4u + i;
        let s = e_n0 + e_tx * 4u;
        if (t < q) { store_row(split * plane + e_pri(t, s), dcb[i], count4(s, q)); }
    }
}

// M_CB, M_Y, M_STATE, M_DB, M_DC: this thread's block of the output.
fn store_block() {
    let q = td.chunk;
    for (var i = 0u; i < 4u; i++) {
        let r = e_m0 + e_ty * 4u + i;
        let n = e_n0 + e_tx * 4u;
        if (MODE == M_CB) {
            if (r < q) { store_row(e_pri(r, n), e_acc[i], count4(n, q)); }
        } else if (MODE == M_Y) {
            if (r < e_steps) {
                var v = e_acc[i];
                if (HAS_D) { v += skip[e_h] * ld4_x(e_xi(r, e_h, n), count4(n, td.headdim)); }
                store_row(e_yi(r, e_h, n), v, count4(n, td.headdim));
            }
        } else if (MODE == M_STATE) {
            if (r < td.headdim) { store_row(e_sti(e_h, r, n), e_acc[i], count4(n, td.nstate)); }
        } else if (MODE == M_DB || MODE == M_DC) {
            if (r < e_steps) { store_row(e_bci(r, n), e_acc[i], count4(n, td.nstate)); }
        }
    }
}

// M_DXD: dx = sc dxd (+ D dy) (+ the diagonal) on this thread's block; returns its rows' x·dy over its columns.
fn dxd_block() -> vec4<f32> {
    var dd = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        let r = e_m0 + e_ty * 4u + i;
        let n = e_n0 + e_tx * 4u;
        if (r < e_steps) {
            let valid = count4(n, td.headdim);
            let xo = ld4_x(e_xi(r, e_h, n), valid);
            let go = ld4_dy(e_yi(r, e_h, n), valid);
            let row = e_ty * 4u + i;
            var v = e_acc[i] * t_row_sc[row];
            if (HAS_D) { v += skip[e_h] * go; }
            if (HAS_DIAG) { v += (t_col_rlo[row] * t_col_lo[row]) * go; }  // the diagonal: diag_s (C_s·B_s) dy_s
            dd[i] = dot(xo, go);
            store_row(e_dxi(r, e_h, n), v, valid);
        }
    }
    return dd;
}

@compute @workgroup_size(256)
fn ssd_tile(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let warp = tid >> 5u;
    let lane = tid & 31u;
    e_tx = (warp & 1u) * 8u + (lane & 7u);
    e_ty = (warp >> 1u) * 4u + (lane >> 3u);
    let hpg = td.heads / td.ngroups;
    let at = tile_begin(wid, tid == 0u);
    if (!at.live) { return; }
    let total = at.total;

    // Per-row factors and the pair-decay tables of the tile's rows.
    if (MODE == M_Y || MODE == M_DXD) {
        stage_row_tables(tid);
        workgroupBarrier();
    }
    if (MODE == M_STATE) {
        stage_state_weights(tid);
        workgroupBarrier();
    }

    if (MODE == M_DCB) {
        var dcb = mat4x4<f32>(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
        let h_lo = at.split * td.heads_per_split;
        let h_hi = min(h_lo + td.heads_per_split, hpg);
        for (var hl = h_lo; hl < h_hi; hl++) {
            e_h = e_g * hpg + hl;
            stage_dcb_tables(tid);
            zero_acc();
            e_run(tid, 0u, total);  // e_acc = dy_t·x_s over the tile (its barriers publish the tables)
            workgroupBarrier();  // every thread is past its last multiply: F may overwrite the staged tiles
            dcb += dcb_block();
            workgroupBarrier();
            ssd_dcb_crossing(tid, wid.x, at.npairs);
        }
        dcb_store(dcb, at.split);
        return;
    }

    zero_acc();
    if (MODE == M_DXD) {  // the state term, its row dots V_s = sc_s x_s·(state term)_s, then the pairs on top
        e_run(tid, 0u, e_steps1);
        let v = row_sum(row_dots_x(), tid);  // its first barrier: every thread is past its last multiply
        if (tid < 64u && e_m0 + tid < e_steps) { row_part2[at.row_at + e_m0 + tid] = v * t_row_sc[tid]; }
        e_run(tid, e_steps1, total);
    } else if (MODE == M_DC) {
        // Each head's state part on its own: U_t of that head = C_t·(its state part)_t over this tile's n (a direct
        // product: never a difference of running sums over the heads), added into dC; then the pairs on top.
        let pair_steps = total - e_steps1;
        let head_steps = (td.headdim + 15u) / 16u;
        var dc = mat4x4<f32>(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
        for (var hl = 0u; hl < hpg; hl++) {
            dc_head_range(hl, head_steps);
            zero_acc();
            e_run(tid, 0u, head_steps);
            let u = row_sum(row_dots_c(), tid);  // its first barrier: every thread is past its last multiply
            if (tid < 64u && e_m0 + tid < e_steps) { row_part[dc_head_rows(at, hl) + e_m0 + tid] = u; }
            dc += e_acc;
        }
        e_acc = dc;
        e_run(tid, head_steps, head_steps + pair_steps);  // steps from e_steps1 on are phase 2: the pairs
    } else {
        e_run(tid, 0u, total);
    }

    store_block();
    if (MODE == M_DXD) {  // dx = sc dxd (+ D dy); x·dxd into row_part; Σ dy·x for ∂D
        let xd = row_sum(row_dots_x(), tid);
        if (tid < 64u && e_m0 + tid < e_steps) { row_part[at.row_at + e_m0 + tid] = xd; }
        let dsum = row_sum(dxd_block(), tid);  // per row (x·dy over the tile's columns), then the 64 rows in order
        if (tid < 64u && e_m0 + tid < e_steps) { dxd_row_out(at, tid, dsum); }
        if (HAS_D) {
            if (tid < 64u) { t_red[tid] = dsum; }
            workgroupBarrier();
            if (tid == 0u) { dxd_d_total(at); }
        }
    }
}

// M_DC: the K range of the group's head hl (its state phase, head by head) and that head's rows of U.
fn dc_head_range(hl: u32, head_steps: u32) {
    e_kb1 = hl * td.headdim;
    e_ke1 = e_kb1 + td.headdim;
    e_state_end = e_ke1;
    e_steps1 = head_steps;
}

fn dc_head_rows(at: TileAt, hl: u32) -> u32 { return at.row_at + hl * td.nchunks * at.tiles_n * td.chunk; }

// M_DXD with HAS_DIAG: the ∂diag piece of tile row `row` (as row_part; ssd_rows_backward reads it as row_part3).
fn dxd_row_out(at: TileAt, row: u32, dsum: f32) {
    if (HAS_DIAG) { x_part[at.row_at + e_m0 + row] = dsum * t_col_lo[row]; }
}

// M_DXD with HAS_D: Σ dy·x over the tile from its 64 row sums in t_red, in order, for ∂D.
fn dxd_d_total(at: TileAt) {
    var total_d = 0.0;
    for (var r = 0u; r < 64u; r++) { total_d += t_red[r]; }
    tile_part[at.d_slot] = total_d;
}

// ---- ssd_tile_lanes: the tile engine for CPU adapters ------------------------------------------------------
// ssd_tile's 256 threads each multiply a 4 × 4 block out of workgroup memory; on Mesa lavapipe (8-lane
// subgroups, one SIMD row of 8 invocations each) every such read is a per-lane gather, 2 loads for 16 FMAs,
// and the 32 SIMD rows of a workgroup take turns at each barrier: the SSD products ran at 3-6 GFLOP/s there
// against matmul_subgroup's ~35. Here one workgroup is one subgroup of 8 lanes and still one 64 × 64 tile, with
// ssd_tile's loaders, tables and epilogues: lane l plays the 32 threads t = 8j + l (j < 32) of ssd_tile's
// loading, table and crossing phases one after another (a barrier between phases, as there), and owns the tile
// rows 8l .. 8l + 7 across all 64 columns for the multiply (the 32 blocks of the threads at ty = 2l, 2l + 1):
// its A rows are its own, and B's 16 column blocks come from the lanes that hold them by subgroupBroadcast
// (lane j holds blocks 2j, 2j + 1), 4 loads for 512 FMAs a k. Row sums over the tile's columns are a lane's
// own (in the same order as row_sum's), so the per-row pieces need no workgroup memory. Same sums, same order of
// each output's additions as ssd_tile; ops/ssd.py picks it where `cpu_subgroups` holds.
// The accumulators are indexed only by constants (lane_fma, lane_put, lane_dcb: functions called with literal
// block numbers): a private array indexed by a loop variable made the epilogues ~5× slower than the multiply on
// lavapipe. The per-block epilogues read the blocks back from workgroup memory instead (lane_dump, lane_view).
var<private> l_acc: array<mat4x4<f32>, 32>;   // block v: rows 4 (2l + v / 16) .., columns 4 (v % 16) ..
var<private> l_keep: array<mat4x4<f32>, 32>;  // M_DCB: dCB summed over the heads; M_DC: dC over the state phases

fn lane_fma(tx: u32, a0: vec4<f32>, a1: vec4<f32>, b: vec4<f32>) {
    let m = l_acc[tx];
    l_acc[tx] = mat4x4<f32>(fma(vec4<f32>(a0.x), b, m[0]), fma(vec4<f32>(a0.y), b, m[1]),
                            fma(vec4<f32>(a0.z), b, m[2]), fma(vec4<f32>(a0.w), b, m[3]));
    let n = l_acc[16u + tx];
    l_acc[16u + tx] = mat4x4<f32>(fma(vec4<f32>(a1.x), b, n[0]), fma(vec4<f32>(a1.y), b, n[1]),
                                  fma(vec4<f32>(a1.z), b, n[2]), fma(vec4<f32>(a1.w), b, n[3]));
}

// One k of the staged step (buffer 0): the lane's 8 rows of A times B's 64 columns.
fn lane_kstep(k: u32, lane: u32) {
    let a0 = stage[k * SROW + 2u * lane];
    let a1 = stage[k * SROW + 2u * lane + 1u];
    let o0 = stage[B_OFF + k * SROW + 2u * lane];
    let o1 = stage[B_OFF + k * SROW + 2u * lane + 1u];
    lane_fma(0u, a0, a1, subgroupBroadcast(o0, 0u)); lane_fma(1u, a0, a1, subgroupBroadcast(o1, 0u));
    lane_fma(2u, a0, a1, subgroupBroadcast(o0, 1u)); lane_fma(3u, a0, a1, subgroupBroadcast(o1, 1u));
    lane_fma(4u, a0, a1, subgroupBroadcast(o0, 2u)); lane_fma(5u, a0, a1, subgroupBroadcast(o1, 2u));
    lane_fma(6u, a0, a1, subgroupBroadcast(o0, 3u)); lane_fma(7u, a0, a1, subgroupBroadcast(o1, 3u));
    lane_fma(8u, a0, a1, subgroupBroadcast(o0, 4u)); lane_fma(9u, a0, a1, subgroupBroadcast(o1, 4u));
    lane_fma(10u, a0, a1, subgroupBroadcast(o0, 5u)); lane_fma(11u, a0, a1, subgroupBroadcast(o1, 5u));
    lane_fma(12u, a0, a1, subgroupBroadcast(o0, 6u)); lane_fma(13u, a0, a1, subgroupBroadcast(o1, 6u));
    lane_fma(14u, a0, a1, subgroupBroadcast(o0, 7u)); lane_fma(15u, a0, a1, subgroupBroadcast(o1, 7u));
}

// e_run's K steps [first, last) into l_acc, each staged by the lane's 32 loader threads, then multiplied.
fn lane_run(lane: u32, first: u32, last: u32) {
    let mid = clamp(e_steps1, first, last);  // one loop a phase, as e_run
    for (var s = first; s < mid; s++) { lane_step(lane, s, false); }
    for (var s = mid; s < last; s++) { lane_step(lane, s, true); }
    workgroupBarrier();
}

fn lane_step(lane: u32, s: u32, phase2: bool) {
    workgroupBarrier();  // stage's previous readers (the multiply, an epilogue's lane_view) are done
    for (var j = 0u; j < 32u; j++) {
        e_fetch(j * 8u + lane, s, phase2);
        e_commit(j * 8u + lane, 0u, phase2);
    }
    workgroupBarrier();
    for (var k = 0u; k < 16u; k++) { lane_kstep(k, lane); }
}

// Block v into stage as the tile's row-major [64 rows][16 column blocks] vec4s.
fn lane_put(v: u32, lane: u32, m: mat4x4<f32>) {
    let row = 8u * lane + 4u * (v / 16u);
    for (var i = 0u; i < 4u; i++) { stage[(row + i) * 16u + v % 16u] = m[i]; }
}

fn lane_dump(lane: u32) {
    lane_put(0u, lane, l_acc[0]); lane_put(1u, lane, l_acc[1]); lane_put(2u, lane, l_acc[2]); lane_put(3u, lane, l_acc[3]);
    lane_put(4u, lane, l_acc[4]); lane_put(5u, lane, l_acc[5]); lane_put(6u, lane, l_acc[6]); lane_put(7u, lane, l_acc[7]);
    lane_put(8u, lane, l_acc[8]); lane_put(9u, lane, l_acc[9]); lane_put(10u, lane, l_acc[10]); lane_put(11u, lane, l_acc[11]);
    lane_put(12u, lane, l_acc[12]); lane_put(13u, lane, l_acc[13]); lane_put(14u, lane, l_acc[14]); lane_put(15u, lane, l_acc[15]);
    lane_put(16u, lane, l_acc[16]); lane_put(17u, lane, l_acc[17]); lane_put(18u, lane, l_acc[18]); lane_put(19u, lane, l_acc[19]);
    lane_put(20u, lane, l_acc[20]); lane_put(21u, lane, l_acc[21]); lane_put(22u, lane, l_acc[22]); lane_put(23u, lane, l_acc[23]);
    lane_put(24u, lane, l_acc[24]); lane_put(25u, lane, l_acc[25]); lane_put(26u, lane, l_acc[26]); lane_put(27u, lane, l_acc[27]);
    lane_put(28u, lane, l_acc[28]); lane_put(29u, lane, l_acc[29]); lane_put(30u, lane, l_acc[30]); lane_put(31u, lane, l_acc[31]);
}

fn lane_keep_acc() {
    l_keep[0] += l_acc[0]; l_keep[1] += l_acc[1]; l_keep[2] += l_acc[2]; l_keep[3] += l_acc[3];
    l_keep[4] += l_acc[4]; l_keep[5] += l_acc[5]; l_keep[6] += l_acc[6]; l_keep[7] += l_acc[7];
    l_keep[8] += l_acc[8]; l_keep[9] += l_acc[9]; l_keep[10] += l_acc[10]; l_keep[11] += l_acc[11];
    l_keep[12] += l_acc[12]; l_keep[13] += l_acc[13]; l_keep[14] += l_acc[14]; l_keep[15] += l_acc[15];
    l_keep[16] += l_acc[16]; l_keep[17] += l_acc[17]; l_keep[18] += l_acc[18]; l_keep[19] += l_acc[19];
    l_keep[20] += l_acc[20]; l_keep[21] += l_acc[21]; l_keep[22] += l_acc[22]; l_keep[23] += l_acc[23];
    l_keep[24] += l_acc[24]; l_keep[25] += l_acc[25]; l_keep[26] += l_acc[26]; l_keep[27] += l_acc[27];
    l_keep[28] += l_acc[28]; l_keep[29] += l_acc[29]; l_keep[30] += l_acc[30]; l_keep[31] += l_acc[31];
}

// M_DCB: head e_h's dCB term and F for block v, from l_acc (F overwrites stage: the multiply must be done).
fn lane_dcb(v: u32, lane: u32) {
    e_ty = 2u * lane + v / 16u;
    e_tx = v % 16u;
    e_acc = l_acc[v];
    l_keep[v] += dcb_block();
}

fn lane_dcb_all(lane: u32) {
    lane_dcb(0u, lane); lane_dcb(1u, lane); lane_dcb(2u, lane); lane_dcb(3u, lane); lane_dcb(4u, lane); lane_dcb(5u, lane);
    lane_dcb(6u, lane); lane_dcb(7u, lane); lane_dcb(8u, lane); lane_dcb(9u, lane); lane_dcb(10u, lane); lane_dcb(11u, lane);
    lane_dcb(12u, lane); lane_dcb(13u, lane); lane_dcb(14u, lane); lane_dcb(15u, lane); lane_dcb(16u, lane); lane_dcb(17u, lane);
    lane_dcb(18u, lane); lane_dcb(19u, lane); lane_dcb(20u, lane); lane_dcb(21u, lane); lane_dcb(22u, lane); lane_dcb(23u, lane);
    lane_dcb(24u, lane); lane_dcb(25u, lane); lane_dcb(26u, lane); lane_dcb(27u, lane); lane_dcb(28u, lane); lane_dcb(29u, lane);
    lane_dcb(30u, lane); lane_dcb(31u, lane);
}

// Block v of the lane (as lane_dump left it in stage) as ssd_tile's thread state (e_ty, e_tx, e_acc).
fn lane_view(v: u32, lane: u32) {
    e_ty = 2u * lane + v / 16u;
    e_tx = v % 16u;
    let row = 4u * e_ty;
    e_acc = mat4x4<f32>(stage[row * 16u + e_tx], stage[(row + 1u) * 16u + e_tx], stage[(row + 2u) * 16u + e_tx],
                        stage[(row + 3u) * 16u + e_tx]);
}

// The sums over the tile's 64 columns of the row dots with x (or C: `with_c`) of rows 4 (2l + rh) .. + 3.
fn lane_rows(lane: u32, rh: u32, with_c: bool) -> vec4<f32> {
    var part = vec4<f32>(0.0);
    for (var tx = 0u; tx < 16u; tx++) {
        lane_view(rh * 16u + tx, lane);
        if (with_c) { part += row_dots_c(); } else { part += row_dots_x(); }
    }
    return part;
}

@compute @workgroup_size(8)
fn ssd_tile_lanes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(subgroup_invocation_id) lane: u32) {
    let hpg = td.heads / td.ngroups;
    let at = tile_begin(wid, lane == 0u);
    if (!at.live) { return; }
    let total = at.total;
    let zero = array<mat4x4<f32>, 32>();
    if (MODE == M_Y || MODE == M_DXD) {
        for (var j = 0u; j < 32u; j++) { stage_row_tables(j * 8u + lane); }
    }
    if (MODE == M_STATE) {
        for (var j = 0u; j < 32u; j++) { stage_state_weights(j * 8u + lane); }
    }

    if (MODE == M_DCB) {
        l_keep = zero;
        let h_lo = at.split * td.heads_per_split;
        let h_hi = min(h_lo + td.heads_per_split, hpg);
        for (var hl = h_lo; hl < h_hi; hl++) {
            e_h = e_g * hpg + hl;
            for (var j = 0u; j < 32u; j++) { stage_dcb_tables(j * 8u + lane); }
            l_acc = zero;
            lane_run(lane, 0u, total);  // its barriers publish the tables; it ends with one: F may overwrite stage
            lane_dcb_all(lane);
            workgroupBarrier();
            for (var j = 0u; j < 32u; j++) { crossing_rows(j * 8u + lane); }
            workgroupBarrier();
            for (var j = 0u; j < 32u; j++) { crossing_rows_add(j * 8u + lane); }
            workgroupBarrier();
            for (var j = 0u; j < 32u; j++) { crossing_cols(j * 8u + lane); }
            workgroupBarrier();
            for (var j = 0u; j < 8u; j++) { crossing_totals(j * 8u + lane); }
            workgroupBarrier();
            for (var j = 0u; j < 32u; j++) { crossing_store(j * 8u + lane, wid.x, at.npairs); }
            workgroupBarrier();
        }
        l_acc = l_keep;
        lane_dump(lane);
        for (var v = 0u; v < 32u; v++) {
            lane_view(v, lane);
            dcb_store(e_acc, at.split);
        }
        return;
    }

    l_acc = zero;
    if (MODE == M_DXD) {
        lane_run(lane, 0u, e_steps1);
        lane_dump(lane);
        for (var rh = 0u; rh < 2u; rh++) {
            let v = lane_rows(lane, rh, false);
            for (var i = 0u; i < 4u; i++) {
                let row = 8u * lane + 4u * rh + i;
                if (e_m0 + row < e_steps) { row_part2[at.row_at + e_m0 + row] = v[i] * t_row_sc[row]; }
            }
        }
        lane_run(lane, e_steps1, total);
    } else if (MODE == M_DC) {
        let pair_steps = total - e_steps1;
        let head_steps = (td.headdim + 15u) / 16u;
        l_keep = zero;
        for (var hl = 0u; hl < hpg; hl++) {
            dc_head_range(hl, head_steps);
            l_acc = zero;
            lane_run(lane, 0u, head_steps);
            lane_dump(lane);
            for (var rh = 0u; rh < 2u; rh++) {
                let u = lane_rows(lane, rh, true);
                for (var i = 0u; i < 4u; i++) {
                    let row = 8u * lane + 4u * rh + i;
                    if (e_m0 + row < e_steps) { row_part[dc_head_rows(at, hl) + e_m0 + row] = u[i]; }
                }
            }
            lane_keep_acc();
        }
        l_acc = l_keep;
        lane_run(lane, head_steps, head_steps + pair_steps);
    } else {
        lane_run(lane, 0u, total);
    }

    lane_dump(lane);
    for (var v = 0u; v < 32u; v++) {
        lane_view(v, lane);
        store_block();
    }
    if (MODE == M_DXD) {
        for (var rh = 0u; rh < 2u; rh++) {
            let xd = lane_rows(lane, rh, false);
            var dd = vec4<f32>(0.0);
            for (var tx = 0u; tx < 16u; tx++) {
                lane_view(rh * 16u + tx, lane);
                dd += dxd_block();
            }
            for (var i = 0u; i < 4u; i++) {
                let row = 8u * lane + 4u * rh + i;
                if (e_m0 + row < e_steps) {
                    row_part[at.row_at + e_m0 + row] = xd[i];
                    dxd_row_out(at, row, dd[i]);
                }
                t_red[row] = dd[i];
            }
        }
        if (HAS_D) {
            workgroupBarrier();
            if (lane == 0u) { dxd_d_total(at); }
        }
    }
}
