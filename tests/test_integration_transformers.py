"""dsakit.integrations.transformers.patch_deepseek_v4 on a tiny random DeepseekV4ForCausalLM saved locally (no
network): weights shared, logits and greedy generation against the unpatched model, fp8 keys reported.

The tiny model has 4 layers (window, csa, hca, csa; hca ratio 16 so a 300-token prompt makes entries), two
hyper-connection streams and two experts, both always routed (with more experts than the router picks, a
1e-3 change of a hidden state can switch an expert and turn a rounding difference into a large one; that is
the model, not the attention). Measured on this model with bf16 index keys and bf16 KV:

* index_topk 128 >= every entry count (selection = every visible entry on both sides): max |logit diff| /
  max |logit| = 8.1e-3 (bf16 storage of the main / compressed KV through four layers), argmax agreement
  99.3 %, greedy 32 tokens identical. Asserted: <= 4e-2, >= 97 %, identical.
* index_topk 16 (< the 75 entries of the CSA layers): rounding upstream moves index scores across near-ties
  (random models have crowded scores), so some queries select other entries. The test reports the logit
  differences with bf16 and fp8 keys (printed and in the JUnit properties) and asserts bf16's mean
  difference is below fp8's. Measured: bf16 max rel 0.112, mean |diff| 0.0093, argmax agreement 99.3 %;
  fp8 max rel 0.264, mean |diff| 0.0166, argmax agreement 97.7 %.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4",
                               reason="transformers with DeepSeek-V4 is a test-only dependency")
configuration = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

from dsakit.integrations.transformers import (PatchedDeepseekV4Attention, patch_deepseek_v4,  # noqa: E402
                                              unpatch_deepseek_v4)

from dsakit.formats import KeyFormat  # noqa: E402

from _helpers import randomize_v4_, tiny_v4_config  # noqa: E402


PROMPT, NEW_TOKENS, VOCAB = 300, 32, 128
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny random DeepseekV4ForCausalLM written with save_pretrained; tests load it with from_pretrained."""
    config = tiny_v4_config(
        vocab_size=VOCAB, num_hidden_layers=4, index_topk=128, n_routed_experts=2, num_experts_per_tok=2,
        o_groups=2, o_lora_rank=16, sliding_window=64, hc_mult=2,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
    torch.manual_seed(0)
    model = modeling.DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    randomize_v4_(model, gen)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):
                layer.mlp.gate.tid2eid.copy_(torch.randint(0, 2, layer.mlp.gate.tid2eid.shape, generator=gen))
    path = tmp_path_factory.mktemp("tiny-deepseek-v4")
    model.save_pretrained(path)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=gen)
    return path, prompt


def load(path, **config):
    model = modeling.DeepseekV4ForCausalLM.from_pretrained(path, **config).eval()
    assert model.config._attn_implementation in (None, "eager")
    return model


@pytest.fixture(scope="module")
def reference(saved_model):
    path, prompt = saved_model
    model = load(path)
    with torch.no_grad():
        logits = model(prompt).logits[0]
    generated = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    return model, logits, generated


def test_patch_shares_weights_and_keeps_names(saved_model, reference):
    original = reference[0]
    model = copy.deepcopy(original)
    before = {name: (p.data_ptr(), p) for name, p in model.named_parameters()}
    keys = set(model.state_dict())
    patch_deepseek_v4(model, index_key_format="bf16")
    assert all(isinstance(layer.self_attn, PatchedDeepseekV4Attention) for layer in model.model.layers)
    after = dict(model.named_parameters())
    assert set(after) == set(before) and set(model.state_dict()) == keys
    for name, (ptr, param) in before.items():
        assert after[name] is param and after[name].data_ptr() == ptr, name
    assert model.model.layers[1].self_attn.compressor.indexer.q_b_proj.weight.data_ptr() == \
        before["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"][0]
    patch_deepseek_v4(model)  # idempotent
    assert dict(model.named_parameters())["model.layers.0.self_attn.sinks"] is before["model.layers.0.self_attn.sinks"][1]
    unpatch_deepseek_v4(model)
    assert isinstance(model.model.layers[2].self_attn, modeling.DeepseekV4Attention)
    assert all(p is before[n][1] for n, p in model.named_parameters())


def test_logits_and_greedy_generation_match_with_bf16_keys(saved_model, reference):
    path, prompt = saved_model
    _, ref_logits, ref_generated = reference
    model = patch_deepseek_v4(load(path), index_key_format="bf16")
    with torch.no_grad():
        logits = model(prompt).logits[0]
    rel = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    agree = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    print(f"\nbf16 keys, top-k >= entries: max |logit diff| / max |logit| = {rel:.3g}, argmax agreement {agree:.3f}")
    assert rel <= 4e-2 and agree >= 0.97
    generated = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert generated.shape == (1, PROMPT + NEW_TOKENS)
    assert torch.equal(generated, ref_generated)


def test_fp8_keys_difference_is_reported(saved_model, reference, record_property):
    """index_topk 16 < entries: the selection depends on the key precision; report, do not hide."""
    path, prompt = saved_model
    ref_model = load(path, index_topk=16)
    with torch.no_grad():
        ref_logits = ref_model(prompt).logits[0]
    report = {}
    for fmt in ("bf16", "fp8"):
        model = patch_deepseek_v4(load(path, index_topk=16), index_key_format=fmt)
        with torch.no_grad():
            logits = model(prompt).logits[0]
        diff = (logits - ref_logits).abs()
        report[fmt] = {"max_rel": float(diff.max() / ref_logits.abs().max()),
                       "mean_abs": float(diff.mean()),
                       "argmax_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())}
    print("\nindex_topk 16, logits vs transformers:", json.dumps(report))
    record_property("index_key_format_logit_diff", json.dumps(report))
    assert report["bf16"]["mean_abs"] < report["fp8"]["mean_abs"]
    assert report["bf16"]["argmax_agreement"] >= 0.9


def test_patch_validates(saved_model):
    path, _ = saved_model
    with pytest.raises(ValueError, match="topk"):
        patch_deepseek_v4(load(path), topk=0)
    with pytest.raises(ValueError, match="not a transformers DeepseekV4"):
        patch_deepseek_v4(torch.nn.Linear(2, 2))


def test_bf16_model(saved_model):
    """A model cast with .to(torch.bfloat16) (rope buffers included) patches and generates; its logits stay
    close to transformers' own bf16 run (both round activations to bf16; measured max rel 2.7e-2)."""
    path, prompt = saved_model
    prompt = prompt[:, :96]
    reference = load(path).to(torch.bfloat16)
    with torch.no_grad():
        ref_logits = reference(prompt).logits[0].float()
    model = patch_deepseek_v4(load(path).to(torch.bfloat16), index_key_format="bf16")
    with torch.no_grad():
        logits = model(prompt).logits[0]
    assert logits.dtype == torch.bfloat16
    rel = float((logits.float() - ref_logits).abs().max() / ref_logits.abs().max())
    print(f"\nbf16 model: max |logit diff| / max |logit| = {rel:.3g}")
    assert rel <= 0.1, rel
    generated = model.generate(prompt, min_new_tokens=4, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 100)


# --------------------------------------------------------------------------------------------------
# Refused calls change nothing (issue 24 items 3 and 7)
# --------------------------------------------------------------------------------------------------


def cache_snapshot(cache) -> list:
    """Per layer: transformers' token count, and for a patched layer every dsakit pool's entry count, live
    entries and slot map and every compressor ring, per sequence."""
    out = []
    for layer in cache.layers:
        entry = [layer.get_seq_length()]
        state = getattr(layer, "_dsakit_layer_state", None)
        if state is not None:
            c = state.cache
            for seq in state.seqs:
                for name, pool in c.caches().items():
                    sid = c.id_in(name, seq)
                    slot_map = c.slot_map(name, seq) if name != "index" else None
                    entry += [pool.length(sid), pool.gather(sid).clone(), pool.num_pages, pool.free_pages,
                              None if slot_map is None else slot_map.clone()]
                for ring in c._states[seq].values():
                    entry += [ring.kv.clone(), ring.gate.clone(), ring.length]
        out.append(entry)
    return out


def assert_same_snapshot(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert len(x) == len(y), f"layer {i}"
        for u, v in zip(x, y):
            assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, f"layer {i}"


def test_failed_forward_leaves_every_layer_cache_as_it_was(saved_model, monkeypatch):
    """A failure inside layer 1 (after layer 0 and layer 1 stored the tokens) leaves every layer's caches,
    dsakit's and transformers' placeholders, as they were: no phantom tokens, and the next forward gives
    exactly the logits of a cache that never saw the failure. The same for a failure in the first forward."""
    from transformers import DynamicCache

    path, prompt = saved_model
    prompt, step = prompt[:, :40], prompt[:, 40:41]
    model = patch_deepseek_v4(load(path), index_key_format="bf16")

    def forward(ids, cache):
        with torch.no_grad():
            return model(ids, cache=cache, use_cache=True).logits

    clean = DynamicCache(config=model.config)
    want = [forward(prompt, clean), forward(step, clean)]
    block = model.model.layers[1].self_attn
    attend = block.attend

    def failing_attend(*args, **kwargs):
        raise RuntimeError("injected failure in layer 1")

    cache = DynamicCache(config=model.config)
    empty = cache_snapshot(cache)
    monkeypatch.setattr(block, "attend", failing_attend)
    with pytest.raises(RuntimeError, match="injected"):
        forward(prompt, cache)  # the first forward: the dsakit caches are made, then dropped again
    assert_same_snapshot(empty, cache_snapshot(cache))
    monkeypatch.setattr(block, "attend", attend)
    assert torch.equal(forward(prompt, cache), want[0])
    before = cache_snapshot(cache)
    assert before[0][0] == 40
    monkeypatch.setattr(block, "attend", failing_attend)
    with pytest.raises(RuntimeError, match="injected"):
        forward(step, cache)
    assert_same_snapshot(before, cache_snapshot(cache))
    monkeypatch.setattr(block, "attend", attend)
    assert torch.equal(forward(step, cache), want[1])


def test_patch_checks_every_layer_before_patching_any():
    """A CSA layer with compress rate 8 (dsakit needs 4) is refused with layer 0 left unpatched (before: layer
    0 was patched and the model still ran)."""
    config = tiny_v4_config(num_hidden_layers=2, layer_types=["sliding_attention", "compressed_sparse_attention"],
                            compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 16})
    model = modeling.DeepseekV4ForCausalLM(config).eval()
    blocks = [layer.self_attn for layer in model.model.layers]
    with pytest.raises(ValueError, match="compress rate must be 4"):
        patch_deepseek_v4(model)
    assert all(layer.self_attn is block for layer, block in zip(model.model.layers, blocks))
    assert "forward" not in vars(model.model)


def test_patch_refuses_a_model_that_is_not_deepseek_v4():
    """A Llama model is a ValueError naming what is missing (was AttributeError: no 'layer_type')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    attn = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="not a transformers DeepseekV4 model: layer 0: LlamaAttention"):
        patch_deepseek_v4(model)
    assert model.model.layers[0].self_attn is attn


def test_second_patch_with_other_arguments_repatches(saved_model):
    """patch again with the same arguments: nothing changes; with other ones (fp8 keys, top-k 8): every layer
    runs with them, exactly as a model patched with them once (was: silently ignored)."""
    path, prompt = saved_model
    prompt = prompt[:, :96]  # 24 entries per CSA layer: top-k 8 selects
    model = patch_deepseek_v4(load(path), index_key_format="bf16")
    params = dict(model.named_parameters())
    blocks = [layer.self_attn for layer in model.model.layers]
    patch_deepseek_v4(model, index_key_format="bf16")
    assert all(layer.self_attn is block for layer, block in zip(model.model.layers, blocks))
    patch_deepseek_v4(model, "fp8", topk=8)
    csa = model.model.layers[1].self_attn
    assert csa is not blocks[1] and csa.index_key_format == KeyFormat.FP8 and csa.index_topk == 8
    assert all(p is params[name] for name, p in model.named_parameters())
    once = patch_deepseek_v4(load(path), "fp8", topk=8)
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, once(prompt).logits)


def test_hierarchy_reaches_the_csa_blocks(saved_model):
    """patch_deepseek_v4(..., hierarchy=...): the CSA blocks select hierarchically (their caches keep page
    summaries), the others have no indexer and keep None; the logits equal the flat patch's (the exact mode at
    top-k 16; the 300-token prompt has 2 index pages, which m 1 + one recent page keep anyway: this checks the
    plumbing, tests/test_layers_hierarchy.py drops pages); a different hierarchy re-patches; a bad one is refused
    before any layer changes."""
    from dsakit.ops.indexer import HierarchyConfig

    path, prompt = saved_model
    rule = HierarchyConfig(pages=1, first_pages=0, recent_pages=1, exact=True)
    flat = patch_deepseek_v4(load(path, index_topk=16), "fp8")
    model = patch_deepseek_v4(load(path, index_topk=16), "fp8", hierarchy=rule)
    kinds = {layer.self_attn.layer_type: layer.self_attn.hierarchy for layer in model.model.layers}
    assert kinds == {"window": None, "csa": rule, "hca": None}
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, flat(prompt).logits)
    blocks = [layer.self_attn for layer in model.model.layers]
    patch_deepseek_v4(model, "fp8", hierarchy=rule)  # the same arguments: nothing changes
    assert all(layer.self_attn is block for layer, block in zip(model.model.layers, blocks))
    patch_deepseek_v4(model, "fp8", hierarchy=None)
    assert model.model.layers[1].self_attn is not blocks[1] and model.model.layers[1].self_attn.hierarchy is None
    with pytest.raises(ValueError, match="hierarchy must be a HierarchyConfig or None"):
        patch_deepseek_v4(model, "fp8", hierarchy=16)
    assert model.model.layers[1].self_attn.hierarchy is None


def test_unpatch_restores_the_exact_modules_of_a_bf16_model(saved_model):
    """Unpatching a bf16-cast model gives back its own attention modules: the rotary inv_freq buffers stay
    bf16 with their values (they were rebuilt in fp32: logits off by 8e-3 of the max), logits bitwise equal."""
    path, prompt = saved_model
    prompt = prompt[:, :48]
    model = load(path).to(torch.bfloat16)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with torch.no_grad():
        want = model(prompt).logits
        patch_deepseek_v4(model, index_key_format="bf16")
        model(prompt)
    unpatch_deepseek_v4(model)
    after = dict(model.named_buffers())
    assert after.keys() == buffers.keys()
    for name, b in buffers.items():
        assert after[name].dtype == b.dtype and torch.equal(after[name], b), name
    assert "forward" not in vars(model.model)
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, want)
