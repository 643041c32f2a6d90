"""dsakit.layers.V4Attention (CSA / HCA / window blocks on paged caches) against transformers'
DeepseekV4Attention on the CPU, plus the block's own rules (chunking, cache growth, format selection).

transformers runs the whole sequence at once in fp32 without a cache (its eager attention with the sliding
window mask and the compressor's block bias); dsakit prefills part of it and decodes the rest token by token
from its paged caches (bf16 main / compressed KV, bf16 index keys). With ``index_topk`` >= the number of
compressed entries the selection is every visible entry on both sides, so the outputs differ only by the bf16
storage of the KV: measured max |diff| / max |out| ~ 2e-3 for each layer type; asserted <= 1e-2.
"""

from __future__ import annotations

import pytest
import torch

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4",
                               reason="transformers with DeepSeek-V4 is a test-only dependency")
configuration = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

from dsakit.formats import KeyFormat  # noqa: E402
from dsakit.layers import INDEX_KEY_FORMAT_ENV, V4Attention, rope_from_transformers  # noqa: E402

from _helpers import randomize_v4_, tiny_v4_config  # noqa: E402


HIDDEN, Q_LORA, WINDOW, HCA_RATIO, SEQ = 64, 32, 32, 16, 200
TYPES = {"window": (0, "sliding_attention"), "csa": (1, "compressed_sparse_attention"),
         "hca": (2, "heavily_compressed_attention")}
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(topk: int):
    return tiny_v4_config(
        hidden_size=HIDDEN, num_hidden_layers=3, q_lora_rank=Q_LORA, index_topk=topk, n_routed_experts=2,
        o_groups=2, o_lora_rank=16, sliding_window=WINDOW, layer_types=[t for _, t in TYPES.values()],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": HCA_RATIO})


def transformers_block(layer_type: str, topk: int = 64):
    config = tiny_config(topk)
    block = modeling.DeepseekV4Attention(config, TYPES[layer_type][0]).eval()
    randomize_v4_(block, torch.Generator().manual_seed(TYPES[layer_type][0] + 10))
    return config, block


def transformers_output(config, block, x):
    s = x.shape[0]
    rotary = modeling.DeepseekV4RotaryEmbedding(config)
    pos = torch.arange(s)[None]
    pe = {k: rotary(x[None], pos, layer_type=k) for k in ("main", "compress")}
    i = torch.arange(s)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)
    mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        return block(x[None], position_embeddings=pe, position_ids=pos, attention_mask=mask, cache=None)[0][0]


def dsakit_block(layer_type: str, config, block, **kwargs):
    rope_type = "main" if layer_type == "window" else "compress"
    rope = rope_from_transformers(modeling.DeepseekV4RotaryEmbedding(config), rope_type)
    args = dict(num_heads=2, o_groups=2, o_lora_rank=16, index_heads=4, index_topk=config.index_topk,
                index_key_format="bf16", window=WINDOW, rope=rope, hca_ratio=HCA_RATIO)
    args.update(kwargs)
    ours = V4Attention(layer_type, HIDDEN, Q_LORA, **args)
    ours.load_state_dict(block.state_dict())  # same parameter names as transformers
    return ours


def hidden(seed: int = 0, s: int = SEQ):
    return torch.randn(s, HIDDEN, generator=torch.Generator().manual_seed(seed))


def run(ours, x, split: int, max_tokens: int = 256):
    cache = ours.new_cache(max_tokens)
    seq = cache.add_sequence()
    with torch.no_grad():
        out = [ours(x[:split], cache, seq)]
        out += [ours(x[t:t + 1], cache, seq) for t in range(split, x.shape[0])]
    return torch.cat(out), cache, seq


@pytest.mark.parametrize("layer_type", ["window", "csa", "hca"])
def test_block_matches_transformers_prefill_then_decode(layer_type):
    config, block = transformers_block(layer_type)
    x = hidden(1)
    theirs = transformers_output(config, block, x)
    layer = dsakit_block(layer_type, config, block)
    ours, cache, seq = run(layer, x, split=150)
    assert cache.length(seq) == SEQ
    if layer_type != "window":
        assert cache.extra.length(cache.id_in("extra", seq)) == SEQ // layer.ratio
    err = float((ours - theirs).abs().max() / theirs.abs().max())
    assert err <= 1e-2, f"{layer_type}: max |diff| / max |out| = {err:.3g}"


def test_csa_small_topk_follows_the_indexer_selection():
    """index_topk 8 < entries: each query attends to its window plus exactly the 8 entries transformers'
    indexer would pick, up to near-ties of the index scores (bf16 keys). Rows whose selection agrees match
    at the storage tolerance: measured 99 % of the rows with bf16 keys (88.5 % fp8, 60.5 % fp4); asserted
    >= 95 %."""
    config, block = transformers_block("csa", topk=8)
    x = hidden(2)
    theirs = transformers_output(config, block, x)
    ours, _, _ = run(dsakit_block("csa", config, block), x, split=SEQ)
    row_err = (ours - theirs).abs().amax(dim=1) / theirs.abs().max()
    close = row_err <= 1e-2
    assert bool(close[: 4 * 8 + 3].all())  # up to 8 visible entries: every one is selected on both sides
    assert float(close.float().mean()) >= 0.95


def test_chunked_prefill_and_cache_growth_change_nothing():
    config, block = transformers_block("csa", topk=8)
    x = hidden(3, 150)
    whole, _, _ = run(dsakit_block("csa", config, block), x, split=150, max_tokens=256)
    chunked_layer = dsakit_block("csa", config, block, query_chunk=17)
    cache = chunked_layer.new_cache(max_tokens=16)  # grows several times
    seq = cache.add_sequence()
    with torch.no_grad():
        parts = [chunked_layer(x[lo:hi], cache, seq) for lo, hi in ((0, 37), (37, 38), (38, 101), (101, 150))]
    assert cache.kv.num_pages > 1 and cache.length(seq) == 150
    assert torch.allclose(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


def test_batched_input_is_one_sequence_per_row():
    config, block = transformers_block("hca")
    ours = dsakit_block("hca", config, block)
    x = torch.stack([hidden(4, 40), hidden(5, 40)])
    cache = ours.new_cache(64, max_sequences=2)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    with torch.no_grad():
        both = ours(x, cache, seqs)
        single, _, _ = run(dsakit_block("hca", config, block), x[1], split=40)
    assert both.shape == (2, 40, HIDDEN)
    assert torch.allclose(both[1], single, atol=1e-6)


def test_index_key_format_argument_and_environment(monkeypatch):
    monkeypatch.delenv(INDEX_KEY_FORMAT_ENV, raising=False)
    args = dict(num_heads=2, o_groups=2, o_lora_rank=16, index_heads=4)
    assert V4Attention("csa", HIDDEN, Q_LORA, **args).index_key_format == KeyFormat.FP4  # the V4 preset's
    monkeypatch.setenv(INDEX_KEY_FORMAT_ENV, "fp8")
    assert V4Attention("csa", HIDDEN, Q_LORA, **args).index_key_format == KeyFormat.FP8
    assert V4Attention("csa", HIDDEN, Q_LORA, index_key_format="bf16", **args).index_key_format == KeyFormat.BF16
    layer = V4Attention("csa", HIDDEN, Q_LORA, index_topk=3, **args)
    assert layer.index_topk == 3 and layer.new_cache(64).index.fmt == KeyFormat.FP8
    monkeypatch.setenv(INDEX_KEY_FORMAT_ENV, "fp7")
    with pytest.raises(ValueError, match=INDEX_KEY_FORMAT_ENV):
        V4Attention("csa", HIDDEN, Q_LORA, **args)


def test_validation():
    args = dict(num_heads=2, o_groups=2, o_lora_rank=16, index_heads=4, index_key_format="bf16")
    with pytest.raises(ValueError, match="layer_type"):
        V4Attention("mla", HIDDEN, Q_LORA, **args)
    with pytest.raises(ValueError, match="index_topk"):
        V4Attention("csa", HIDDEN, Q_LORA, index_topk=0, **args)
    with pytest.raises(ValueError, match="o_groups"):
        V4Attention("csa", HIDDEN, Q_LORA, **{**args, "o_groups": 3})
    with pytest.raises(ValueError, match="hca_ratio"):
        V4Attention("hca", HIDDEN, Q_LORA, hca_ratio=4, **args)
    layer = V4Attention("hca", HIDDEN, Q_LORA, hca_ratio=16, **args)
    other = V4Attention("hca", HIDDEN, Q_LORA, hca_ratio=16, **args)
    cache = layer.new_cache(64)
    seq = cache.add_sequence()
    with pytest.raises(ValueError, match="hidden"):
        layer(torch.zeros(3, HIDDEN + 1), cache, seq)
    with pytest.raises(ValueError, match="unknown sequence"):
        layer(torch.zeros(3, HIDDEN), cache, seq + 1)
    with pytest.raises(ValueError, match="made for this layer"):
        other(torch.zeros(3, HIDDEN), cache, seq)
    second = cache.add_sequence()
    with pytest.raises(ValueError, match="unknown sequence"):  # the bad id of row 1 is caught before row 0 runs
        layer(torch.zeros(2, 3, HIDDEN), cache, [second, 99])
    with pytest.raises(ValueError, match="must differ"):
        layer(torch.zeros(2, 3, HIDDEN), cache, [second, second])
    assert cache.length(seq) == 0 and cache.length(second) == 0  # nothing was stored by the failed calls


def random_layer(layer_type: str, backend: str, device: str, **kwargs) -> V4Attention:
    """64 heads (the Triton attention kernel's head count), tiny everything else."""
    args = dict(num_heads=64, o_groups=8, o_lora_rank=16, index_heads=4, index_topk=8, index_key_format="fp8",
                hca_ratio=16, window=16, backend=backend)
    args.update(kwargs)
    with torch.device(device):
        layer = V4Attention(layer_type, HIDDEN, Q_LORA, **args)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return layer


def test_triton_kernels_through_the_layer(triton_backend, device):
    """The same layer on the Triton ops (store, top-k, sparse attention: prefill and split-decode kernels)
    and on the references: measured max |diff| / max |out| 8.9e-4 (bf16 operands in the kernels)."""
    x = hidden(6, 23).to(device)
    outs = {}
    for backend in ("reference", triton_backend):
        layer = random_layer("csa", backend, device)
        cache = layer.new_cache(64, device=device)
        seq = cache.add_sequence()
        with torch.no_grad():
            outs[backend] = torch.cat([layer(x[:21], cache, seq)] + [layer(x[t:t + 1], cache, seq) for t in (21, 22)])
    ref = outs["reference"].float().cpu()
    err = float((outs[triton_backend].float().cpu() - ref).abs().max() / ref.abs().max())
    assert err <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("layer_type", ["csa", "hca"])
def test_gpu_layer_matches_the_cpu_reference(layer_type):
    """On CUDA with bf16 weights and every op on its Triton kernel, against the fp32 CPU references; top-k
    covers every entry so no near-tie can change the selection."""
    x = hidden(7, 300)
    gpu = random_layer(layer_type, "auto", "cuda", index_topk=128, index_key_format="bf16", window=128)
    for module in gpu.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    cpu = random_layer(layer_type, "reference", "cpu", index_topk=128, index_key_format="bf16", window=128)
    cpu.load_state_dict(gpu.state_dict())  # the same (bf16-valued) weights, fp32 math
    outs = []
    for layer, dev in ((cpu, "cpu"), (gpu, "cuda")):
        cache = layer.new_cache(64, device=dev)
        seq = cache.add_sequence()
        with torch.no_grad():
            xs = x.to(dev)
            outs.append(torch.cat([layer(xs[:290], cache, seq)] + [layer(xs[t:t + 1], cache, seq)
                                                                   for t in range(290, 300)]).float().cpu())
    err = float((outs[1] - outs[0]).abs().max() / outs[0].abs().max())
    assert err <= 2e-2, err


@pytest.mark.parametrize("layer_type", ["csa", "hca"])
def test_slot_sets_follow_the_block_tables(layer_type):
    """The window / hca slot sets read from the cache's slot maps (views for a decode step, one gather for a
    prefill chunk) equal the slots the pools' block tables give, across pool growth and page boundaries."""
    layer = random_layer(layer_type, "reference", "cpu", num_heads=2, o_groups=2, query_chunk=23)
    cache = layer.new_cache(max_tokens=16)  # every pool and slot map grows several times
    other = cache.add_sequence()  # a second sequence interleaves its pages with the first one's
    seq = cache.add_sequence()
    x = hidden(11, 150)
    with torch.no_grad():
        for lo, hi in ((0, 61), (61, 62), (62, 130)) + tuple((t, t + 1) for t in range(130, 150)):
            layer(x[lo:hi], cache, seq)
            layer(x[lo:lo + 1], cache, other)
    kv = cache.kv.slots(cache.id_in("kv", seq))
    extra = cache.extra.slots(cache.id_in("extra", seq))
    w = layer.window
    for start, s in ((0, 5), (40, 30), (149, 1), (120, 30)):
        positions = torch.arange(start, start + s)
        want = torch.tensor([[int(kv[e]) if e >= 0 else -1 for e in range(p - w + 1, p + 1)]
                             for p in range(start, start + s)])
        assert torch.equal(layer.window_slots(cache, seq, positions, start=start).long(), want)
        assert torch.equal(layer.window_slots(cache, seq, positions).long(), want)
        n = extra.numel()
        want = torch.tensor([[int(extra[j]) if j < (p + 1) // layer.ratio else -1 for j in range(n)]
                             for p in range(start, start + s)])
        if layer_type == "hca":
            assert torch.equal(layer.hca_slots(cache, seq, positions, start=start).long(), want)
            assert torch.equal(layer.hca_slots(cache, seq, positions).long(), want)


def test_layer_stores_make_no_host_value_checks(triton_backend, device, monkeypatch):
    """The layer's stores go to the kernels without the public store ops' host-side slot / position checks
    (a device sync each on a GPU): the cache made the slots. The checks are replaced by a failure here."""
    import dsakit.ops.store.inputs as store_inputs

    def refuse(*args, **kwargs):
        raise AssertionError("host-side value check in the layer's store path")

    monkeypatch.setattr(store_inputs, "check_slots", refuse)
    monkeypatch.setattr(store_inputs, "check_rope_positions", refuse)
    layer = random_layer("csa", triton_backend, device)
    cache = layer.new_cache(16, device=device)
    seq = cache.add_sequence()
    x = hidden(6, 23).to(device)
    with torch.no_grad():
        out = torch.cat([layer(x[:21], cache, seq)] + [layer(x[t:t + 1], cache, seq) for t in (21, 22)])
    assert out.shape == (23, HIDDEN) and bool(torch.isfinite(out).all())
    assert cache.length(seq) == 23 and cache.extra.length(cache.id_in("extra", seq)) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("layer_type", ["csa", "hca"])
def test_gpu_decode_step_makes_no_device_sync(layer_type):
    """A decode step (store, compressor rings, top-k, slot sets, attention) reads nothing back from the
    device: 90 steps after a prefill run under torch.cuda.set_sync_debug_mode("error"), crossing page
    boundaries of the main pool. The warm-up steps compile the kernels and size the top-k workspace (its
    width, the next power of two of the entry count, stays 128 from 300 to 400 tokens)."""
    layer = random_layer(layer_type, "auto", "cuda", index_topk=32, window=128)
    cache = layer.new_cache(512, device="cuda")
    seq = cache.add_sequence()
    x = hidden(12, 400).cuda()
    with torch.no_grad():
        layer(x[:300], cache, seq)
        for t in range(300, 310):
            layer(x[t:t + 1], cache, seq)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(310, 400):
                layer(x[t:t + 1], cache, seq)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert cache.length(seq) == 400


# --------------------------------------------------------------------------------------------------
# A refused or failed call leaves the cache as it was (issue 24 item 3)
# --------------------------------------------------------------------------------------------------


def cache_state(cache, seq) -> dict:
    """Everything a later call can observe of one sequence: entry counts, live entries (dequantized), pool
    sizes and free pages, slot maps, compressor rings."""
    state = {"length": cache.length(seq)}
    for name, pool in cache.caches().items():
        sid = cache.id_in(name, seq)
        state[name] = (pool.num_pages, pool.free_pages, pool.length(sid), pool.slots(sid).tolist(),
                       pool.gather(sid).clone())
        slot_map = cache.slot_map(name, seq) if name != "index" else None
        state[f"{name} map"] = None if slot_map is None else slot_map.clone()
    for name in ("compressor", "indexer"):
        if name in cache._states[seq]:
            ring = cache.state(seq, name)
            state[f"{name} ring"] = (ring.kv.clone(), ring.gate.clone(), ring.length)
    return state


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            assert len(x) == len(y) and all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v
                                            for u, v in zip(x, y)), key
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        else:
            assert x == y, key


def test_refused_backend_stores_nothing(monkeypatch):
    """backend='triton' on CPU tensors without the interpreter is refused before the first store: the cache
    length stays 0 (it went 0 -> 3 before) and a later call gives the output of a fresh cache."""
    pytest.importorskip("triton")
    layer = random_layer("csa", "triton", "cpu")
    x = hidden(13, 3)
    cache = layer.new_cache(16)
    seq = cache.add_sequence()
    before = cache_state(cache, seq)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        with torch.no_grad():
            layer(x, cache, seq)
    assert_same_state(before, cache_state(cache, seq))
    assert cache.length(seq) == 0


def test_auto_backend_runs_head_counts_the_kernel_does_not_take(monkeypatch):
    """backend='auto' on a block whose head count the Triton attention kernel does not take (2 here, as the
    shipped tiny model) runs the reference attention instead of refusing the call (found on the H200: serving
    the tiny model on CUDA raised); an explicit 'triton' is still refused by name."""
    import dsakit.layers.attention as layer_module

    layer = random_layer("csa", "auto", "cpu", num_heads=2, o_groups=2)
    assert layer.attention_backend() == "reference"
    assert random_layer("csa", "auto", "cpu").attention_backend() == "auto"  # 64 heads: the kernel's
    assert random_layer("csa", "triton", "cpu", num_heads=2, o_groups=2).attention_backend() == "triton"
    real = layer_module.resolve_backend
    # as on CUDA: "auto" resolves to the Triton ops
    monkeypatch.setattr(layer_module, "resolve_backend",
                        lambda backend, *t: "triton" if backend == "auto" else real(backend, *t))
    x = hidden(15, 9)
    want_layer = random_layer("csa", "reference", "cpu", num_heads=2, o_groups=2)
    with torch.no_grad():
        cache, want_cache = layer.new_cache(16), want_layer.new_cache(16)
        got = layer(x, cache, cache.add_sequence())
        want = want_layer(x, want_cache, want_cache.add_sequence())
    assert torch.equal(got, want)


def test_failed_call_rolls_the_cache_back(monkeypatch):
    """A failure after the stores (here in the attention of the last chunk, after the pools and slot maps grew
    and the rings moved) puts the sequence back as it was, the other sequence untouched; the retry gives
    exactly the output of a run that never failed."""
    layer = random_layer("csa", "reference", "cpu", num_heads=2, o_groups=2, query_chunk=16)
    x = hidden(14, 120)
    clean = layer.new_cache(max_tokens=16)
    clean_seq = clean.add_sequence()
    cache = layer.new_cache(max_tokens=16)
    other = cache.add_sequence()
    seq = cache.add_sequence()
    with torch.no_grad():
        want = [layer(x[:50], clean, clean_seq), layer(x[50:], clean, clean_seq)]
        assert torch.equal(layer(x[:50], cache, seq), want[0])
        layer(x[:30], cache, other)
        before, before_other = cache_state(cache, seq), cache_state(cache, other)
        pages_before = {name: pool.num_pages for name, pool in cache.caches().items()}
        calls = []
        attend = layer.attend

        def failing_attend(*args, **kwargs):
            calls.append({name: pool.num_pages for name, pool in cache.caches().items()})
            if len(calls) == 4:  # the last query chunk of 70 tokens: everything is stored by then
                raise RuntimeError("injected failure")
            return attend(*args, **kwargs)

        monkeypatch.setattr(layer, "attend", failing_attend)
        with pytest.raises(RuntimeError, match="injected"):
            layer(x[50:], cache, seq)
        assert len(calls) == 4 and calls[-1] != pages_before  # the failed call grew pools
        monkeypatch.setattr(layer, "attend", attend)
        # the failed call grew pools; the rollback went back to the pools of before
        assert {name: pool.num_pages for name, pool in cache.caches().items()} == pages_before
        assert_same_state(before, cache_state(cache, seq))
        assert_same_state(before_other, cache_state(cache, other))
        assert torch.equal(layer(x[50:], cache, seq), want[1])


def test_config_object_and_construction_from_transformers():
    """V4Attention(config) with a frozen V4AttentionConfig is the block V4Attention(layer_type, ...) builds;
    V4Attention.from_transformers takes a transformers block's own parameters and runs as the block loaded
    from its state dict."""
    import dataclasses

    from dsakit.layers import V4AttentionConfig

    config, block = transformers_block("csa", topk=8)
    loaded = dsakit_block("csa", config, block)
    settings = loaded.layer_config
    assert isinstance(settings, V4AttentionConfig) and settings.index_topk == 8 and settings.ratio == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.window = 3
    with pytest.raises(ValueError, match="window"):
        settings.replace(window=0)
    with pytest.raises(ValueError, match="not both"):
        V4Attention(settings, HIDDEN)
    with pytest.raises(ValueError, match="unknown V4 attention settings"):
        V4Attention("csa", HIDDEN, Q_LORA, windw=3)
    assert V4Attention(settings).layer_config == settings
    assert V4Attention(layer_type="hca", hidden_size=HIDDEN, q_lora_rank=Q_LORA, num_heads=2, o_groups=2,
                       o_lora_rank=16, index_key_format="bf16").layer_type == "hca"
    shared = V4Attention.from_transformers(block, index_key_format="bf16")
    assert shared.q_a_proj.weight is block.q_a_proj.weight
    assert shared.compressor.indexer.q_b_proj.weight is block.compressor.indexer.q_b_proj.weight
    assert shared.layer_config == settings
    x = hidden(15, 40)
    assert torch.equal(run(shared, x, split=30)[0], run(loaded, x, split=30)[0])


def test_failed_batch_call_rolls_back_every_row(monkeypatch):
    """[B, S, hidden] with B sequences is one transaction: a failure in row 1 also undoes row 0's tokens."""
    layer = random_layer("hca", "reference", "cpu", num_heads=2, o_groups=2)
    cache = layer.new_cache(max_tokens=32, max_sequences=2)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    x = torch.stack([hidden(16, 20), hidden(17, 20)])
    with torch.no_grad():
        layer(x[:, :12], cache, seqs)
        before = [cache_state(cache, s) for s in seqs]
        output = layer.output
        calls = []

        def failing_output(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # row 1: row 0 is done and stored
                raise RuntimeError("injected failure")
            return output(*args, **kwargs)

        monkeypatch.setattr(layer, "output", failing_output)
        with pytest.raises(RuntimeError, match="injected"):
            layer(x[:, 12:], cache, seqs)
        for s, state in zip(seqs, before):
            assert_same_state(state, cache_state(cache, s))
