"""Recurrent decoding equals the parallel forward: prefill a prefix, step the rest one token at a time."""

import numpy as np
import pytest

from lm_checks import random_weights
from mambactl.errors import MambactlError, ShapeError
from mambactl.models.config import (LAYER_TYPES, AttentionConfig, Mamba1Config, Mamba2Config, Mamba3Config,
                                    ModelConfig)
from mambactl.models.decode import DECODERS, RecurrentDecoder
from mambactl.models.lm import LanguageModel


@pytest.mark.parametrize("cfg", [
    ModelConfig(vocab_size=30, d_model=12, n_layer=2, mamba1=Mamba1Config(d_state=4, d_conv=4)),
    ModelConfig(vocab_size=17, d_model=8, n_layer=1, mamba1=Mamba1Config(d_state=3, d_conv=2, bias=True)),
    # prefixes 1, 3, 9 against chunk 4: one partial chunk, a whole one plus padding, several chunks
    ModelConfig(vocab_size=23, d_model=8, n_layer=2, layers=["mamba2"] * 2,
                mamba2=Mamba2Config(d_state=4, headdim=4, ngroups=2, chunk_size=4)),
    # biases, no conv bias, a binding dt_limit, d_conv 3
    ModelConfig(vocab_size=19, d_model=8, n_layer=1, layers=["mamba2"],
                mamba2=Mamba2Config(d_state=3, d_conv=3, headdim=8, chunk_size=4, bias=True, conv_bias=False,
                                    dt_limit=[0.05, 1.5])),
    ModelConfig(vocab_size=30, d_model=8, n_layer=3, layers=["mamba1", "mamba2", "mamba1"],
                mamba1=Mamba1Config(d_state=4), mamba2=Mamba2Config(d_state=4, headdim=4, chunk_size=8)),
    # Mamba-3 SISO (half the state dims rotated), chunk 4 against prefixes 1, 3, 9
    ModelConfig(vocab_size=21, d_model=16, n_layer=2, layers=["mamba3"] * 2,
                mamba3=Mamba3Config(d_state=8, headdim=8, chunk_size=4)),
    # Mamba-3 MIMO rank 2, grouped B/C, every pair rotated, the out-norm, next to a Mamba-2 layer
    ModelConfig(vocab_size=20, d_model=16, n_layer=2, layers=["mamba2", "mamba3"],
                mamba2=Mamba2Config(d_state=4, headdim=8, chunk_size=4),
                mamba3=Mamba3Config(d_state=8, headdim=8, ngroups=2, chunk_size=4, is_mimo=True, mimo_rank=2,
                                    rope_fraction=1.0, is_outproj_norm=True)),
    # attention: a KV cache per layer, rotary at each new position
    ModelConfig(vocab_size=22, d_model=16, n_layer=2, layers=["attention"] * 2, attention=AttentionConfig(n_heads=2)),
    # no rotary, biases, one head of dim 16
    ModelConfig(vocab_size=18, d_model=16, n_layer=1, layers=["attention"],
                attention=AttentionConfig(n_heads=1, rope=False, bias=True)),
    # a hybrid: attention between Mamba-2 and Mamba-3 layers
    ModelConfig(vocab_size=25, d_model=16, n_layer=4, layers=["mamba2", "attention", "mamba3", "attention"],
                mamba2=Mamba2Config(d_state=4, headdim=8, chunk_size=4),
                mamba3=Mamba3Config(d_state=8, headdim=8, chunk_size=4), attention=AttentionConfig(n_heads=4, rope_base=50.0)),
], ids=["mamba1", "mamba1-bias", "mamba2", "mamba2-bias-limit", "mixed", "mamba3-siso", "mamba3-mimo", "attention",
        "attention-norope-bias", "hybrid"])
@pytest.mark.parametrize("prefix", [1, 3, 9])
def test_step_logits_equal_parallel_forward(gpu, cfg, prefix):
    lm = LanguageModel(cfg, gpu, random_weights(cfg, 0))
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    _, logits, _ = lm.forward(ids)
    want = logits.numpy().reshape(2, 12, -1)
    dec = RecurrentDecoder(lm)
    got = [dec.prefill(ids[:, :prefix])]
    for t in range(prefix, 12):
        got.append(dec.step(ids[:, t]))
    got = np.stack(got, axis=1)
    err = np.abs(got - want[:, prefix - 1:]).max() / np.abs(want).max()
    assert err < 1e-4


def test_every_layer_type_decodes():
    assert set(DECODERS) == set(LAYER_TYPES)


REPLAY_CFGS = {
    "mamba1": ModelConfig(vocab_size=30, d_model=12, n_layer=2, mamba1=Mamba1Config(d_state=4, d_conv=4)),
    "mamba2": ModelConfig(vocab_size=23, d_model=8, n_layer=2, layers=["mamba2"] * 2,
                          mamba2=Mamba2Config(d_state=4, headdim=4, ngroups=2, chunk_size=4)),
    "mamba2-mamba3-mimo": ModelConfig(vocab_size=20, d_model=16, n_layer=2, layers=["mamba2", "mamba3"],
                                      mamba2=Mamba2Config(d_state=4, headdim=8, chunk_size=4),
                                      mamba3=Mamba3Config(d_state=8, headdim=8, ngroups=2, chunk_size=4, is_mimo=True,
                                                          mimo_rank=2, rope_fraction=1.0, is_outproj_norm=True)),
    "mamba3-siso": ModelConfig(vocab_size=21, d_model=16, n_layer=2, layers=["mamba3"] * 2,
                               mamba3=Mamba3Config(d_state=8, headdim=8, chunk_size=4)),
}


@pytest.mark.parametrize("name", sorted(REPLAY_CFGS))
def test_replayed_steps_equal_recorded_ones_and_run_no_op_code(gpu, name, monkeypatch):
    cfg = REPLAY_CFGS[name]
    lm = LanguageModel(cfg, gpu, random_weights(cfg, 0))
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 10))
    plain, replayed = RecurrentDecoder(lm, replay=False), RecurrentDecoder(lm)
    assert replayed.replay and not plain.replay
    for round_ in range(2):  # a second prefill starts the states, and the graph, afresh
        prompt = ids[:, : 2 + round_]
        want, got = [plain.prefill(prompt)], [replayed.prefill(prompt)]
        for t in range(prompt.shape[1], 10):
            want.append(plain.step(ids[:, t]))
            if t >= prompt.shape[1] + 2:  # the first step records, the second is captured, then replays
                runs = []
                monkeypatch.setattr(gpu, "run", lambda *a, **k: runs.append(a[0]))
                got.append(replayed.step(ids[:, t]))
                monkeypatch.undo()
                assert runs == [], "a replayed step must not go through the ops"
            else:
                got.append(replayed.step(ids[:, t]))
        np.testing.assert_array_equal(np.stack(got), np.stack(want))  # the same kernels on the same data


def test_attention_models_record_every_step_and_a_wrong_batch_is_refused(gpu):
    cfg = ModelConfig(vocab_size=25, d_model=16, n_layer=2, layers=["mamba2", "attention"],
                      mamba2=Mamba2Config(d_state=4, headdim=8, chunk_size=4), attention=AttentionConfig(n_heads=2))
    lm = LanguageModel(cfg, gpu, random_weights(cfg, 0))
    dec = RecurrentDecoder(lm)
    assert not dec.replay  # its KV cache grows and its position moves: no step is like the last
    dec.prefill(np.zeros((2, 3), np.int64))
    with pytest.raises(MambactlError, match="3 tokens for a batch of 2"):
        dec.step(np.zeros(3, np.int64))


@pytest.mark.parametrize("name", ["mamba2", "mamba2-mamba3-mimo", "mamba3-siso"])
def test_step_kernels_split_rows_of_the_state_over_lanes_as_on_gpus(gpu, name, monkeypatch):
    """ssd_step and mamba3_scan_step with 32 threads a row of the state and a tree (GPUs' pick; CPU adapters walk
    a row in one thread) still continue the parallel forward."""
    from mambactl.ops import ssd

    monkeypatch.setattr(ssd, "step_lanes", lambda _rt: 32)
    cfg = REPLAY_CFGS[name]
    lm = LanguageModel(cfg, gpu, random_weights(cfg, 0))
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8))
    _, logits, _ = lm.forward(ids)
    want = logits.numpy().reshape(2, 8, -1)
    dec = RecurrentDecoder(lm)
    got = np.stack([dec.prefill(ids[:, :3])] + [dec.step(ids[:, t]) for t in range(3, 8)], axis=1)
    assert np.abs(got - want[:, 2:]).max() / np.abs(want).max() < 1e-4


def test_a_forward_of_last_logits_only_takes_no_targets(gpu):
    cfg = REPLAY_CFGS["mamba1"]
    lm = LanguageModel(cfg, gpu, random_weights(cfg, 0))
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (3, 5))
    _, full, _ = lm.forward(ids)
    _, last, _ = lm.forward(ids, last_only=True)
    want = full.numpy().reshape(3, 5, -1)[:, -1]  # (on GPUs the 3 rows' head is matvec, the 15 rows' the tiled GEMM)
    assert last.shape == (3, want.shape[1]) and np.abs(last.numpy() - want).max() / np.abs(want).max() < 1e-5
    with pytest.raises(ShapeError, match="last_only computes no loss"):
        lm.forward(ids, ids, last_only=True)
