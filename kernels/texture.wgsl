// Reading a tensor through a texture: the runtime copies a tensor bound to a `texture_2d<f32>` global into an
// rgba32float texture of 4096 texels a row (runtime/gpu.py TEXTURE_ROW), so float e is component e % 4 of texel
// e / 4. Why: on Mesa lavapipe a storage-buffer load compiles into a loop over the SIMD lanes with a bounds check
// and a vector insert through memory per lane and component; a texel fetch into a gather unrolled over the lanes
// (docs/architecture.md). Modules that read tensors this way include this file (`//! include texture`).

const TEXTURE_ROW_SHIFT = 12u;  // log2 of TEXTURE_ROW

// Floats 4i .. 4i + 3.
fn texel(t: texture_2d<f32>, i: u32) -> vec4<f32> {
    return textureLoad(t, vec2<u32>(i & ((1u << TEXTURE_ROW_SHIFT) - 1u), i >> TEXTURE_ROW_SHIFT), 0);
}

// Float e.
fn texture_elem(t: texture_2d<f32>, e: u32) -> f32 {
    let v = texel(t, e >> 2u);
    return v[e & 3u];
}

// x as lavapipe's uniform inliner cannot follow it: shifted by t's mip count − 1 = 0. Lavapipe recompiles a
// pipeline at every dispatch when inlining the uniforms behind its loop bounds grew the shader (unrolled loops;
// docs/architecture.md); a texture query is not an ALU op, so a bound that passes through one is not inlined.
// (The subgroup kernels use opaque(), a subgroup broadcast; this one needs no subgroups.)
fn hidden(t: texture_2d<f32>, x: u32) -> u32 { return x >> (textureNumLevels(t) - 1u); }
