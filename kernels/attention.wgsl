// Multi-head softmax attention, flash-attention style, and rotary embedding. q, k, v, o and their gradients
// are [B, L, H, DH] (DH ≤ 128, a pipeline constant); each head attends over the keys of its own head:
//   S = scale · Q Kᵀ (masked: keys past L, and keys after the query when CAUSAL),  P = softmax_rows(S),  O = P V.
// Scores exist only as one [BQ × BK] tile per workgroup at a time.
//
// Forward (attention_forward): a workgroup owns BQ query rows of one (batch, head) and walks the key tiles with
// an online softmax (running row max m and sum l; the O accumulator is rescaled by exp(m_old − m_new) when the
// max grows), then writes O / l and the row's logsumexp m + log l ([B, H, L]), all the backward keeps.
// Backward, with δ_r = dO_r·O_r (attention_backward_delta) and P recomputed from the logsumexp:
//   dP = dO Vᵀ,  dS = P ∘ (dP − δ),  dQ = scale · dS K,  dK = scale · dSᵀ Q,  dV = Pᵀ dO.
// dQ comes from a query-tile kernel (attention_backward_dq, shaped like the forward), dK and dV from a key-tile
// kernel (attention_backward_dkv) that walks the query tiles: every sum runs inside one workgroup in a fixed
// order, so the backward is deterministic without atomics or partial buffers (at the price of computing
// S and dP in both kernels).
//
// Workgroups are 16 × 16 threads; thread (tx, ty) holds
//   scores     rows ty·4 .. ty·4+3 of the query tile × keys tx·2, tx·2+1 of the key tile  (Block: two vec4s)
//   row acc.   query rows ty·4 .. ty·4+3 × dims tx·4 .. tx·4+3 and 64+tx·4 .. 64+tx·4+3  (Acc: eight vec4s)
//   key acc.   keys ty·2, ty·2+1 × the same dims                                       (KeyAcc: four vec4s)
// so DH up to 128 needs no more threads; the upper half is skipped when DH ≤ 64. Products reduce through
// workgroup memory in slices (KT dims of Q and K; VT positions of V, K, dO or Q): 6.5 KiB of slices plus an
// 8 KiB tile of P or dS, under 16 KiB per workgroup. Accumulators are named vec4s in structs, never
// dynamically indexed arrays (those spill to memory).

const BQ: u32 = 64u;  // query rows per tile
const BK: u32 = 32u;  // keys per tile
const KT: u32 = 16u;  // dims per slice of a score product
const VT: u32 = 8u;   // positions per slice of a value product
// Score slices are [KT][pitch], pitch = tile + 4: staging stores the KT dims of a position from consecutive
// threads (for coalesced loads), and the padding spreads those stores over the banks.
const ROW_PITCH: u32 = BQ + 4u;
const KEY_PITCH: u32 = BK + 4u;
const KEYS_AT: u32 = KT * ROW_PITCH;  // where the key slice starts
const NEG: f32 = -1.0e30;  // masked score: exp(NEG − m) = 0, and NEG − NEG is 0, never NaN as −inf − −inf
// Operands of the staging helpers.
const OP_Q: u32 = 0u;
const OP_K: u32 = 1u;
const OP_V: u32 = 2u;
const OP_DO: u32 = 3u;

override DH: u32 = 64u;
override CAUSAL: bool = true;
override INVERSE: bool = false;  // rope: turn by the opposite angle (the backward)
override ROPE: bool = false;     // attention_step: rotary embedding on this token's q and k

struct Params { batch: u32, len: u32, heads: u32, scale: f32 }
struct RopeParams { pairs: u32, len: u32, heads: u32, log2_base: f32 }
// attention_step: `len` positions are cached before this token (which takes position len), of `capacity`.
struct StepParams { heads: u32, len: u32, capacity: u32, scale: f32, log2_base: f32 }

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> dout: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;      // O (forward) or dQ (attention_backward_dq)
@group(0) @binding(6) var<storage, read_write> lse_out: array<f32>;  // [B, H, L]
@group(0) @binding(7) var<storage, read> o: array<f32>;
@group(0) @binding(8) var<storage, read> lse: array<f32>;
@group(0) @binding(9) var<storage, read_write> delta_out: array<f32>;  // [B, H, L]
@group(0) @binding(10) var<storage, read> delta: array<f32>;
@group(0) @binding(11) var<storage, read_write> dk: array<f32>;
@group(0) @binding(12) var<storage, read_write> dv: array<f32>;
@group(0) @binding(13) var<uniform> rp: RopeParams;
@group(0) @binding(14) var<storage, read> x: array<f32>;
@group(0) @binding(15) var<storage, read_write> y: array<f32>;
@group(0) @binding(16) var<uniform> sp: StepParams;
@group(0) @binding(17) var<storage, read> qkv: array<f32>;              // [B, 3·H·DH]: q | k | v
@group(0) @binding(18) var<storage, read_write> k_cache: array<f32>;   // [B, capacity, H, DH]
@group(0) @binding(19) var<storage, read_write> v_cache: array<f32>;

// Score slices: [KT][ROW_PITCH] rows then [KT][KEY_PITCH] keys, vec4s along the rows / keys. Value slices:
// [VT][128] dims.
var<workgroup> stage: array<vec4<f32>, (KEYS_AT + KT * KEY_PITCH) / 4u>;
var<workgroup> p_tile: array<vec4<f32>, BK * BQ / 4u>;  // [key][row]: P or dS, 4 rows per vec4
var<workgroup> p_keys: array<vec2<f32>, BQ * BK / 2u>;  // [row][key]: P or dS, 2 keys per vec2
var<workgroup> red: array<f32, 256>;                     // per-thread partial row maxima and sums
var<workgroup> row_scale: array<f32, BQ>;
var<workgroup> step_q: array<f32, 128>;   // attention_step: this head's (rotated) query
var<workgroup> step_w: array<f32, 256>;   // attention_step: weights of a chunk, then partial outputs

struct Block { k0: vec4<f32>, k1: vec4<f32> }  // key tx·2 (k0) and tx·2 + 1 (k1), each over rows ty·4 .. +3
struct Acc { lo0: vec4<f32>, lo1: vec4<f32>, lo2: vec4<f32>, lo3: vec4<f32>,
             hi0: vec4<f32>, hi1: vec4<f32>, hi2: vec4<f32>, hi3: vec4<f32> }  // row ty·4 + i: lo_i, hi_i
struct KeyAcc { lo0: vec4<f32>, hi0: vec4<f32>, lo1: vec4<f32>, hi1: vec4<f32> }  // key ty·2 + j: lo_j, hi_j

fn wide() -> bool { return DH > 64u; }

fn at(b: u32, pos: u32, h: u32, j: u32) -> u32 { return ((b * p.len + pos) * p.heads + h) * DH + j; }

fn row_stat(b: u32, h: u32, pos: u32) -> u32 { return (b * p.heads + h) * p.len + pos; }

// Element j of position `pos` of an operand; 0 past the sequence or the head.
fn operand(op: u32, b: u32, pos: u32, h: u32, j: u32) -> f32 {
    if (pos >= p.len || j >= DH) { return 0.0; }
    let i = at(b, pos, h, j);
    switch op {
        case OP_Q: { return q[i]; }
        case OP_K: { return k[i]; }
        case OP_V: { return v[i]; }
        default: { return dout[i]; }
    }
}

// Raw dot products row_op[row0 + r]·col_op[col0 + c] of this thread's block (Q·K or dO·V). Ends on a barrier,
// so the caller may restage at once.
fn scores(row_op: u32, col_op: u32, b: u32, h: u32, row0: u32, col0: u32, lid: vec3<u32>) -> Block {
    let t = lid.y * 16u + lid.x;
    var s = Block(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var d0 = 0u; d0 < DH; d0 += KT) {
        // Consecutive threads read consecutive dims of one position (coalesced).
        for (var r = 0u; r < KT * BQ / 256u; r++) {
            let i = t + r * 256u;
            let row = i / KT;
            let kk = i % KT;
            stage[(kk * ROW_PITCH + row) / 4u][row % 4u] = operand(row_op, b, row0 + row, h, d0 + kk);
        }
        for (var r = 0u; r < KT * BK / 256u; r++) {
            let i = t + r * 256u;
            let col = i / KT;
            let kk = i % KT;
            stage[(KEYS_AT + kk * KEY_PITCH + col) / 4u][col % 4u] = operand(col_op, b, col0 + col, h, d0 + kk);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KT; kk++) {
            let a = stage[(kk * ROW_PITCH) / 4u + lid.y];
            let four = stage[(KEYS_AT + kk * KEY_PITCH) / 4u + lid.x / 2u];
            let c = select(four.xy, four.zw, (lid.x & 1u) == 1u);
            s.k0 += a * c.x;
            s.k1 += a * c.y;
        }
        workgroupBarrier();
    }
    return s;
}

// Which of this thread's 4 rows may see its key tx·2 + j: both inside the sequence, the key not after the row.
fn visible(row0: u32, col0: u32, lid: vec3<u32>, j: u32) -> vec4<bool> {
    let rows = vec4<u32>(row0 + lid.y * 4u) + vec4<u32>(0u, 1u, 2u, 3u);
    let key = col0 + lid.x * 2u + j;
    var ok = (rows < vec4<u32>(p.len)) & vec4<bool>(key < p.len);
    if (CAUSAL) { ok = ok & (vec4<u32>(key) <= rows); }
    return ok;
}

// Softmax weights from the saved logsumexp (0 where masked) and scale · dS = scale · P ∘ (dP − δ), for the
// backward (the scale of dQ and dK applied once, here).
struct Grads { p0: vec4<f32>, p1: vec4<f32>, ds0: vec4<f32>, ds1: vec4<f32> }

fn recompute(b: u32, h: u32, row0: u32, col0: u32, lid: vec3<u32>) -> Grads {
    var row_lse = vec4<f32>(0.0);
    var row_delta = vec4<f32>(0.0);
    for (var i = 0u; i < 4u; i++) {
        let r = row0 + lid.y * 4u + i;
        if (r < p.len) {
            row_lse[i] = lse[row_stat(b, h, r)];
            row_delta[i] = delta[row_stat(b, h, r)];
        }
    }
    let s = scores(OP_Q, OP_K, b, h, row0, col0, lid);
    let dp = scores(OP_DO, OP_V, b, h, row0, col0, lid);
    let p0 = select(vec4<f32>(0.0), exp(p.scale * s.k0 - row_lse), visible(row0, col0, lid, 0u));
    let p1 = select(vec4<f32>(0.0), exp(p.scale * s.k1 - row_lse), visible(row0, col0, lid, 1u));
    return Grads(p0, p1, p.scale * p0 * (dp.k0 - row_delta), p.scale * p1 * (dp.k1 - row_delta));
}

// This thread's block of P or dS (as `Block`) into p_tile ([key][row]) or p_keys ([row][key]).
fn put_tile(k0: vec4<f32>, k1: vec4<f32>, lid: vec3<u32>) {
    p_tile[(lid.x * 2u) * (BQ / 4u) + lid.y] = k0;
    p_tile[(lid.x * 2u + 1u) * (BQ / 4u) + lid.y] = k1;
}

fn put_keys(k0: vec4<f32>, k1: vec4<f32>, lid: vec3<u32>) {
    for (var i = 0u; i < 4u; i++) { p_keys[(lid.y * 4u + i) * (BK / 2u) + lid.x] = vec2<f32>(k0[i], k1[i]); }
}

// Stage positions pos0 .. pos0 + VT − 1 of an operand, all DH dims, as [VT][128].
fn stage_positions(op: u32, b: u32, h: u32, pos0: u32, t: u32) {
    for (var r = 0u; r < VT * 128u / 256u; r++) {
        let i = t + r * 256u;
        let kk = i / 128u;
        let j = i % 128u;
        stage[(kk * 128u + j) / 4u][j % 4u] = operand(op, b, pos0 + kk, h, j);
    }
}

// acc (rows of the query tile) += p_tile · op[key0 .. key0 + BK): O += P V, or dQ += dS K.
fn accumulate_rows(acc: ptr<function, Acc>, op: u32, b: u32, h: u32, key0: u32, lid: vec3<u32>) {
    let t = lid.y * 16u + lid.x;
    for (var ks = 0u; ks < BK; ks += VT) {
        stage_positions(op, b, h, key0 + ks, t);
        workgroupBarrier();
        for (var kk = 0u; kk < VT; kk++) {
            let w = p_tile[(ks + kk) * (BQ / 4u) + lid.y];
            let lo = stage[kk * 32u + lid.x];
            (*acc).lo0 += w.x * lo;
            (*acc).lo1 += w.y * lo;
            (*acc).lo2 += w.z * lo;
            (*acc).lo3 += w.w * lo;
            if (wide()) {
                let hi = stage[kk * 32u + 16u + lid.x];
                (*acc).hi0 += w.x * hi;
                (*acc).hi1 += w.y * hi;
                (*acc).hi2 += w.z * hi;
                (*acc).hi3 += w.w * hi;
            }
        }
        workgroupBarrier();
    }
}

// acc (keys of the key tile) += p_keysᵀ · op[row0 .. row0 + BQ): dV += Pᵀ dO, or dK += dSᵀ Q.
fn accumulate_keys(acc: ptr<function, KeyAcc>, op: u32, b: u32, h: u32, row0: u32, lid: vec3<u32>) {
    let t = lid.y * 16u + lid.x;
    for (var rs = 0u; rs < BQ; rs += VT) {
        stage_positions(op, b, h, row0 + rs, t);
        workgroupBarrier();
        for (var rr = 0u; rr < VT; rr++) {
            let w = p_keys[(rs + rr) * (BK / 2u) + lid.y];
            let lo = stage[rr * 32u + lid.x];
            (*acc).lo0 += w.x * lo;
            (*acc).lo1 += w.y * lo;
            if (wide()) {
                let hi = stage[rr * 32u + 16u + lid.x];
                (*acc).hi0 += w.x * hi;
                (*acc).hi1 += w.y * hi;
            }
        }
        workgroupBarrier();
    }
}

fn scale_rows(acc: ptr<function, Acc>, f: vec4<f32>) {
    (*acc).lo0 *= f.x; (*acc).lo1 *= f.y; (*acc).lo2 *= f.z; (*acc).lo3 *= f.w;
    (*acc).hi0 *= f.x; (*acc).hi1 *= f.y; (*acc).hi2 *= f.z; (*acc).hi3 *= f.w;
}

fn my_row_scales(lid: vec3<u32>) -> vec4<f32> {
    let r = lid.y * 4u;
    return vec4<f32>(row_scale[r], row_scale[r + 1u], row_scale[r + 2u], row_scale[r + 3u]);
}

// Four dims of one position into `out` (the query-tile kernels' result), skipping dims past DH.
fn store_out(base: u32, j0: u32, val: vec4<f32>) {
    for (var c = 0u; c < 4u; c++) {
        if (j0 + c < DH) { out[base + j0 + c] = val[c]; }
    }
}

fn store_rows(acc: Acc, b: u32, h: u32, row0: u32, lid: vec3<u32>) {
    let r = row0 + lid.y * 4u;
    let lo = lid.x * 4u;
    let hi = 64u + lid.x * 4u;
    if (r < p.len) { store_out(at(b, r, h, 0u), lo, acc.lo0); store_out(at(b, r, h, 0u), hi, acc.hi0); }
    if (r + 1u < p.len) { store_out(at(b, r + 1u, h, 0u), lo, acc.lo1); store_out(at(b, r + 1u, h, 0u), hi, acc.hi1); }
    if (r + 2u < p.len) { store_out(at(b, r + 2u, h, 0u), lo, acc.lo2); store_out(at(b, r + 2u, h, 0u), hi, acc.hi2); }
    if (r + 3u < p.len) { store_out(at(b, r + 3u, h, 0u), lo, acc.lo3); store_out(at(b, r + 3u, h, 0u), hi, acc.hi3); }
}

// The key tiles a query tile sees: all, or up to its last row.
fn key_end(row0: u32) -> u32 {
    if (CAUSAL) { return min(p.len, row0 + BQ); }
    return p.len;
}

// Grid (ceil(L / BQ), H, B).
@compute @workgroup_size(16, 16)
fn attention_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.z;
    let h = wid.y;
    let row0 = wid.x * BQ;
    let t = lid.y * 16u + lid.x;
    // For the softmax, thread t takes row t / 4 of the tile and keys (t % 4)·8 .. +7 of each key tile. The
    // four threads of a row compute the same running max; each keeps the sum over its own keys.
    let sr = t / 4u;
    let k_first = (t % 4u) * 8u;
    var m_run = NEG;
    var l_part = 0.0;
    var acc: Acc;  // zero-initialised
    for (var col0 = 0u; col0 < key_end(row0); col0 += BK) {
        let s = scores(OP_Q, OP_K, b, h, row0, col0, lid);
        put_tile(select(vec4<f32>(NEG), p.scale * s.k0, visible(row0, col0, lid, 0u)),
                 select(vec4<f32>(NEG), p.scale * s.k1, visible(row0, col0, lid, 1u)), lid);
        workgroupBarrier();
        var mx = NEG;
        for (var c = k_first; c < k_first + 8u; c++) { mx = max(mx, p_tile[c * (BQ / 4u) + sr / 4u][sr % 4u]); }
        red[t] = mx;
        workgroupBarrier();
        let m_new = max(max(m_run, max(red[sr * 4u], red[sr * 4u + 1u])), max(red[sr * 4u + 2u], red[sr * 4u + 3u]));
        let alpha = exp(m_run - m_new);
        var sum = 0.0;
        for (var c = k_first; c < k_first + 8u; c++) {
            let e = exp(p_tile[c * (BQ / 4u) + sr / 4u][sr % 4u] - m_new);
            p_tile[c * (BQ / 4u) + sr / 4u][sr % 4u] = e;
            sum += e;
        }
        l_part = l_part * alpha + sum;
        m_run = m_new;
        if (t % 4u == 0u) { row_scale[sr] = alpha; }
        workgroupBarrier();
        scale_rows(&acc, my_row_scales(lid));
        accumulate_rows(&acc, OP_V, b, h, col0, lid);
    }
    red[t] = l_part;
    workgroupBarrier();
    if (t % 4u == 0u) {
        let l = (red[t] + red[t + 1u]) + (red[t + 2u] + red[t + 3u]);
        row_scale[sr] = 1.0 / l;
        if (row0 + sr < p.len) { lse_out[row_stat(b, h, row0 + sr)] = m_run + log(l); }
    }
    workgroupBarrier();
    scale_rows(&acc, my_row_scales(lid));
    store_rows(acc, b, h, row0, lid);
}

// δ = rowsum(dO ∘ O) per (batch, head, position), one thread each. 1-D grid over B·L·H.
@compute @workgroup_size(256)
fn attention_backward_delta(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;  // = (b·L + pos)·H + h
    if (i >= p.batch * p.len * p.heads) { return; }
    var acc = 0.0;
    for (var j = 0u; j < DH; j++) { acc += dout[i * DH + j] * o[i * DH + j]; }
    let h = i % p.heads;
    let bl = i / p.heads;
    delta_out[row_stat(bl / p.len, h, bl % p.len)] = acc;
}

// dQ of BQ query rows. Grid (ceil(L / BQ), H, B).
@compute @workgroup_size(16, 16)
fn attention_backward_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.z;
    let h = wid.y;
    let row0 = wid.x * BQ;
    var acc: Acc;  // zero-initialised
    for (var col0 = 0u; col0 < key_end(row0); col0 += BK) {
        let g = recompute(b, h, row0, col0, lid);
        put_tile(g.ds0, g.ds1, lid);
        workgroupBarrier();
        accumulate_rows(&acc, OP_K, b, h, col0, lid);
    }
    store_rows(acc, b, h, row0, lid);
}

fn store_keys(to_dk: bool, acc: KeyAcc, b: u32, h: u32, col0: u32, lid: vec3<u32>) {
    for (var j = 0u; j < 2u; j++) {
        let key = col0 + lid.y * 2u + j;
        if (key >= p.len) { return; }
        var lo = acc.lo0;
        var hi = acc.hi0;
        if (j == 1u) { lo = acc.lo1; hi = acc.hi1; }
        for (var c = 0u; c < 4u; c++) {
            let jl = lid.x * 4u + c;
            let jh = 64u + jl;
            if (jl < DH) {
                if (to_dk) { dk[at(b, key, h, jl)] = lo[c]; } else { dv[at(b, key, h, jl)] = lo[c]; }
            }
            if (jh < DH) {
                if (to_dk) { dk[at(b, key, h, jh)] = hi[c]; } else { dv[at(b, key, h, jh)] = hi[c]; }
            }
        }
    }
}

// dK and dV of BK keys: walks the query tiles that can see them. Grid (ceil(L / BK), H, B).
@compute @workgroup_size(16, 16)
fn attention_backward_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.z;
    let h = wid.y;
    let col0 = wid.x * BK;
    var acc_k: KeyAcc;  // zero-initialised
    var acc_v: KeyAcc;
    var row_first = 0u;
    if (CAUSAL) { row_first = (col0 / BQ) * BQ; }  // earlier rows are all before these keys
    for (var row0 = row_first; row0 < p.len; row0 += BQ) {
        let g = recompute(b, h, row0, col0, lid);
        put_keys(g.p0, g.p1, lid);
        workgroupBarrier();
        accumulate_keys(&acc_v, OP_DO, b, h, row0, lid);
        put_keys(g.ds0, g.ds1, lid);
        workgroupBarrier();
        accumulate_keys(&acc_k, OP_Q, b, h, row0, lid);
    }
    store_keys(true, acc_k, b, h, col0, lid);
    store_keys(false, acc_v, b, h, col0, lid);
}

// cos and sin of the rotary angle t · base^(−2j/DH) of pair j at position t.
fn rope_cos_sin(t: u32, j: u32, log2_base: f32) -> vec2<f32> {
    let angle = f32(t) * exp2(-f32(2u * j) / f32(DH) * log2_base);
    // Reduce to [−π, π] with 2π split in two (the first part times any turn count below 2^16 is exact):
    // GPU sin and cos are accurate only near 0, and positions reach thousands of radians.
    let turns = round(angle / 6.283185307179586);
    let reduced = (angle - turns * 6.28125) - turns * 0.0019353071795864769;
    return vec2<f32>(cos(reduced), sin(reduced));
}

// Rotary embedding of x [B, L, H, DH] (DH even): the pair (j, j + DH/2) of position t turns by
// t · base^(−2j/DH), GPT-NeoX / HF Llama's rotate_half layout. One thread per pair; 1-D grid over the pairs.
@compute @workgroup_size(256)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= rp.pairs) { return; }
    let half_dh = DH / 2u;
    let j = i % half_dh;
    let head_row = i / half_dh;  // (b·L + t)·H + h
    let t = (head_row / rp.heads) % rp.len;
    let cs = rope_cos_sin(t, j, rp.log2_base);
    let c = cs.x;
    var s = cs.y;
    if (INVERSE) { s = -s; }
    let base = head_row * DH;
    let x1 = x[base + j];
    let x2 = x[base + j + half_dh];
    y[base + j] = x1 * c - x2 * s;
    y[base + j + half_dh] = x2 * c + x1 * s;
}

// One decoding step of every (batch, head): this token's q, k, v are columns of its fused projection row
// (q | k | v, heads contiguous); with ROPE, q and k turn by position len. k and v are appended to the cache at
// position len, then the query attends over the len + 1 cached positions (no mask: all are before it):
//   o = Σ_s softmax_s(scale · q·k_s) v_s   -> out [B, H·DH].
// A workgroup owns one (batch, head) and walks the positions in chunks of 256, one score per thread, with an
// online softmax (running max m; the output and the per-thread sums are rescaled by exp(m_old − m_new) when
// it grows). For the weighted sum of V, thread t takes dim t % DH of every (256 / DH)-th position of the chunk
// (consecutive threads read consecutive dims); the partial sums are added in a fixed order at the end.
// Grid (H, B).
@compute @workgroup_size(256)
fn attention_step(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let b = wid.y;
    let h = wid.x;
    let t = lid.x;
    let dm = sp.heads * DH;
    let row = b * 3u * dm + h * DH;  // this head's q; its k at + dm, its v at + 2·dm
    let n = sp.len + 1u;            // positions attended over, this token's included
    if (t < DH) {
        var qt = qkv[row + t];
        var kt = qkv[row + dm + t];
        if (ROPE) {
            let half_dh = DH / 2u;
            let cs = rope_cos_sin(sp.len, t % half_dh, sp.log2_base);
            if (t < half_dh) {
                qt = qt * cs.x - qkv[row + t + half_dh] * cs.y;
                kt = kt * cs.x - qkv[row + dm + t + half_dh] * cs.y;
            } else {
                qt = qt * cs.x + qkv[row + t - half_dh] * cs.y;
                kt = kt * cs.x + qkv[row + dm + t - half_dh] * cs.y;
            }
        }
        step_q[t] = qt;
        let slot = ((b * sp.capacity + sp.len) * sp.heads + h) * DH + t;
        k_cache[slot] = kt;
        v_cache[slot] = qkv[row + 2u * dm + t];
    }
    workgroupBarrier();
    storageBarrier();  // the new k and v are read back below by other threads of this workgroup
    let j = t % DH;
    let group = t / DH;
    let groups = 256u / DH;
    var m_run = NEG;
    var l_part = 0.0;
    var acc = 0.0;
    for (var c0 = 0u; c0 < n; c0 += 256u) {
        let pos = c0 + t;
        var score = NEG;
        if (pos < n) {
            let base = ((b * sp.capacity + pos) * sp.heads + h) * DH;
            var sum = 0.0;
            for (var d = 0u; d < DH; d++) { sum += step_q[d] * k_cache[base + d]; }
            score = sp.scale * sum;
        }
        red[t] = score;
        workgroupBarrier();
        for (var w = 128u; w > 0u; w >>= 1u) {
            if (t < w) { red[t] = max(red[t], red[t + w]); }
            workgroupBarrier();
        }
        let m_new = max(m_run, red[0]);
        let alpha = exp(m_run - m_new);
        let e = select(0.0, exp(score - m_new), pos < n);
        step_w[t] = e;
        l_part = l_part * alpha + e;
        acc *= alpha;
        m_run = m_new;
        workgroupBarrier();
        if (group < groups) {
            let end = min(256u, n - c0);
            for (var r = group; r < end; r += groups) {
                acc += step_w[r] * v_cache[((b * sp.capacity + c0 + r) * sp.heads + h) * DH + j];
            }
        }
        workgroupBarrier();
    }
    red[t] = l_part;
    step_w[t] = acc;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if (t < w) { red[t] += red[t + w]; }
        workgroupBarrier();
    }
    if (t < DH) {
        var total = 0.0;
        for (var g = 0u; g < groups; g++) { total += step_w[g * DH + t]; }
        out[(b * sp.heads + h) * DH + t] = total / red[0];
    }
}
