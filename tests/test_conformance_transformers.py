"""Conformance of dsakit's V4 indexer (dsakit.layers.DSAIndexer) with Hugging Face transformers' DeepSeek-V4.

A tiny random DeepseekV4Config is built on the CPU (no hub, no network); one CSA compressor with its lightning
indexer is instantiated, its weights are copied into dsakit, and both are run on the same hidden states.
transformers' intermediate tensors are captured with forward hooks on the indexer's ``kv_norm`` (pre-norm
compressed keys) and ``scorer`` (queries, post-rope keys, scores).

Tolerances (fp32 everywhere):
* pre-norm compressed keys: atol 1e-5 (same math, different summation order);
* post-norm/rope keys and queries: atol 1e-4 (transformers computes rope angles in fp32, dsakit in fp64);
* exact scores: rtol 1e-4 relative to the row's largest |score|;
* top-k sets: equal, except entries whose exact score is within ``eps_t`` of the k-th score of row t, with
  eps_t = 1e-4 x max|score| for the fp32 pipeline and, for bf16 keys, twice the largest score change the
  actual bf16 rounding of the stored keys can cause, max_j sum_h |w_th| |q_th . (bf16(k_j) - k_j)|, plus
  that 1e-4 x max|score|. Exact ties are common: a score is exactly 0 whenever every head's q . k < 0.

Every convention difference is written up in docs/conventions.md.
"""

from __future__ import annotations

import pytest
import torch

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4",
                               reason="transformers with DeepSeek-V4 is a test-only dependency")
configuration = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

from dsakit.formats import KeyFormat  # noqa: E402
from dsakit.layers import DSAIndexer, rope_from_transformers  # noqa: E402
from dsakit.ops.indexer.reference import index_scores_dense  # noqa: E402
from dsakit.ops.indexer.reference import select_topk  # noqa: E402
from dsakit.presets import get_preset  # noqa: E402
from dsakit.transforms import ROPE_V4, ROPE_V32, apply_rope  # noqa: E402

from _helpers import V4_YARN, randomize_v4_, tiny_v4_config  # noqa: E402


HIDDEN, Q_LORA, HEADS, TOPK = 64, 32, 4, 8


def tiny_config(**overrides):
    return tiny_v4_config(hidden_size=HIDDEN, q_lora_rank=Q_LORA, index_n_heads=HEADS, index_topk=TOPK, **overrides)


class Captured:
    """Forward hooks on the transformers indexer: pre-norm keys, queries, post-rope keys and scores."""

    def __init__(self, indexer):
        self.data = {}
        self.handles = [
            indexer.kv_norm.register_forward_hook(self._kv_norm),
            indexer.scorer.register_forward_hook(self._scorer),
        ]

    def _kv_norm(self, module, args, output):
        self.data["prenorm"] = args[0].detach().clone()

    def _scorer(self, module, args, output):
        q, keys, _ = args
        self.data.update(q=q.detach().clone(), keys=keys.detach().clone(), scores=output.detach().clone())

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    compressor = modeling.DeepseekV4CSACompressor(tiny_config()).eval()
    randomize_v4_(compressor, torch.Generator().manual_seed(1))
    return compressor


def run_transformers(compressor, seq_len: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, seq_len, HIDDEN, generator=gen)
    q_residual = torch.randn(1, seq_len, Q_LORA, generator=gen)
    positions = torch.arange(seq_len).unsqueeze(0)
    hooks = Captured(compressor.indexer)
    with torch.no_grad():
        top = compressor.indexer(hidden, q_residual, positions, None, 0)
    hooks.close()
    return hidden[0], q_residual[0], top[0], hooks.data


# --------------------------------------------------------------------------------------------------
# Weights, rope and the compressed keys
# --------------------------------------------------------------------------------------------------


def test_from_transformers_copies_weights_and_rope(layer):
    ix = DSAIndexer.from_transformers(layer.indexer)
    assert torch.equal(ix.wq_b, layer.indexer.q_b_proj.weight)
    assert torch.equal(ix.weights_proj, layer.indexer.scorer.weights_proj.weight)
    assert torch.equal(ix.wkv, layer.indexer.kv_proj.weight) and torch.equal(ix.ape, layer.indexer.position_bias)
    assert ix.heads == HEADS and ix.index_topk == TOPK and ix.ratio == 4
    # the rope read off the module is the V4 preset's (theta 160000, YaRN factor 16 from 65536)
    assert ix.rope == get_preset("deepseek-v4-flash").rope
    # passing the CSA compressor picks its .indexer
    same = DSAIndexer.from_transformers(layer)
    assert torch.equal(same.wq_b, ix.wq_b) and torch.equal(same.wkv, ix.wkv)
    # the main-attention compressor (head_dim 512) is not an index-key compressor
    with pytest.raises(ValueError, match="wkv"):
        DSAIndexer.from_transformers(layer.indexer, compressor_module=layer)


def test_rope_frequencies_and_layout_match_transformers(layer):
    rotary = layer.indexer.rotary_emb
    dsakit_rope = get_preset("deepseek-v4-flash").rope
    assert torch.allclose(dsakit_rope.inv_freq().float(), rotary.compress_inv_freq, rtol=1e-6, atol=0)
    positions = torch.tensor([[0, 1, 5, 17, 60]])
    x = torch.randn(1, 3, 5, 128)  # [B, H, S, D] as transformers rotates queries
    cos, sin = rotary(x, position_ids=positions, layer_type="compress")
    theirs = modeling.apply_rotary_pos_emb(x, cos, sin)
    my_cos, my_sin = dsakit_rope.cos_sin(positions[0])
    ours = apply_rope(x[0].transpose(0, 1), my_cos, my_sin, ROPE_V4).transpose(0, 1)
    assert torch.allclose(theirs[0], ours, atol=1e-5)
    # V3.2's half-split leading layout is a different rotation: it must not match
    wrong = apply_rope(x[0].transpose(0, 1), my_cos, my_sin, ROPE_V32).transpose(0, 1)
    assert not torch.allclose(theirs[0], wrong, atol=1e-2)


def test_yarn_attention_factor_must_be_one():
    """transformers' YaRN scales cos/sin by 0.1 ln(16) + 1 = 1.277 unless attention_factor = 1 (the config
    injects 1.0 for the flat rope_parameters form, but not for an already nested dict)."""
    nested = {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
              "compress": {**V4_YARN, "rope_theta": 160000.0, "partial_rotary_factor": 0.125}}
    rotary = modeling.DeepseekV4RotaryEmbedding(tiny_config(rope_parameters=nested))
    assert rotary.compress_attention_scaling == pytest.approx(1.2772588722)
    with pytest.raises(ValueError, match="attention_factor"):
        rope_from_transformers(rotary)


@pytest.mark.parametrize("seq_len", [64, 66])
def test_compressed_keys_match(layer, seq_len):
    ix = DSAIndexer.from_transformers(layer.indexer)
    hidden, q_res, _, cap = run_transformers(layer, seq_len, seed=seq_len)
    pre = ix.compressed_keys(hidden)
    assert pre.shape == (seq_len // 4, 128)  # the incomplete tail block makes no entry in either
    assert torch.allclose(pre, cap["prenorm"][0], atol=1e-5, rtol=1e-5)
    # post RMSNorm + rope at 4j, without Hadamard (transformers has none)
    keys = ix.keys(hidden, hadamard=False)
    assert torch.allclose(keys, cap["keys"][0], atol=1e-4, rtol=1e-4)
    q = ix.queries(q_res, torch.arange(seq_len), hadamard=False)
    assert torch.allclose(q, cap["q"][0], atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------------
# Scores and top-k sets
# --------------------------------------------------------------------------------------------------


def assert_same_sets_up_to_ties(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor, eps: torch.Tensor):
    """Per row t: same number of valid entries; the sets may differ only in entries whose exact score is
    within eps[t] of the k-th selected exact score."""
    for t in range(exact.shape[0]):
        a = {j for j in ours[t].tolist() if j >= 0}
        b = {j for j in theirs[t].tolist() if j >= 0}
        assert len(a) == len(b), f"query {t}: {len(a)} vs {len(b)} valid entries"
        if a == b:
            continue
        kth = min(float(exact[t, j]) for j in b)
        for j in a ^ b:
            assert abs(float(exact[t, j]) - kth) <= float(eps[t]), \
                f"query {t}: entry {j} (score {float(exact[t, j])}) differs, k-th score {kth}, eps {float(eps[t])}"


@pytest.mark.parametrize("seq_len,seed", [(64, 1), (96, 2)])
def test_exact_scores_match_with_and_without_hadamard(layer, seq_len, seed):
    ix = DSAIndexer.from_transformers(layer.indexer)
    hidden, q_res, _, cap = run_transformers(layer, seq_len, seed)
    theirs = cap["scores"][0]  # [S, N], no causal mask applied yet
    visible = torch.isfinite(ix.scores(hidden, q_res, hadamard=False))
    scale = theirs.abs().amax(dim=1, keepdim=True)
    for hadamard in (False, True):
        ours = ix.scores(hidden, q_res, hadamard=hadamard)
        assert torch.equal(torch.isfinite(ours), visible)
        assert bool(((ours - theirs).abs() <= 1e-4 * scale)[visible].all()), f"hadamard={hadamard}"
    # causal rule: entry j visible to token t iff j < (t + 1) // 4
    t, j = torch.meshgrid(torch.arange(seq_len), torch.arange(seq_len // 4), indexing="ij")
    assert torch.equal(visible, j < (t + 1) // 4)


@pytest.mark.parametrize("seq_len,seed", [(64, 3), (96, 4), (66, 5)])
def test_topk_sets_match_transformers(layer, seq_len, seed):
    ix = DSAIndexer.from_transformers(layer.indexer)
    hidden, q_res, theirs, cap = run_transformers(layer, seq_len, seed)
    n = seq_len // 4
    assert theirs.shape == (seq_len, min(TOPK, n))
    exact = ix.scores(hidden, q_res, hadamard=False)  # fp32, equal to transformers' scores (test above)
    row_scale = torch.nan_to_num(exact, neginf=0.0).abs().amax(dim=1)

    # 1. dsakit's unquantized fp32 pipeline (with Hadamard, as dsakit runs it)
    ours_fp32 = select_topk(ix.scores(hidden, q_res), TOPK)
    assert_same_sets_up_to_ties(ours_fp32, theirs, exact, 1e-4 * row_scale)

    # 2. dsakit's cached path: keys stored as bf16 in a PagedCache, index_topk
    ours_bf16 = ix.topk(hidden, q_res, key_format="bf16", k=TOPK, backend="reference")
    assert ours_bf16.shape == (seq_len, TOPK) and ours_bf16.dtype == torch.int32
    # eps from the actual bf16 rounding of each stored key: |S_bf16 - S| <= sum_h |w_th| |q_th . (k_bf16 - k)|
    q = ix.queries(q_res, torch.arange(seq_len))
    w = ix.weights(hidden)
    keys = ix.keys(hidden)
    rounding = keys.bfloat16().float() - keys  # [N, D]
    score_error = (w.abs().unsqueeze(-1) * torch.einsum("thd,nd->thn", q, rounding).abs()).sum(dim=1)  # [S, N]
    eps = 2 * score_error.amax(dim=1) + 1e-4 * row_scale
    assert_same_sets_up_to_ties(ours_bf16, theirs, exact, eps)
    # padding: dsakit pads to K with -1 once the visible entries (t + 1) // 4 are used up
    valid = (ours_bf16 >= 0).sum(dim=1)
    assert torch.equal(valid, torch.clamp((torch.arange(seq_len) + 1) // 4, max=min(TOPK, n)))


# --------------------------------------------------------------------------------------------------
# Hadamard: why leaving it out (transformers) is harmless for exact scores and not for quantized ones
# --------------------------------------------------------------------------------------------------


def test_hadamard_changes_quantized_scores_only(layer):
    ix = DSAIndexer.from_transformers(layer.indexer)
    hidden, q_res, _, _ = run_transformers(layer, 128, seed=7)
    positions = torch.arange(128)
    w = ix.weights(hidden)
    exact = {}
    for hadamard in (False, True):
        q = ix.queries(q_res, positions, hadamard=hadamard)
        k = ix.keys(hidden, hadamard=hadamard)
        exact[hadamard] = index_scores_dense(q, w, k, positions, 4)
        # q . k = (q H) . (k H): H is orthogonal
    finite = torch.isfinite(exact[False])
    scale = exact[False][finite].abs().max()
    assert torch.allclose(exact[True][finite], exact[False][finite], atol=1e-4 * float(scale))

    # quantized keys: the rotation spreads each key's energy over all 128 dims before per-block scaling,
    # so the quantization error, and the scores, change
    fmt = KeyFormat.FP4
    quantized = {}
    for hadamard in (False, True):
        q = ix.queries(q_res, positions, hadamard=hadamard)
        k = ix.keys(hidden, hadamard=hadamard)
        quantized[hadamard] = index_scores_dense(q, w, fmt.dequantize(*fmt.quantize(k)), positions, 4)
    diff = (quantized[True] - quantized[False])[finite].abs().max()
    assert float(diff) > 1e-3 * float(scale), "fp4 scores should depend on the rotation"

    # rotating only one side scrambles the scores (docs/spec.md §5.2): far from the exact ones
    q_rot = ix.queries(q_res, positions, hadamard=True)
    k_plain = ix.keys(hidden, hadamard=False)
    one_sided = index_scores_dense(q_rot, w, k_plain, positions, 4)
    assert float((one_sided - exact[False])[finite].abs().max()) > 0.1 * float(scale)


def test_wrong_rope_layout_is_detected(layer):
    """docs/spec.md §5.1: the V3.2 half-split layout on a V4 model silently changes the selection; the conformance
    comparison must see it (it changes the sets of most queries of this layer, far beyond the tie epsilon)."""
    import dataclasses

    ix = DSAIndexer.from_transformers(layer.indexer)
    ix.preset = dataclasses.replace(
        ix.preset, key_transform=dataclasses.replace(ix.preset.key_transform, rope_layout=ROPE_V32))
    hidden, q_res, theirs, _ = run_transformers(layer, 96, seed=4)
    ours = ix.topk(hidden, q_res, key_format="bf16", k=TOPK, backend="reference")
    differing = sum(1 for t in range(96) if set(ours[t].tolist()) != set(theirs[t].tolist()))
    assert differing > 96 // 4


def test_config_without_rope_parameters_has_no_yarn():
    """A DeepseekV4Config built without rope_parameters gives the compress rope no YaRN at all; dsakit's V4
    preset always uses it, and from_transformers follows the module (docs/conventions.md row 5)."""
    indexer = modeling.DeepseekV4Indexer(tiny_config(rope_parameters=None))
    rope = rope_from_transformers(indexer.rotary_emb)
    assert rope.yarn is None and rope.theta == 160000.0 and rope.rope_dim == 64
    preset = get_preset("deepseek-v4-flash").rope
    slow = preset.inv_freq()[-1] / rope.inv_freq()[-1]
    assert float(slow) == pytest.approx(1 / 16)  # the slowest pairs differ by the YaRN factor


def test_quantized_key_formats_recall_against_transformers(layer):
    """What fp8 / fp4 storage and DeepSeek's fp4 simulation (keys and queries, round half to even) cost in
    agreement with transformers' unquantized top-k (docs/conventions.md row 2). Mean overlap of the top-8
    sets over the queries that see more than 8 entries; measured on this layer: bf16 0.993, fp8 0.972,
    fp4 0.900, fp4-rne keys + fp4-rne queries 0.872."""
    ix = DSAIndexer.from_transformers(layer.indexer)
    hidden, q_res, theirs, _ = run_transformers(layer, 512, seed=9)
    positions = torch.arange(512)
    w = ix.weights(hidden)
    rows = range(40, 512)

    def recall(key_format: str, query_format: str | None) -> float:
        fmt = KeyFormat.parse(key_format)
        keys = fmt.dequantize(*fmt.quantize(ix.keys(hidden)))
        q = ix.queries(q_res, positions, query_format=query_format)
        ours = select_topk(index_scores_dense(q, w, keys, positions, 4), TOPK)
        return sum(len(set(ours[t].tolist()) & set(theirs[t].tolist())) for t in rows) / (TOPK * len(rows))

    got = {name: recall(*name) for name in [("bf16", None), ("fp8", None), ("fp4", None), ("fp4-rne", "fp4-rne")]}
    assert got[("bf16", None)] >= 0.98
    assert got[("fp8", None)] >= 0.95
    assert got[("fp4", None)] >= 0.85
    assert got[("fp4-rne", "fp4-rne")] >= 0.8
    assert got[("bf16", None)] > got[("fp8", None)] > got[("fp4", None)] > got[("fp4-rne", "fp4-rne")]
