"""mamba_ssm directories with Mamba-3 (SISO, MIMO) and MHA layers: import (logits against an independent PyTorch
forward of mamba_ssm's equations, on the float64 reference and on the GPU), export as a mamba_ssm directory
(`torch.load(weights_only=True)`, round trips), and every unsupported setting refused in one line by the CLI.

The source directories are written here with the real `torch.save` (torch is a test-only oracle). The PyTorch
forward follows mamba_ssm: MixerModel's pre-norm blocks with RMSNorm (eps 1e-5) and the tied head; Mamba-3 is the
port of the official step references in test_parity_mamba3_torch.py; Mamba-2 is `Mamba2`'s recurrence (in_proj
split z | xBC | dt, causal depthwise conv, SiLU, h = exp(Δ A) h + Δ x Bᵀ, y = h C + D x, grouped gated RMSNorm);
MHA is mha.py's forward (in_proj -> q | (two hkv d), flash_attn's non-interleaved rotary, SDPA, out_proj).
"""

import json
import shutil
from collections import OrderedDict

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from lm_checks import rel  # noqa: E402
from mambactl.errors import MambactlError  # noqa: E402
from mambactl.interop import export_mamba_ssm, import_checkpoint  # noqa: E402
from mambactl.models.config import Mamba3Config, ModelConfig  # noqa: E402
from mambactl.models.lm import LanguageModel  # noqa: E402
from mambactl.models.params import init_parameters  # noqa: E402
from mambactl.package import load, write_package  # noqa: E402
from mambactl.package.tokenizer import vocab_size  # noqa: E402
from mambactl.reference.lm import lm_forward  # noqa: E402
from test_parity_mamba3_torch import port_block  # noqa: E402

D_MODEL = 16
PAD_MULTIPLE = 48  # 320 tokens -> 336 embedding rows
IDS = np.random.default_rng(7).integers(0, 320, (2, 9))

# mamba_ssm config.json fields beyond d_model / vocab_size (d_inner 32: Mamba-2/3 heads of 8 channels).
CASES = {
    "mamba3_siso": dict(n_layer=2, ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "chunk_size": 4,
                                            "is_outproj_norm": True}),
    "mamba3_mimo": dict(n_layer=2, ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "ngroups": 2,
                                            "rope_fraction": 1.0, "is_mimo": True, "mimo_rank": 2, "chunk_size": 2}),
    "mamba2_mha": dict(n_layer=3, attn_layer_idx=[1],
                       ssm_cfg={"layer": "Mamba2", "d_state": 8, "d_conv": 3, "headdim": 8, "ngroups": 2,
                                "chunk_size": 4},
                       attn_cfg={"num_heads": 2, "causal": True, "rotary_emb_dim": 8, "rotary_emb_base": 500.0}),
    # MHA without rotary, with biases (MHA's defaults), first; a MIMO Mamba-3 after it
    "mha_mamba3": dict(n_layer=2, attn_layer_idx=[0],
                       ssm_cfg={"layer": "Mamba3", "d_state": 8, "headdim": 8, "is_mimo": True, "mimo_rank": 3,
                                "is_outproj_norm": True, "chunk_size": 4},
                       attn_cfg={"num_heads": 4, "causal": True, "softmax_scale": 0.5}),
}


# --- the mamba_ssm side: config, tensor shapes (from the modules' constructors), random state dicts --------------
def mamba_ssm_config(case):
    c = CASES[case]
    return {"d_model": D_MODEL, "d_intermediate": 0, "n_layer": c["n_layer"], "vocab_size": 320,
            "ssm_cfg": c["ssm_cfg"], "attn_layer_idx": c.get("attn_layer_idx", []), "attn_cfg": c.get("attn_cfg", {}),
            "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
            "pad_vocab_size_multiple": PAD_MULTIPLE, "tie_embeddings": True}


def mixer_shapes(config, i):
    """{name: shape} of layer i's mixer, as mamba_ssm's Mamba2 / Mamba3 / MHA constructors create them."""
    d, s = config["d_model"], dict(config["ssm_cfg"])
    if i in config["attn_layer_idx"]:
        a = config["attn_cfg"]
        heads, bias = a["num_heads"], a.get("qkv_proj_bias", True)
        head_dim = a.get("head_dim") or d // heads
        kv = a.get("num_heads_kv") or heads
        shapes = {"in_proj.weight": (head_dim * (heads + 2 * kv), d), "out_proj.weight": (d, head_dim * heads)}
        if bias:
            shapes |= {"in_proj.bias": (head_dim * (heads + 2 * kv),), "out_proj.bias": (d,)}
        return shapes
    di = s.get("expand", 2) * d
    H, N, G = di // s["headdim"], s["d_state"], s.get("ngroups", 1)
    if s["layer"] == "Mamba2":
        conv = di + 2 * G * N
        return {"in_proj.weight": (di + conv + H, d), "conv1d.weight": (conv, 1, s["d_conv"]), "conv1d.bias": (conv,),
                "dt_bias": (H,), "A_log": (H,), "D": (H,), "norm.weight": (di,), "out_proj.weight": (d, di)}
    R = s.get("mimo_rank", 4) if s.get("is_mimo") else 1
    S = int(N * s.get("rope_fraction", 0.5)) // 2
    shapes = {"in_proj.weight": (2 * di + 2 * N * G * R + 3 * H + S, d), "dt_bias": (H,), "B_bias": (H, R, N),
              "C_bias": (H, R, N), "B_norm.weight": (N,), "C_norm.weight": (N,), "D": (H,)}
    if s.get("is_mimo"):
        shapes |= {"mimo_x": (H, R, s["headdim"]), "mimo_z": (H, R, s["headdim"]), "mimo_o": (H, R, s["headdim"])}
    if s.get("is_outproj_norm"):
        shapes["norm.weight"] = (di,)
    return shapes | {"out_proj.weight": (d, di)}


def random_value(gen, leaf, shape):
    """Random float32 values of the right scale for each kind of tensor (Δ near 1, A in [-4, -1], ...)."""
    x = torch.randn(shape, generator=gen)
    if leaf == "dt_bias":
        return x
    if leaf == "A_log":
        return torch.log(1 + 3 * torch.rand(shape, generator=gen))
    if leaf in ("D", "B_bias", "C_bias", "mimo_z") or leaf.endswith("norm.weight"):
        return 1 + 0.3 * x
    if leaf in ("mimo_x", "mimo_o"):
        return 1 / shape[1] + 0.3 * x
    if leaf.endswith("bias"):
        return 0.2 * x
    return x / np.sqrt(np.prod(shape[1:]))


def random_state_dict(config, seed=0):
    """A MambaLMHeadModel-style state dict: tied lm_head (same tensor), `_metadata` as state_dict() attaches."""
    gen = torch.Generator().manual_seed(seed)
    rows = -(-config["vocab_size"] // config["pad_vocab_size_multiple"]) * config["pad_vocab_size_multiple"]
    sd = OrderedDict({"backbone.embedding.weight": 0.5 * torch.randn(rows, config["d_model"], generator=gen)})
    for i in range(config["n_layer"]):
        sd[f"backbone.layers.{i}.norm.weight"] = random_value(gen, "norm.weight", (config["d_model"],))
        for leaf, shape in mixer_shapes(config, i).items():
            sd[f"backbone.layers.{i}.mixer.{leaf}"] = random_value(gen, leaf, shape)
    sd["backbone.norm_f.weight"] = random_value(gen, "norm.weight", (config["d_model"],))
    sd["lm_head.weight"] = sd["backbone.embedding.weight"]
    sd._metadata = OrderedDict({"": {"version": 1}})
    return sd


def write_dir(path, config, sd, tokenizer):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    torch.save(sd, path / "pytorch_model.bin")
    tokenizer.save(str(path / "tokenizer.json"))
    return path


# --- the PyTorch forward (float64) ------------------------------------------------------------------------------
def rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * w


def rotary(x, dim, base):
    """flash_attn RotaryEmbedding(dim, base, interleaved=False) at positions 0..L-1 on x (b, l, h, d)."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), inv_freq)[:, None, :]  # (l, 1, dim/2)
    cos, sin = torch.cat([freqs.cos()] * 2, dim=-1), torch.cat([freqs.sin()] * 2, dim=-1)
    x_ro, x_pass = x[..., :dim], x[..., dim:]
    x1, x2 = x_ro.chunk(2, dim=-1)
    return torch.cat([x_ro * cos + torch.cat([-x2, x1], dim=-1) * sin, x_pass], dim=-1)


def mha_forward(p, u, a):
    """mamba_ssm MHA.forward without inference params (mha.py)."""
    heads = a["num_heads"]
    head_dim = a.get("head_dim") or u.shape[-1] // heads
    kv_heads = a.get("num_heads_kv") or heads
    qkv = F.linear(u, p["in_proj.weight"], p.get("in_proj.bias"))
    q, kv = qkv.split([heads * head_dim, 2 * kv_heads * head_dim], dim=-1)
    q = q.unflatten(-1, (heads, head_dim))
    k, v = kv.unflatten(-1, (2, kv_heads, head_dim)).unbind(dim=-3)  # "... (two hkv d) -> ... two hkv d"
    if a.get("rotary_emb_dim", 0):
        base = a.get("rotary_emb_base", 10000.0)
        q, k = rotary(q, a["rotary_emb_dim"], base), rotary(k, a["rotary_emb_dim"], base)
    k = torch.repeat_interleave(k, dim=2, repeats=heads // kv_heads)
    v = torch.repeat_interleave(v, dim=2, repeats=heads // kv_heads)
    context = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=a.get("causal", False),
                                             scale=a.get("softmax_scale")).transpose(1, 2)
    return F.linear(context.flatten(-2), p["out_proj.weight"], p.get("out_proj.bias"))


def mamba2_forward(p, u, s):
    """mamba_ssm Mamba2 (rmsnorm, gate before norm, Δ clamped to dt_limit) as its step recurrence."""
    b, l, d = u.shape
    di = s.get("expand", 2) * d
    P, G, N = s["headdim"], s.get("ngroups", 1), s["d_state"]
    H = di // P
    z, xBC, dt = torch.split(u @ p["in_proj.weight"].T, [di, di + 2 * G * N, H], dim=-1)
    xBC = F.conv1d(xBC.transpose(1, 2), p["conv1d.weight"], p["conv1d.bias"], padding=s["d_conv"] - 1,
                   groups=xBC.shape[-1])[..., :l].transpose(1, 2)
    x, B, C = torch.split(F.silu(xBC), [di, G * N, G * N], dim=-1)
    x = x.reshape(b, l, H, P)
    B = B.reshape(b, l, G, N).repeat_interleave(H // G, dim=2)
    C = C.reshape(b, l, G, N).repeat_interleave(H // G, dim=2)
    dt = F.softplus(dt + p["dt_bias"]).clamp(*s.get("dt_limit", (0.0, float("inf"))))
    A = -torch.exp(p["A_log"])
    h = torch.zeros(b, H, P, N, dtype=u.dtype)
    ys = []
    for t in range(l):
        h = (torch.exp(dt[:, t] * A)[..., None, None] * h
             + dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]) + p["D"][:, None] * x[:, t])
    y = (torch.stack(ys, dim=1).reshape(b, l, di) * F.silu(z)).reshape(b, l, G, di // G)
    y = rms_norm(y, 1.0).reshape(b, l, di) * p["norm.weight"]
    return y @ p["out_proj.weight"].T


def mamba3_model_config(config):
    """A ModelConfig that only carries the Mamba-3 dims the port reads (built from ssm_cfg, not the importer)."""
    m = {k: v for k, v in config["ssm_cfg"].items() if k != "layer"}
    return ModelConfig(vocab_size=config["vocab_size"], d_model=config["d_model"], n_layer=1, layers=["mamba3"],
                       mamba3=Mamba3Config(**m))


def torch_logits(config, sd, ids=IDS):
    """MambaLMHeadModel.forward in float64: embedding, n_layer x (h += mixer(RMSNorm(h))), norm_f, lm_head."""
    p = {k: v.double() for k, v in sd.items()}
    h = p["backbone.embedding.weight"][torch.from_numpy(ids)]
    for i in range(config["n_layer"]):
        prefix = f"backbone.layers.{i}.mixer."
        mixer = {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}
        x = rms_norm(h, p[f"backbone.layers.{i}.norm.weight"])
        if i in config["attn_layer_idx"]:
            y = mha_forward(mixer, x, config["attn_cfg"])
        elif config["ssm_cfg"]["layer"] == "Mamba2":
            y = mamba2_forward(mixer, x, config["ssm_cfg"])
        else:
            y = port_block(mixer, x, mamba3_model_config(config))
        h = h + y
    return (rms_norm(h, p["backbone.norm_f.weight"]) @ p["lm_head.weight"].T).numpy()


def ours(pkg, ids=IDS):
    """Logits [B, L, V_padded] of mambactl's float64 reference."""
    return lm_forward({k: v.astype(np.float64) for k, v in pkg.weights.items()}, pkg.config, ids)[0]


# --- import ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(CASES))
def imported(request, tmp_path_factory, pkg_tokenizer):
    """(case, mamba_ssm config, state dict, the imported package, the PyTorch logits)."""
    case = request.param
    tmp = tmp_path_factory.mktemp(case)
    config, sd = mamba_ssm_config(case), random_state_dict(mamba_ssm_config(case))
    src = write_dir(tmp / "src", config, sd, pkg_tokenizer)
    import_checkpoint(src, tmp / "m.evermind")
    return case, config, sd, load(tmp / "m.evermind"), torch_logits(config, sd)


def test_import_gives_the_torch_logits_on_the_reference(imported):
    case, config, sd, pkg, logits = imported
    cfg = pkg.config
    attn = set(config["attn_layer_idx"])
    kind = config["ssm_cfg"]["layer"].lower()
    assert cfg.layers == ["attention" if i in attn else kind for i in range(config["n_layer"])]
    assert cfg.vocab_size == 320 and cfg.padded_vocab_size == 336
    if kind == "mamba3":
        want = Mamba3Config(**{k: v for k, v in config["ssm_cfg"].items() if k != "layer"})
        assert cfg.mamba3 == want
    if attn:
        a = config["attn_cfg"]
        assert (cfg.attention.n_heads, cfg.attention.rope, cfg.attention.bias) == (
            a["num_heads"], a.get("rotary_emb_dim", 0) > 0, a.get("qkv_proj_bias", True))
        assert cfg.attention.rope_base == a.get("rotary_emb_base", 10000.0)
    for name, t in sd.items():  # every tensor arrived unchanged, MHA's in_proj as qkv_proj
        ours_name = name.replace("backbone.embedding.", "backbone.embeddings.")
        if any(name.startswith(f"backbone.layers.{i}.mixer.in_proj.") for i in attn):
            ours_name = ours_name.replace("mixer.in_proj.", "mixer.qkv_proj.")
        if name != "lm_head.weight":
            np.testing.assert_array_equal(pkg.weights[ours_name], t.numpy(), err_msg=name)
    assert np.abs(ours(pkg) - logits).max() < 1e-9 * np.abs(logits).max()


def test_import_gives_the_torch_logits_on_the_gpu(imported, gpu):
    case, config, sd, pkg, logits = imported
    _, gpu_logits, _ = LanguageModel(pkg.config, gpu, pkg.weights).forward(IDS)
    assert rel(gpu_logits.numpy(), logits.reshape(-1, logits.shape[-1])) < 1e-4


def test_tensor_problems_name_the_tensor_and_shape(tmp_path, pkg_tokenizer):
    config = mamba_ssm_config("mamba2_mha")
    sd = random_state_dict(config)
    del sd["backbone.layers.1.mixer.in_proj.bias"]
    write_dir(tmp_path / "a", config, sd, pkg_tokenizer)
    with pytest.raises(MambactlError, match=r"missing tensor backbone\.layers\.1\.mixer\.in_proj\.bias "
                                            r"\(expected shape \[48\]\)"):
        import_checkpoint(tmp_path / "a", tmp_path / "a.evermind")
    config = mamba_ssm_config("mamba3_mimo")
    sd = random_state_dict(config)
    sd["backbone.layers.0.mixer.B_bias"] = torch.ones(4, 1, 8)
    write_dir(tmp_path / "b", config, sd, pkg_tokenizer)
    with pytest.raises(MambactlError, match=r"tensor backbone\.layers\.0\.mixer\.B_bias has shape \[4, 1, 8\]; "
                                            r"expected \[4, 2, 8\]"):
        import_checkpoint(tmp_path / "b", tmp_path / "b.evermind")
    assert not (tmp_path / "a.evermind").exists() and not (tmp_path / "b.evermind").exists()


# --- export ------------------------------------------------------------------------------------------------------
PACKAGES = {  # mambactl configs (d_model 16): every mamba_ssm layer type, hybrids, non-default settings
    "mamba1": {"layers": ["mamba1"] * 2, "mamba1": {"d_state": 4, "d_conv": 3, "dt_rank": 3, "bias": True}},
    "mamba2": {"layers": ["mamba2"] * 2, "mamba2": {"d_state": 8, "d_conv": 3, "headdim": 8, "ngroups": 2,
                                                    "chunk_size": 4, "dt_limit": [0.01, 5.0]}},
    "mamba3_mimo": {"layers": ["mamba3"] * 2, "mamba3": {"d_state": 8, "headdim": 8, "is_mimo": True,
                                                         "mimo_rank": 2, "A_floor": 0.01, "chunk_size": 8}},
    "mamba2_attention": {"layers": ["mamba2", "attention", "mamba2"],
                         "mamba2": {"d_state": 8, "d_conv": 3, "headdim": 8, "chunk_size": 4},
                         "attention": {"n_heads": 2, "rope_base": 500.0}},
    "attention_mamba3": {"layers": ["attention", "mamba3"], "mamba3": {"d_state": 8, "headdim": 8},
                         "attention": {"n_heads": 4, "rope": False, "bias": True}},
}


def make_package(path, tok, name, seed=0):
    cfg = ModelConfig.from_dict({"vocab_size": vocab_size(tok), "d_model": D_MODEL,
                                 "n_layer": len(PACKAGES[name]["layers"]), "pad_vocab_size_multiple": PAD_MULTIPLE,
                                 **PACKAGES[name]})
    rng = np.random.default_rng(seed)
    weights = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
               for k, v in init_parameters(cfg, seed).items()}
    write_package(path, cfg, weights, tok, name=name, version="1.0")
    return load(path)


@pytest.mark.parametrize("name", list(PACKAGES))
def test_export_loads_in_torch_and_round_trips(tmp_path, pkg_tokenizer, name):
    pkg = make_package(tmp_path / "p.evermind", pkg_tokenizer, name)
    files = export_mamba_ssm(pkg, tmp_path / "out")
    assert sorted(f.name for f in files) == ["config.json", "pytorch_model.bin", "tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "p.evermind"]  # no temporary left
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    attn = [i for i, t in enumerate(pkg.config.layers) if t == "attention"]
    assert config["attn_layer_idx"] == attn and config["d_intermediate"] == 0 and config["rms_norm"] is True
    assert (config["vocab_size"], config["pad_vocab_size_multiple"], config["tie_embeddings"]) == (320, 48, True)
    kinds = set(pkg.config.layers) - {"attention"}
    assert config["ssm_cfg"]["layer"] == {"mamba1": "Mamba1", "mamba2": "Mamba2", "mamba3": "Mamba3"}[kinds.pop()]
    # torch.load(weights_only=True): exactly our arrays under mamba_ssm's names, lm_head tied to the embedding
    sd = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    expected = {}
    for k, v in pkg.weights.items():
        k = k.replace("backbone.embeddings.", "backbone.embedding.")
        if any(k.startswith(f"backbone.layers.{i}.mixer.qkv_proj.") for i in attn):
            k = k.replace("mixer.qkv_proj.", "mixer.in_proj.")
        expected[k] = v
    expected["lm_head.weight"] = pkg.weights["backbone.embeddings.weight"]
    assert list(sd) == list(expected)
    for k, v in expected.items():
        assert sd[k].dtype == torch.float32
        np.testing.assert_array_equal(sd[k].numpy(), v, err_msg=k)
    assert sd["lm_head.weight"].data_ptr() == sd["backbone.embedding.weight"].data_ptr()
    assert (tmp_path / "out" / "tokenizer.json").read_text() == pkg.tokenizer.to_str()
    # the exported directory computes our logits in the PyTorch forward (Mamba-1 has none here: HF's tests cover it)
    if "mamba1" not in pkg.config.layers:
        logits = torch_logits(config, sd)
        assert np.abs(ours(pkg) - logits).max() < 1e-9 * np.abs(logits).max()
    # and imports back to the same package
    import_checkpoint(tmp_path / "out", tmp_path / "back.evermind")
    back = load(tmp_path / "back.evermind")
    assert back.config.to_dict() == pkg.config.to_dict()
    assert back.tokenizer.to_str() == pkg.tokenizer.to_str()
    assert list(back.weights) == list(pkg.weights)
    for k, v in pkg.weights.items():
        np.testing.assert_array_equal(back.weights[k], v, err_msg=k)


def test_export_refusals_leave_nothing(tmp_path, pkg_tokenizer, monkeypatch):
    tok = pkg_tokenizer
    mixed = ModelConfig.from_dict({"vocab_size": vocab_size(tok), "d_model": D_MODEL, "n_layer": 2,
                                   "layers": ["mamba1", "mamba3"], "mamba3": {"d_state": 8, "headdim": 8}})
    eps = ModelConfig.from_dict({"vocab_size": vocab_size(tok), "d_model": D_MODEL, "n_layer": 1, "norm_eps": 1e-6})
    for cfg, needle in ((mixed, "mamba_ssm has one ssm_cfg for every SSM layer; this model mixes mamba1, mamba3"),
                        (eps, "mamba_ssm has no norm_eps setting (its norms use 1e-05); this model has norm_eps = "
                              "1e-06")):
        write_package(tmp_path / "p.evermind", cfg, init_parameters(cfg), tok, name="p", version="1")
        with pytest.raises(MambactlError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            export_mamba_ssm(load(tmp_path / "p.evermind"), tmp_path / "out")
        assert not (tmp_path / "out").exists()
    pkg = make_package(tmp_path / "ok.evermind", tok, "mamba2")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(MambactlError, match="full: already exists"):
        export_mamba_ssm(pkg, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()  # an empty directory is filled
    export_mamba_ssm(pkg, tmp_path / "empty")
    assert (tmp_path / "empty" / "pytorch_model.bin").is_file()

    def disk_full(*args, **kwargs):  # a write failing halfway: the directory must not appear
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("mambactl.interop.mamba_ssm.write_torch_checkpoint", disk_full)
    with pytest.raises(MambactlError, match="out: cannot write \\(No space left on device\\)"):
        export_mamba_ssm(pkg, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full", "ok.evermind", "p.evermind"]


# --- the CLI: one line per unsupported setting, no output ---------------------------------------------------------
def _attn(**kw):
    return lambda c: c["attn_cfg"].update(kw)


BAD = {  # case, config edit, needles
    "d_intermediate": ("mamba2_mha", lambda c: c.update(d_intermediate=64),
                       ["config.json: d_intermediate = 64 is not supported (a gated MLP", "supported: 0"]),
    "rms_norm": ("mamba3_siso", lambda c: c.update(rms_norm=False),
                 ["config.json: rms_norm = false is not supported (LayerNorm); supported: true"]),
    "num_heads_kv": ("mamba2_mha", _attn(num_heads_kv=1),
                     ["attn_cfg.num_heads_kv = 1 is not supported (grouped-query", "supported: null or num_heads = 2"]),
    "head_dim": ("mamba2_mha", _attn(head_dim=16),
                 ["attn_cfg.head_dim = 16 is not supported", "supported: null or d_model / num_heads = 8"]),
    "partial_rotary": ("mamba2_mha", _attn(rotary_emb_dim=4),
                       ["attn_cfg.rotary_emb_dim = 4 is not supported (partial rotary)",
                        "supported: 0 (no rotary) or head_dim = 8"]),
    "interleaved_rotary": ("mamba2_mha", _attn(rotary_emb_interleaved=True),
                           ["attn_cfg.rotary_emb_interleaved = true is not supported", "supported: false"]),
    "mha_conv": ("mamba2_mha", _attn(d_conv=4), ["attn_cfg.d_conv = 4 is not supported", "supported: 0"]),
    "mha_mlp": ("mamba2_mha", _attn(mlp_dim=64), ["attn_cfg.mlp_dim = 64 is not supported", "supported: 0"]),
    "non_causal": ("mamba2_mha", _attn(causal=False),
                   ["attn_cfg.causal = false is not supported (bidirectional", "supported: true"]),
    "causal_default": ("mamba2_mha", lambda c: c["attn_cfg"].pop("causal"),
                       ["attn_cfg.causal = false is not supported (bidirectional attention, MHA's default)"]),
    "softmax_scale": ("mamba2_mha", _attn(softmax_scale=0.5),
                      ["attn_cfg.softmax_scale = 0.5 is not supported", "supported: null or 1 / sqrt(head_dim) = "
                                                                        "0.3535534"]),
    "bias_mix": ("mamba2_mha", _attn(out_proj_bias=False),
                 ["attn_cfg.qkv_proj_bias = true with out_proj_bias = false is not supported",
                  "supported: both true or both false"]),
    "mha_unknown": ("mamba2_mha", _attn(window_size=16),
                    ["attn_cfg.window_size is not an MHA setting mambactl knows (supported: num_heads, "]),
    "attn_layer_idx": ("mamba2_mha", lambda c: c.update(attn_layer_idx=[3]),
                       ["attn_layer_idx must list distinct layer indices in [0, n_layer = 3), got [3]"]),
    "mamba3_option": ("mamba3_mimo", lambda c: c["ssm_cfg"].update(use_midpoint_control=True),
                      ["ssm_cfg.use_midpoint_control is not a Mamba3 setting mambactl knows (supported: A_floor, "]),
    "mamba3_rope_fraction": ("mamba3_siso", lambda c: c["ssm_cfg"].update(rope_fraction=0.25),
                             ["mamba3.rope_fraction: must be 0.5 or 1.0"]),
    "ssm_layer": ("mamba3_siso", lambda c: c["ssm_cfg"].update(layer="Mamba4"),
                  ["unsupported architecture: ssm_cfg.layer = 'Mamba4'", "Mamba1, Mamba2 and Mamba3"]),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_cli_refuses_unsupported_settings_in_one_line(tmp_path, pkg_tokenizer, pkg_cli, pkg_one_line_error, bad):
    case, edit, needles = BAD[bad]
    config = mamba_ssm_config(case)
    config = json.loads(json.dumps(config))  # a deep copy to edit
    edit(config)
    src = write_dir(tmp_path / "src", config, random_state_dict(mamba_ssm_config(case)), pkg_tokenizer)
    result = pkg_cli("import", src, "-o", tmp_path / "out.evermind")
    pkg_one_line_error(result, f"{src}/config.json: ", *needles)
    assert not (tmp_path / "out.evermind").exists()


def test_cli_export_and_import(tmp_path, pkg_tokenizer, pkg_cli, pkg_one_line_error):
    make_package(tmp_path / "p.evermind", pkg_tokenizer, "mamba2_attention")
    result = pkg_cli("export", tmp_path / "p.evermind", "--format", "mamba_ssm", "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "pytorch_model.bin" in result.stdout
    result = pkg_cli("import", tmp_path / "out", "-o", tmp_path / "back.evermind")
    assert result.returncode == 0, result.stderr
    assert "3 layers (2 mamba2, 1 attention)" in result.stdout
    result = pkg_cli("export", tmp_path / "p.evermind", "--format", "mamba_ssm", "-o", tmp_path / "out")
    pkg_one_line_error(result, "out: already exists")
    result = pkg_cli("export", tmp_path / "p.evermind", "--format", "mamba_ssm", "--dtype", "f16", "-o",
                     tmp_path / "x")
    pkg_one_line_error(result, "--dtype applies to --format gguf only; mamba_ssm exports are float32")
    shutil.rmtree(tmp_path / "out")
