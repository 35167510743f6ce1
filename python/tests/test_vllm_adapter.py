"""dsa_decode.vllm: the stage installed on a vLLM MLA wrapper.

These tests build a wrapper with the attribute contract of vLLM 0.33's
glm5next classes (w = attention.mla_attn, mla = w.mla_attn, impl =
mla.impl, indexer = w.indexer, vLLM's names and layouts, which
test_vllm_real.py checks against vLLM's own classes where vLLM is
installed). The CPU tests need neither PyTorch nor a GPU: their tensors are
FakeTensor (a shape, strides, views, new_empty, slicing) and the stage is a
FakeStage passed as install's stage_factory. The GPU test builds glm5next
TP8 weights and caches in vLLM's layouts with PyTorch (the fused
wk_weights_proj, W_UV's strided view, 0-dim scales, the [blocks, pools, 132]
K cache, the tail ring by tail block) and checks that the installed forward
returns exactly what dsa_decode.Stage.forward gives on the same inputs.

A RoPE layer (DeepSeek-V3.2, GLM-5) has its own fakes with the attribute
contract of vLLM 0.33's DeepseekV2MLAAttention (both rotaries, the
fp8_ds_mla cache, the unpooled Indexer); its GPU counterpart is in
test_stage_rope_gpu.py."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import dsa_decode
from dsa_decode import vllm as adapter_module
from dsa_decode.ops import IndexerState
from dsa_decode.stage import WEIGHT_NAMES, StagePlan, StepArgs

# glm5next at TP8 (presets.h), written out so that the CPU tests need no extension call.
HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, V_HEAD = 4096, 8, 1536, 512, 256, 256
INDEX_HEADS, INDEX_DIM, BLOCK, POOL, RING = 32, 128, 256, 4, 4
TAIL_PREFIX = "model.layers.3.self_attn.indexer.tail_cache"
MAX_MODEL_LEN = 8192
SOFTMAX_SCALE = 256**-0.5
RMS_NORM_EPS = 1e-6
LAYER_NAME = "model.layers.3.self_attn.mla_attn.attn"


class FakeTensor:
    """What the adapter reads of a tensor without PyTorch: shape, stride(),
    row slices and views (recorded), contiguous(), new_empty (the output)."""

    def __init__(self, *shape, strides=None, name="", base=None):
        self.shape = tuple(shape)
        self._strides = tuple(strides) if strides is not None else contiguous_strides(self.shape)
        self.name = name
        self.base = base  # the tensor this one views, None for its own memory

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def new_empty(self, shape):
        return FakeTensor(*shape, name=f"new_empty of {self.name}")

    def __getitem__(self, index):
        assert isinstance(index, slice) and index.step is None
        start, stop = index.start or 0, self.shape[0] if index.stop is None else min(index.stop, self.shape[0])
        view = FakeTensor(
            stop - start, *self.shape[1:], strides=self._strides, name=f"{self.name}[{start}:{stop}]", base=self
        )
        view.sliced_from, view.rows = self, (start, stop)
        return view

    def view(self, *shape):
        size = 1
        for extent in self.shape:
            size *= extent
        resized = 1
        for extent in shape:
            resized *= extent
        assert resized == size, (shape, self.shape)
        return FakeTensor(*shape, name=f"{self.name}.view{shape}", base=self)

    def is_contiguous(self):
        return self._strides == contiguous_strides(self.shape)

    def contiguous(self):
        return self if self.is_contiguous() else FakeTensor(*self.shape, name=f"{self.name}.contiguous()")


def contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    return tuple(strides)


def fake_weights():
    """The layer's weights by WEIGHT_NAMES key, as FakeTensors of the shapes
    the stage takes (the adapter's reading of vLLM's holds them as
    vllm_tensors makes them)."""
    shapes = {
        "fused_qkv_a_proj": (Q_LORA + KV_LORA, HIDDEN),
        "q_a_norm": (Q_LORA,),
        "kv_a_norm": (KV_LORA,),
        "q_b_proj": (HEADS * NOPE, Q_LORA),
        "w_uk_t": (HEADS, NOPE, KV_LORA),
        "w_uv": (HEADS, KV_LORA, V_HEAD),
        "o_proj": (HIDDEN, HEADS * V_HEAD),
        "q_scale": (1,),
        "k_scale": (1,),
        "index_wq_b": (INDEX_HEADS * INDEX_DIM, Q_LORA),
        "index_wk": (INDEX_DIM, HIDDEN),
        "index_weights_proj": (INDEX_HEADS, HIDDEN),
        "index_compress_gate": (INDEX_DIM, HIDDEN),
        "index_k_norm_weight": (INDEX_DIM,),
        "index_k_norm_bias": (INDEX_DIM,),
        "index_ape": (POOL, INDEX_DIM),
    }
    return {name: FakeTensor(*shapes[name], name=name) for name in WEIGHT_NAMES}


def vllm_tensors(weights):
    """What vLLM holds where the stage's weights come from: the fused
    wk_weights_proj [128 + heads, D], W_UV as a strided view [H, L, V]
    strides ((P+V) L, 1, L), the scales 0-dim; the rest as they are."""
    held = dict(weights)
    held["wk_weights_proj"] = FakeTensor(INDEX_DIM + INDEX_HEADS, HIDDEN, name="wk_weights_proj")
    held["w_uv"] = FakeTensor(HEADS, KV_LORA, V_HEAD, strides=((NOPE + V_HEAD) * KV_LORA, 1, KV_LORA), name="W_UV")
    held["q_scale"] = FakeTensor(name="_q_scale")
    held["k_scale"] = FakeTensor(name="_k_scale")
    return held


class FakeBackend:
    def __init__(self, name):
        self.name = name

    def get_name(self):
        return self.name


class FakeMlaWrapper:
    """vLLM's MultiHeadLatentAttentionWrapper as far as the adapter reads it;
    its class forward is the stock forward, and records its calls."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)
        self.stock_calls = []

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        self.stock_calls.append((positions, hidden_states, llama_4_scaling))
        return ("stock", hidden_states)


def projection_attributes(weights, rms_norm_eps):
    """The wrapper's projections and norms (vLLM's attribute names) over a layer's weights."""
    return dict(
        fused_qkv_a_proj=SimpleNamespace(weight=weights["fused_qkv_a_proj"]),
        q_a_layernorm=SimpleNamespace(weight=weights["q_a_norm"], variance_epsilon=rms_norm_eps),
        kv_a_layernorm=SimpleNamespace(weight=weights["kv_a_norm"], variance_epsilon=rms_norm_eps),
        q_b_proj=SimpleNamespace(weight=weights["q_b_proj"]),
        o_proj=SimpleNamespace(
            weight=weights["o_proj"], bias=None, input_is_parallel=True, reduce_results=True, tp_size=1
        ),
    )


def fake_attention(
    weights,
    *,
    wrapper=None,
    attention=None,
    impl=None,
    indexer=None,
    config=None,
    rms_norm_eps=RMS_NORM_EPS,
    held=None,
):
    """vLLM's attention module of a glm5next DSA layer (attention.mla_attn =
    the wrapper) holding these weights as vLLM does (held: vllm_tensors);
    the keyword dicts override attributes of the wrapper, its MLAAttention,
    the backend impl, the indexer and the indexer's model config."""
    held = held if held is not None else vllm_tensors(weights)
    config_attributes = dict(
        index_n_heads=INDEX_HEADS,
        index_kpool=POOL,
        index_topk=2048,
        index_head_dim=INDEX_DIM,
        index_kpool_always_select_tail=True,
    )
    config_attributes.update(config or {})
    indexer_attributes = dict(
        config=SimpleNamespace(**config_attributes),
        vllm_config=SimpleNamespace(
            num_speculative_tokens=0, model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN)
        ),
        wq_b=SimpleNamespace(weight=held["index_wq_b"]),
        wk_weights_proj=SimpleNamespace(weight=held["wk_weights_proj"]),
        index_kpool_compress_gate=held["index_compress_gate"],
        k_norm=SimpleNamespace(weight=held["index_k_norm_weight"], bias=held["index_k_norm_bias"]),
        index_kpool_compress_ape=held["index_ape"],
        k_cache=SimpleNamespace(
            kv_cache=FakeTensor(4, BLOCK // POOL, 132, name="index_k_cache"),
            cache_config=SimpleNamespace(block_size=BLOCK),
        ),
        tail_cache=SimpleNamespace(kv_cache=FakeTensor(6, 2, RING, INDEX_DIM, name="tail"), prefix=TAIL_PREFIX),
    )
    indexer_attributes.update(indexer or {})
    impl_attributes = dict(dcp_world_size=1, index_group=SimpleNamespace(num_layers=1))
    impl_attributes.update(impl or {})
    mla_attributes = dict(
        impl=SimpleNamespace(**impl_attributes),
        attn_backend=FakeBackend("FLASHINFER_MLA_SPARSE_SM90"),
        layer_name=LAYER_NAME,
        scale=SOFTMAX_SCALE,
        kv_cache_dtype="fp8",
        q_pad_num_heads=None,
        use_pcp=False,
        hisparse_cache=None,
        W_UK_T=held["w_uk_t"],
        W_UV=held["w_uv"],
        _q_scale=held["q_scale"],
        _k_scale=held["k_scale"],
        kv_cache=FakeTensor(4, BLOCK, KV_LORA, name="kv_cache"),
    )
    mla_attributes.update(attention or {})
    wrapper_attributes = dict(
        mla_attn=SimpleNamespace(**mla_attributes),
        num_heads=HEADS,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=0,
        v_head_dim=V_HEAD,
        fuse_qkv_rmsnorm=True,
        rotary_emb=None,
        indexer=SimpleNamespace(**indexer_attributes),
        skip_topk=False,
        g_proj=None,
        dcp_q_replicate=False,
        **projection_attributes(held, rms_norm_eps),
    )
    wrapper_attributes.update(wrapper or {})
    return SimpleNamespace(mla_attn=FakeMlaWrapper(**wrapper_attributes))


class FakeStage:
    """A stage that needs no GPU: records its creation and steps, answers
    supports() as told, or by the library's rule (dsa_decode.supports) when
    told None."""

    def __init__(self, config, weights, plan, supported=True):
        self.config, self.weights, self.plan = config, weights, plan
        self.supported = supported
        self.supports_calls, self.forward_calls = [], []

    def supports(self, m, num_actual_tokens, num_decode_tokens):
        self.supports_calls.append((m, num_actual_tokens, num_decode_tokens))
        if self.supported is None:
            return dsa_decode.supports(m, num_actual_tokens, num_decode_tokens)
        return self.supported

    def forward(self, args):
        self.forward_calls.append(args)


def fake_step_inputs(m, *, actual=None, decode=None):
    return adapter_module.StepInputs(
        num_actual_tokens=m if actual is None else actual,
        num_decode_tokens=m if decode is None else decode,
        token_requests=FakeTensor(m, name="token_requests"),
        slot_mapping=FakeTensor(m, name="slot_mapping"),
        kv_cache=FakeTensor(4, BLOCK, KV_LORA, name="kv_cache"),
        indexer=IndexerState(FakeTensor(2, 2), FakeTensor(2, 2, 4, INDEX_DIM), FakeTensor(4, BLOCK // 4 * 132)),
    )


def install_fake(attention=None, *, supported=True, step_inputs=None, plan=None):
    """install() with a FakeStage; returns the adapter."""
    attention = attention if attention is not None else fake_attention(fake_weights())
    return adapter_module.install(
        attention,
        plan,
        step_inputs=step_inputs,
        stage_factory=lambda config, weights, plan: FakeStage(config, weights, plan, supported),
    )


def needs_message(error):
    message = str(error.value)
    assert message.startswith("DSA attention stage needs "), message
    return message


# --- reading the layer ---------------------------------------------------------------------------------------------


def test_read_layer_takes_vllm_attributes_and_weights_in_place():
    weights = fake_weights()
    held = vllm_tensors(weights)
    config, read, plan = adapter_module.read_layer(fake_attention(weights, held=held))
    assert config == dsa_decode.LayerConfig(
        hidden_size=HIDDEN,
        num_heads=HEADS,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=0,
        v_head_dim=V_HEAD,
        softmax_scale=SOFTMAX_SCALE,
        rms_norm_eps=RMS_NORM_EPS,
    )
    assert list(read) == list(WEIGHT_NAMES)
    for name in WEIGHT_NAMES:
        if name in ("index_wk", "index_weights_proj", "w_uv", "q_scale", "k_scale"):
            continue
        assert read[name] is weights[name], name  # the wrapper's own objects
    # Views of vLLM's tensors: the fused wk_weights_proj's rows, the scales' [1] views.
    fused = held["wk_weights_proj"]
    assert read["index_wk"].sliced_from is fused and read["index_wk"].rows == (0, INDEX_DIM)
    assert read["index_weights_proj"].sliced_from is fused
    assert read["index_weights_proj"].rows == (INDEX_DIM, INDEX_DIM + INDEX_HEADS)
    for name in ("q_scale", "k_scale"):
        assert read[name].base is held[name] and read[name].shape == (1,), name
    # W_UV: vLLM's strided view, copied once into a contiguous tensor.
    assert read["w_uv"].name == "W_UV.contiguous()" and read["w_uv"].is_contiguous()
    assert read["w_uv"].shape == (HEADS, KV_LORA, V_HEAD)
    # The plan: the layer's ring, block size and max_model_len.
    assert (plan.ring, plan.block_size, plan.max_context) == (RING, BLOCK, MAX_MODEL_LEN)


def test_a_contiguous_w_uv_is_taken_in_place():
    weights = fake_weights()
    held = vllm_tensors(weights)
    held["w_uv"] = weights["w_uv"]
    _, read, _ = adapter_module.read_layer(fake_attention(weights, held=held))
    assert read["w_uv"] is weights["w_uv"]


def test_the_ring_follows_the_tail_cache_or_vllms_rule():
    """The tail cache's ring where it is bound; before that, vLLM's rule:
    kpool * next_power_of_2(ceil((kpool + speculative tokens) / kpool))."""
    assert [adapter_module.vllm_tail_ring(4, s) for s in (0, 1, 4, 5, 12, 13)] == [4, 8, 8, 16, 16, 32]
    assert [adapter_module.vllm_tail_ring(16, s) for s in (0, 1, 16, 17)] == [16, 32, 32, 64]
    _, _, plan = adapter_module.read_layer(
        fake_attention(
            fake_weights(),
            indexer={"tail_cache": SimpleNamespace(kv_cache=FakeTensor(6, 2, 8, INDEX_DIM), prefix=TAIL_PREFIX)},
        )
    )
    assert plan.ring == 8
    unbound = SimpleNamespace(kv_cache=FakeTensor(0, name="torch.tensor([])"), prefix=TAIL_PREFIX)
    attention = fake_attention(fake_weights(), indexer={"tail_cache": unbound})
    attention.mla_attn.indexer.vllm_config.num_speculative_tokens = 3
    _, _, plan = adapter_module.read_layer(attention)
    assert plan.ring == 8


def test_the_block_size_follows_the_kv_cache_or_the_cache_config():
    # Before vLLM binds the caches (each an empty tensor): the cache config's.
    attention = fake_attention(fake_weights(), attention={"kv_cache": FakeTensor(0, name="torch.tensor([])")})
    attention.mla_attn.indexer.k_cache.kv_cache = FakeTensor(0, name="torch.tensor([])")
    attention.mla_attn.indexer.k_cache.cache_config.block_size = 512
    _, _, plan = adapter_module.read_layer(attention)
    assert plan.block_size == 512


def test_an_indexer_shape_the_library_does_not_run_is_named_with_the_librarys_words():
    if adapter_module.library_indexer_fields():
        # A library that takes the shape from its plan: 24 heads is none of its 16, 32, 64.
        config, ring, library_words = {"index_n_heads": 24}, RING, "indexer_heads"
    else:
        # One fixed shape (pools of 4): vLLM's ring 16 for pools of 16 is refused.
        config, ring, library_words = {"index_n_heads": 16, "index_kpool": 16}, 16, "argument 'plan.ring'"
    attention = fake_attention(
        fake_weights(),
        config=config,
        indexer={"tail_cache": SimpleNamespace(kv_cache=FakeTensor(6, 2, ring, INDEX_DIM), prefix=TAIL_PREFIX)},
    )
    stock_forward = attention.mla_attn.forward
    with pytest.raises(ValueError) as error:
        install_fake(attention)
    message = needs_message(error)
    shape = f"index_n_heads={config['index_n_heads']}, index_kpool={config.get('index_kpool', POOL)}"
    assert f"an indexer the installed dsa_decode runs (this layer: {shape}" in message, message
    assert f"tail ring {ring}" in message and library_words in message, message
    assert attention.mla_attn.forward == stock_forward


def test_the_library_publishes_where_it_takes_the_indexer_shape():
    fields = adapter_module.library_indexer_fields()
    plan_fields = {f.name for f in dataclasses.fields(StagePlan)}
    for part, (owner, name) in fields.items():
        assert owner in ("StagePlan", "LayerConfig") and part in ("heads", "pool", "topk")
        assert owner != "StagePlan" or name in plan_fields
    if fields:
        adapter = install_fake()
        for part, (owner, name) in fields.items():
            value = getattr(adapter.plan if owner == "StagePlan" else adapter.config, name)
            assert value == getattr(adapter.indexer_shape, part), (part, name)


def test_the_stages_argument_errors_come_with_the_layers_indexer_shape():
    """A library that runs one indexer shape names the indexer weights of
    another in its Stage checks: the adapter adds the layer's shape."""

    def refusing_factory(config, weights, plan):
        raise dsa_decode.InvalidArgument("invalid argument: argument 'index_wq_b': expected shape [4096, 1536]")

    attention = fake_attention(fake_weights(), config={"index_n_heads": 16})
    with pytest.raises(ValueError) as error:
        adapter_module.install(attention, stage_factory=refusing_factory)
    message = needs_message(error)
    assert "weights and a plan the installed dsa_decode takes (this layer: index_n_heads=16" in message, message
    assert message.endswith("argument 'index_wq_b': expected shape [4096, 1536]"), message
    assert "forward" not in vars(attention.mla_attn)


def test_an_indexer_page_of_another_block_is_refused():
    """The stage pages the indexer K cache with the KV cache's block table:
    a page must hold the pools of one KV block (block_size / kpool)."""
    pages = SimpleNamespace(kv_cache=FakeTensor(8, 32, 132), cache_config=SimpleNamespace(block_size=BLOCK))
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(fake_attention(fake_weights(), indexer={"k_cache": pages}))
    assert "an indexer page of the KV block's pools" in needs_message(error)
    assert "32 * 4 != 256" in str(error.value)


def test_a_given_plan_must_carry_the_layers_ring_and_block_size():
    with pytest.raises(ValueError) as error:
        install_fake(plan=StagePlan(ring=8, block_size=512))
    message = needs_message(error)
    assert (
        "plan.ring = 8 where the layer has 4" in message and "plan.block_size = 512 where the layer has 256" in message
    )


def test_the_indexer_config_fields_are_named_when_absent():
    attention = fake_attention(fake_weights())
    del attention.mla_attn.indexer.config.index_kpool
    attention.mla_attn.indexer.config.index_kpool_always_select_tail = None
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(attention)
    message = needs_message(error)
    assert "w.indexer.config.index_kpool" in message and "w.indexer.config.index_kpool_always_select_tail" in message


@pytest.mark.parametrize(
    "overrides, what",
    [
        ({"index_kpool_always_select_tail": False}, "an indexer that always selects the tail pool"),
        ({"index_head_dim": 64}, "index_head_dim 128 (the layer has 64)"),
    ],
)
def test_an_indexer_the_stage_cannot_be_is_refused(overrides, what):
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(fake_attention(fake_weights(), config=overrides))
    assert what in needs_message(error)


def test_read_layer_takes_an_fp8_e4m3_cache_dtype():
    config, _, _ = adapter_module.read_layer(fake_attention(fake_weights(), attention={"kv_cache_dtype": "fp8_e4m3"}))
    assert config.kv_cache_dtype == "fp8_e4m3"


FAILED_CHECKS = [
    # (which object, attribute overrides, what the seed says is needed, an attribute the message names)
    ("wrapper", {"fuse_qkv_rmsnorm": False}, "a fused q/kv a-norm", "fuse_qkv_rmsnorm"),
    ("wrapper", {"q_lora_rank": None}, "a fused q/kv a-norm", "q_lora_rank"),
    ("wrapper", {"rotary_emb": object()}, "NoPE", "rotary_emb"),
    ("wrapper", {"qk_rope_head_dim": 64}, "NoPE", "qk_rope_head_dim"),
    ("wrapper", {"indexer": None}, "its own indexer", "w.indexer"),
    ("wrapper", {"skip_topk": True}, "its own indexer", "skip_topk"),
    ("wrapper", {"g_proj": object()}, "no gate or DCP query", "g_proj"),
    ("wrapper", {"dcp_q_replicate": True}, "no gate or DCP query", "dcp_q_replicate"),
    ("attention", {"kv_cache_dtype": "auto"}, "an FP8 KV cache", "kv_cache_dtype"),
    ("attention", {"q_pad_num_heads": 16}, "no padding or PCP", "q_pad_num_heads"),
    ("attention", {"use_pcp": True}, "no padding or PCP", "use_pcp"),
    ("attention", {"hisparse_cache": object()}, "no HiSparse", "hisparse_cache"),
    ("impl", {"dcp_world_size": 2}, "no HiSparse", "dcp_world_size"),
    # Beyond the seed's: what vLLM 0.33's real classes need checked.
    ("attention", {"attn_backend": FakeBackend("FLASHMLA_SPARSE")}, "a flat FP8 KV cache backend", "attn_backend"),
    ("impl", {"index_group": SimpleNamespace(num_layers=2)}, "no other layer reading its selection", "index_group"),
    (
        "wrapper",
        {
            "o_proj": SimpleNamespace(
                weight=FakeTensor(HIDDEN, HEADS * V_HEAD), bias=FakeTensor(HIDDEN), input_is_parallel=True
            )
        },
        "an o_proj without bias on this rank's heads",
        "w.o_proj.bias",
    ),
]
SEED_REQUIREMENTS = sorted({what for _, _, what, _ in FAILED_CHECKS} | {"a column-major W_UK"})


@pytest.mark.parametrize("backend", ["FLASHINFER_MLA_SPARSE_SM90", "FLASHINFER_MLA_SPARSE"])
def test_the_hopper_and_the_seeds_backends_are_taken(backend):
    attention = fake_attention(fake_weights(), attention={"attn_backend": FakeBackend(backend)})
    assert adapter_module.read_layer(attention)[0].num_heads == HEADS
    assert backend in adapter_module.KV_CACHE_BACKENDS


def test_a_layer_without_an_index_group_is_taken():
    attention = fake_attention(fake_weights(), impl={"index_group": None})
    assert adapter_module.read_layer(attention)[0].num_heads == HEADS


@pytest.mark.parametrize("part, overrides, what, attribute", FAILED_CHECKS)
def test_each_failed_check_is_named_with_its_attributes(part, overrides, what, attribute):
    attention = fake_attention(fake_weights(), **{part: overrides})
    stock_forward = attention.mla_attn.forward
    with pytest.raises(ValueError) as error:
        install_fake(attention)
    message = needs_message(error)
    assert what in message and attribute in message, message
    assert [other for other in SEED_REQUIREMENTS if other in message] == [what], message
    assert attention.mla_attn.forward == stock_forward  # nothing installed


def test_a_row_major_w_uk_is_refused():
    weights = fake_weights()
    weights["w_uk_t"] = FakeTensor(HEADS, NOPE, KV_LORA, strides=(NOPE * KV_LORA, 1, NOPE), name="w_uk_t")
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(fake_attention(weights))
    assert needs_message(error) == "DSA attention stage needs a column-major W_UK (mla.W_UK_T.stride(-1) == 1)"


def test_several_failures_are_named_at_once_in_the_seeds_order():
    attention = fake_attention(
        fake_weights(),
        wrapper={"fuse_qkv_rmsnorm": False, "g_proj": object()},
        attention={"kv_cache_dtype": "auto"},
        impl={"dcp_world_size": 2},
    )
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(attention)
    message = needs_message(error)
    named = ["a fused q/kv a-norm", "no gate or DCP query", "an FP8 KV cache", "no HiSparse"]
    positions = [message.find(what) for what in named]
    assert all(p > 0 for p in positions) and positions == sorted(positions), message


def test_an_absent_check_attribute_is_named_not_raised():
    attention = fake_attention(fake_weights())
    del attention.mla_attn.g_proj
    del attention.mla_attn.mla_attn.impl.dcp_world_size
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(attention)
    message = needs_message(error)
    assert "no gate or DCP query" in message and "'g_proj'" in message, message
    assert "no HiSparse" in message and "'dcp_world_size'" in message, message


def test_absent_indexer_weights_are_named_by_their_path():
    attention = fake_attention(
        fake_weights(), indexer={"index_kpool_compress_gate": None, "wk_weights_proj": SimpleNamespace()}
    )
    attention.mla_attn.indexer.k_norm.bias = None  # a LayerNorm without bias
    del attention.mla_attn.indexer.index_kpool_compress_ape
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(attention)
    message = needs_message(error)
    for path, name in (
        ("index_kpool_compress_gate", "index_compress_gate"),
        ("k_norm.bias", "index_k_norm_bias"),
        ("index_kpool_compress_ape", "index_ape"),
        ("wk_weights_proj.weight rows [:128]", "index_wk"),
        ("wk_weights_proj.weight rows [128:]", "index_weights_proj"),
    ):
        assert f"w.indexer.{path} ({name})" in message, message
    assert "wq_b" not in message and "k_norm.weight" not in message, message


def test_the_indexer_table_covers_every_indexer_weight():
    assert sorted(adapter_module.INDEXER_WEIGHT_ATTRIBUTES) == sorted(n for n in WEIGHT_NAMES if n.startswith("index_"))
    assert sorted(adapter_module.WEIGHT_ATTRIBUTES) == sorted(n for n in WEIGHT_NAMES if not n.startswith("index_"))


def test_absent_vllm_weights_and_sizes_are_named():
    attention = fake_attention(fake_weights(), attention={"_k_scale": None})
    del attention.mla_attn.v_head_dim
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(attention)
    message = needs_message(error)
    assert "mla._k_scale (k_scale)" in message and "w.v_head_dim" in message, message


def test_a_module_without_the_mla_parts_is_refused():
    with pytest.raises(ValueError) as error:
        install_fake(SimpleNamespace(mla_attn=SimpleNamespace()))
    assert "mla_attn.mla_attn.impl" in needs_message(error)


# --- install and uninstall -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, invariant", [(None, False), ("0", False), ("1", True), ("2", True), ("yes", False)])
def test_install_without_a_plan_follows_vllms_batch_invariant_mode(monkeypatch, value, invariant):
    """No plan: the defaults (the fastest paths), with the stage's one
    batch-invariance switch on where vLLM runs batch invariant
    (VLLM_BATCH_INVARIANT, read as vLLM reads it)."""
    if value is None:
        monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", value)
    assert adapter_module.vllm_batch_invariant() is invariant
    adapter = install_fake()
    assert adapter.stage.plan == StagePlan(batch_invariant=invariant, max_context=MAX_MODEL_LEN)
    adapter.uninstall()
    # A plan given is taken as it is.
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    plan = StagePlan(max_context=4096)
    assert install_fake(plan=plan).stage.plan is plan


def test_install_creates_the_stage_and_swaps_the_forward():
    attention = fake_attention(fake_weights())
    wrapper = attention.mla_attn
    plan = StagePlan(max_context=4096)
    adapter = install_fake(attention, plan=plan)
    assert adapter.installed and wrapper.forward == adapter.forward
    assert adapter.stock == FakeMlaWrapper.forward.__get__(wrapper)
    assert (
        adapter.wrapper is wrapper and adapter.attention is wrapper.mla_attn and adapter.impl is wrapper.mla_attn.impl
    )
    assert adapter.stage.config == adapter.config and adapter.stage.weights is adapter.weights
    assert adapter.stage.plan is plan
    assert adapter.step_inputs is adapter_module.vllm_step_inputs

    adapter.uninstall()
    assert not adapter.installed and "forward" not in vars(wrapper)  # the class's forward shows through again
    assert wrapper.forward("p", "h") == ("stock", "h")
    adapter.uninstall()  # a second time: nothing to do
    again = install_fake(attention)
    assert again.installed


def test_uninstall_restores_a_forward_the_wrapper_held_itself():
    attention = fake_attention(fake_weights())
    own_forward = attention.mla_attn.forward  # an instance attribute now, as an earlier patch would leave it
    attention.mla_attn.forward = own_forward
    adapter = install_fake(attention)
    adapter.uninstall()
    assert vars(attention.mla_attn)["forward"] == own_forward


def test_install_twice_is_refused():
    attention = fake_attention(fake_weights())
    first = install_fake(attention)
    with pytest.raises(RuntimeError, match="already installed"):
        install_fake(attention)
    assert first.installed


def test_uninstall_under_a_later_forward_is_refused():
    attention = fake_attention(fake_weights())
    adapter = install_fake(attention)
    attention.mla_attn.forward = lambda positions, hidden_states, llama_4_scaling=None: "another"
    with pytest.raises(RuntimeError, match="replaced"):
        adapter.uninstall()


def test_a_stage_that_cannot_be_made_leaves_the_wrapper_alone():
    attention = fake_attention(fake_weights())
    stock_forward = attention.mla_attn.forward

    def refusing_factory(config, weights, plan):
        raise dsa_decode.Unsupported("the stage needs ...")

    with pytest.raises(dsa_decode.Unsupported):
        adapter_module.install(attention, stage_factory=refusing_factory)
    assert attention.mla_attn.forward == stock_forward and "forward" not in vars(attention.mla_attn)


# --- forward: stock or stage ---------------------------------------------------------------------------------------


def test_no_step_inputs_runs_stock():
    calls = []

    def no_inputs(adapter, positions, hidden_states):
        calls.append((adapter, positions, hidden_states))
        return None

    adapter = install_fake(step_inputs=no_inputs)
    positions, hidden = FakeTensor(3, name="positions"), FakeTensor(3, HIDDEN, name="hidden")
    assert adapter.wrapper.forward(positions, hidden) == ("stock", hidden)
    assert calls == [(adapter, positions, hidden)]
    assert adapter.wrapper.stock_calls == [(positions, hidden, None)]
    assert adapter.stage.forward_calls == [] and adapter.stage.supports_calls == []


def test_llama_4_scaling_runs_stock_without_asking_for_inputs():
    calls = []
    adapter = install_fake(step_inputs=lambda *args: calls.append(args) or fake_step_inputs(1))
    positions, hidden, scaling = FakeTensor(1), FakeTensor(1, HIDDEN), FakeTensor(1, 1)
    assert adapter.forward(positions, hidden, scaling) == ("stock", hidden)
    assert adapter.wrapper.stock_calls == [(positions, hidden, scaling)]
    assert calls == [] and adapter.stage.forward_calls == []


@pytest.mark.parametrize("m, actual, decode", [(4, 5, 5), (4, 4, 3), (17, 17, 17)])
def test_a_step_the_stage_does_not_support_runs_stock(m, actual, decode):
    # Counts the library's rule refuses: more tokens in the batch, a prefill
    # token among them, more than max_tokens.
    adapter = install_fake(supported=None, step_inputs=lambda *args: fake_step_inputs(m, actual=actual, decode=decode))
    positions, hidden = FakeTensor(m), FakeTensor(m, HIDDEN)
    assert adapter.forward(positions, hidden) == ("stock", hidden)
    assert adapter.stage.supports_calls == [(m, actual, decode)]
    assert adapter.stage.forward_calls == []


def test_a_supported_step_runs_the_stage_into_a_new_output():
    inputs = fake_step_inputs(2)
    inputs.error_count = FakeTensor(1, name="error_count")
    adapter = install_fake(step_inputs=lambda *args: inputs)
    positions, hidden = FakeTensor(2, name="positions"), FakeTensor(2, HIDDEN, name="hidden")
    out = adapter.wrapper.forward(positions, hidden)
    assert adapter.wrapper.stock_calls == []
    assert adapter.stage.supports_calls == [(2, 2, 2)]
    (args,) = adapter.stage.forward_calls
    assert isinstance(args, StepArgs)
    assert args.out is out and out.shape == (2, HIDDEN) and out.name == "new_empty of hidden"
    assert args.hidden is hidden and args.positions is positions  # positions as given
    assert args.token_requests is inputs.token_requests and args.slot_mapping is inputs.slot_mapping
    assert args.kv_cache is inputs.kv_cache and args.indexer is inputs.indexer
    assert args.topk_positions is None and args.error_count is inputs.error_count


def test_before_and_after_run_around_the_stage_only():
    order = []
    inputs = fake_step_inputs(2)
    inputs.before, inputs.after = (lambda: order.append("before")), (lambda: order.append("after"))
    adapter = install_fake(step_inputs=lambda *args: inputs)
    adapter.stage.forward = lambda args: order.append("stage")
    adapter.forward(FakeTensor(2), FakeTensor(2, HIDDEN))
    assert order == ["before", "stage", "after"]
    order.clear()
    adapter.stage.supported = False  # a stock step: neither runs
    adapter.forward(FakeTensor(2), FakeTensor(2, HIDDEN))
    assert order == []


def test_the_converted_ring_is_the_stages_when_step_inputs_leave_it_to_the_adapter():
    inputs = fake_step_inputs(1)
    inputs.indexer = IndexerState(inputs.indexer.block_table, None, inputs.indexer.k_cache)
    rows = FakeTensor(2, 2, RING, INDEX_DIM, name="ring rows")
    adapter = install_fake(step_inputs=lambda *args: inputs)
    inputs.before = lambda: setattr(adapter.tail_ring, "rows", rows)
    adapter.forward(FakeTensor(1), FakeTensor(1, HIDDEN))
    (args,) = adapter.stage.forward_calls
    assert args.indexer.ring is rows and args.indexer.block_table is inputs.indexer.block_table
    assert args.indexer.k_cache is inputs.indexer.k_cache


@pytest.mark.parametrize("tp, reduce_results, reduced", [(1, True, False), (2, False, False), (2, True, True)])
def test_the_output_is_reduced_as_vllms_o_proj_reduces(monkeypatch, tp, reduce_results, reduced):
    """RowParallelLinear.forward all-reduces its product when reduce_results
    and tp_size > 1: the stage's product on this rank's shard gets the same
    tensor_model_parallel_all_reduce."""
    fake_vllm(monkeypatch, lambda: None)
    calls = []
    sys.modules["vllm.distributed"].tensor_model_parallel_all_reduce = lambda t: calls.append(t) or ("reduced", t)
    weights = fake_weights()
    o_proj = SimpleNamespace(
        weight=weights["o_proj"], bias=None, input_is_parallel=True, reduce_results=reduce_results, tp_size=tp
    )
    adapter = install_fake(
        fake_attention(weights, wrapper={"o_proj": o_proj}), step_inputs=lambda *args: fake_step_inputs(1)
    )
    result = adapter.forward(FakeTensor(1), FakeTensor(1, HIDDEN))
    (args,) = adapter.stage.forward_calls
    if reduced:
        assert result == ("reduced", args.out) and calls == [args.out]
    else:
        assert result is args.out and calls == [] and adapter.reduce is None


# --- vllm_step_inputs: vLLM's forward context ----------------------------------------------------------------------


def fake_vllm(monkeypatch, get_forward_context):
    """Makes `from vllm.forward_context import get_forward_context` find this
    function (and gives vllm.distributed a tensor_model_parallel_all_reduce)."""
    package = types.ModuleType("vllm")
    package.__path__ = []
    forward_context = types.ModuleType("vllm.forward_context")
    forward_context.get_forward_context = get_forward_context
    distributed = types.ModuleType("vllm.distributed")
    distributed.tensor_model_parallel_all_reduce = lambda tensor: tensor
    package.forward_context, package.distributed = forward_context, distributed
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm.forward_context", forward_context)
    monkeypatch.setitem(sys.modules, "vllm.distributed", distributed)


def fake_context(m, **metadata_overrides):
    metadata = SimpleNamespace(
        num_actual_tokens=m,
        num_decode_tokens=m,
        block_table=FakeTensor(2, 2, name="block_table"),
        req_id_per_token=FakeTensor(64, name="req_id_per_token"),  # vLLM's persistent buffer, longer than m
        slot_mapping=FakeTensor(m, name="md.slot_mapping"),
    )
    metadata.__dict__.update(metadata_overrides)
    tail_metadata = SimpleNamespace(slot_mapping=FakeTensor(m, name="tail slots"))
    return SimpleNamespace(
        attn_metadata={LAYER_NAME: metadata, TAIL_PREFIX: tail_metadata},
        slot_mapping={LAYER_NAME: FakeTensor(m, name="context.slot_mapping")},
        virtual_engine=0,
    )


def test_vllm_step_inputs_reads_the_forward_context(monkeypatch):
    context = fake_context(3, num_actual_tokens=3, num_decode_tokens=2)
    fake_vllm(monkeypatch, lambda: context)
    adapter = install_fake()
    inputs = adapter_module.vllm_step_inputs(adapter, FakeTensor(3), FakeTensor(3, HIDDEN))
    metadata = context.attn_metadata[LAYER_NAME]
    indexer = adapter.wrapper.indexer
    assert (inputs.num_actual_tokens, inputs.num_decode_tokens) == (3, 2)
    assert inputs.token_requests.sliced_from is metadata.req_id_per_token and inputs.token_requests.shape == (3,)
    assert inputs.slot_mapping is context.slot_mapping[LAYER_NAME]
    assert inputs.kv_cache is adapter.attention.kv_cache
    assert inputs.indexer.block_table is metadata.block_table
    # The K cache's 2-D view; the ring left to the adapter's conversion (before/after).
    assert inputs.indexer.k_cache.base is indexer.k_cache.kv_cache
    assert inputs.indexer.k_cache.shape == (4, BLOCK // POOL * 132)
    assert inputs.indexer.ring is None and callable(inputs.before) and callable(inputs.after)
    assert inputs.topk_positions is None and inputs.error_count is None


def test_vllm_step_inputs_takes_the_virtual_engines_cache_and_the_metadatas_slots(monkeypatch):
    context = fake_context(1)
    del context.slot_mapping  # an engine whose context has none: md.slot_mapping
    context.virtual_engine = 1
    fake_vllm(monkeypatch, lambda: context)
    caches = [FakeTensor(4, BLOCK, KV_LORA), FakeTensor(4, BLOCK, KV_LORA)]
    adapter = install_fake(fake_attention(fake_weights(), attention={"kv_cache": caches}))
    inputs = adapter_module.vllm_step_inputs(adapter, FakeTensor(1), FakeTensor(1, HIDDEN))
    assert inputs.kv_cache is caches[1]
    assert inputs.slot_mapping is context.attn_metadata[LAYER_NAME].slot_mapping


class FakeTailRing:
    """adapter.tail_ring without PyTorch: records the conversion's calls
    (test_vllm_real.py runs the real one on vLLM's tail cache)."""

    def __init__(self, stage):
        self.stage, self.calls = stage, []
        self.rows = FakeTensor(2, 2, RING, INDEX_DIM, name="ring rows")

    def prepare(self, tail, requests):
        self.calls.append(("prepare", tail, requests, len(self.stage.forward_calls)))

    def gather(self, tail, token_requests, tail_slots, m):
        self.calls.append(("gather", tail, token_requests, tail_slots, m, len(self.stage.forward_calls)))

    def scatter(self, tail, m):
        self.calls.append(("scatter", tail, m, len(self.stage.forward_calls)))


def test_the_installed_forward_runs_the_stage_through_vllms_context(monkeypatch):
    context = fake_context(1)
    fake_vllm(monkeypatch, lambda: context)
    adapter = install_fake()
    ring = adapter.tail_ring = FakeTailRing(adapter.stage)
    out = adapter.wrapper.forward(FakeTensor(1), FakeTensor(1, HIDDEN))
    (args,) = adapter.stage.forward_calls
    assert args.out is out and args.indexer.ring is ring.rows
    tail = adapter.wrapper.indexer.tail_cache.kv_cache
    tail_slots = context.attn_metadata[TAIL_PREFIX].slot_mapping
    prepare, gather, scatter = ring.calls
    assert prepare == ("prepare", tail, 2, 0)  # the block table's rows, before the stage
    assert (
        gather[:2] == ("gather", tail) and gather[2].sliced_from is context.attn_metadata[LAYER_NAME].req_id_per_token
    )
    assert gather[3:] == (tail_slots, 1, 0)
    assert scatter == ("scatter", tail, 1, 1)  # after the stage


def no_forward_context():
    raise AssertionError("Forward context is not set. Please use `set_forward_context` to set the forward context.")


@pytest.mark.parametrize(
    "case",
    [
        "vllm not importable",
        "no forward context",
        "no metadata for the layer",
        "metadata None",
        "no tail",
        "no tail slots",
        "no table",
    ],
)
def test_vllm_step_inputs_answers_none_and_forward_runs_stock(monkeypatch, case):
    context = fake_context(1)
    attention = fake_attention(fake_weights())
    if case == "vllm not importable":
        monkeypatch.setitem(sys.modules, "vllm", None)  # import raises ImportError
        monkeypatch.setitem(sys.modules, "vllm.forward_context", None)
    else:
        fake_vllm(monkeypatch, no_forward_context if case == "no forward context" else lambda: context)
    if case == "no metadata for the layer":
        context.attn_metadata = {"model.layers.0.self_attn.mla_attn.attn": context.attn_metadata[LAYER_NAME]}
    elif case == "metadata None":  # profile and dummy runs
        context.attn_metadata = None
    elif case == "no tail":
        del attention.mla_attn.indexer.tail_cache.kv_cache
    elif case == "no tail slots":
        del context.attn_metadata[TAIL_PREFIX]
    elif case == "no table":
        del context.attn_metadata[LAYER_NAME].block_table
    adapter = install_fake(attention)
    positions, hidden = FakeTensor(1), FakeTensor(1, HIDDEN)
    if case in ("no tail", "no tail slots", "no table"):  # maybe a wrong name in the tables: said once per layer
        missing = {"no tail": "tail", "no tail slots": "tail_slots", "no table": "block_table"}[case]
        with pytest.warns(RuntimeWarning, match=f"no {missing} found.*run the stock forward"):
            assert adapter_module.vllm_step_inputs(adapter, positions, hidden) is None
    else:
        assert adapter_module.vllm_step_inputs(adapter, positions, hidden) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a second time
        assert adapter.forward(positions, hidden) == ("stock", hidden)
    assert adapter.stage.forward_calls == []


# --- a RoPE layer (DeepSeek-V3.2, GLM-5): vLLM's DeepseekV2MLAAttention's contract -------------------------------------

# dsv32 at TP8 (presets.h): D 7168, 16 heads, Q 1536, L 512, P 128, R 64, V 128, the indexer's 64 heads.
R_HIDDEN, R_HEADS, R_Q, R_P, R_R, R_V, R_INDEX_HEADS, R_BLOCK = 7168, 16, 1536, 128, 64, 128, 64, 64
R_SOFTMAX_SCALE = 0.1352337788608801  # vLLM's mla.scale: 192^-0.5 x yarn_get_mscale(40, 1.0)^2


class DeepseekScalingRotaryEmbedding:
    """vLLM's YaRN rotary's attributes (rotary_embedding/deepseek_scaling_rope.py),
    its cos_sin_cache the library's table (NumPy) unless given."""

    def __init__(self, is_neox_style, *, cache=None, **overrides):
        self.head_size = self.rotary_dim = 64
        self.base, self.scaling_factor, self.beta_fast, self.beta_slow = 10000.0, 40.0, 32, 1
        self.mscale = 1.0  # yarn_get_mscale(40, 1.0) / yarn_get_mscale(40, 1.0)
        self.max_position_embeddings = 4096  # get_rope's deepseek_yarn branch: the original positions
        self.is_neox_style = is_neox_style
        self.__dict__.update(overrides)
        style = "half-split" if is_neox_style else "interleaved"
        self.cos_sin_cache = cache if cache is not None else dsv32_table()
        assert dsa_decode.rope_preset_config("dsv32", "indexer" if is_neox_style else "attention").style == style


@functools.lru_cache(maxsize=None)
def dsv32_table():
    """The dsv32 rotaries' table (both targets have the same frequencies), 163840 rows as vLLM's; read-only."""
    table = dsa_decode.rope_cos_sin_table(dsa_decode.rope_preset_config("dsv32"), 0, 163840)
    table.flags.writeable = False
    return table


class RotaryEmbedding:
    """vLLM's plain rotary (rope_type "default"): GLM-5's."""

    def __init__(self, is_neox_style=False, rows=8192):
        self.head_size = self.rotary_dim = 64
        self.base, self.max_position_embeddings, self.is_neox_style = 1e6, rows, is_neox_style
        self.cos_sin_cache = dsa_decode.rope_cos_sin_table(
            dsa_decode.RopeConfig(rope_dim=64, theta=1e6, max_position=rows), 0, rows
        )


def fake_rope_weights():
    shapes = {
        "fused_qkv_a_proj": (R_Q + KV_LORA + R_R, R_HIDDEN),
        "q_a_norm": (R_Q,),
        "kv_a_norm": (KV_LORA,),
        "q_b_proj": (R_HEADS * (R_P + R_R), R_Q),
        "w_uk_t": (R_HEADS, R_P, KV_LORA),
        "w_uv": (R_HEADS, KV_LORA, R_V),
        "o_proj": (R_HIDDEN, R_HEADS * R_V),
        "index_wq_b": (R_INDEX_HEADS * INDEX_DIM, R_Q),
        "index_wk": (INDEX_DIM, R_HIDDEN),
        "index_weights_proj": (R_INDEX_HEADS, R_HIDDEN),
        "index_k_norm_weight": (INDEX_DIM,),
        "index_k_norm_bias": (INDEX_DIM,),
    }
    return {name: FakeTensor(*shape, name=name) for name, shape in shapes.items()}


def fake_rope_attention(*, wrapper=None, attention=None, indexer=None, config=None, rms_norm_eps=RMS_NORM_EPS):
    """vLLM's DeepseekV2MLAAttention of a DeepSeek-V3.2 layer on one of 8
    ranks (attention.mla_attn = the wrapper): fuse_qkv_rmsnorm False (vLLM
    norms q_c and kv_c apart), both rotaries, the fp8_ds_mla cache of
    FLASHMLA_SPARSE, DeepSeek-V3.2's Indexer (no pool gate, ape or tail ring)."""
    weights = fake_rope_weights()
    config_attributes = dict(
        index_n_heads=R_INDEX_HEADS,
        index_topk=2048,
        index_head_dim=INDEX_DIM,
        rope_parameters=dict(rope_type="deepseek_yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0),
    )
    config_attributes.update(config or {})
    indexer_attributes = dict(
        config=SimpleNamespace(**config_attributes),
        vllm_config=SimpleNamespace(num_speculative_tokens=0, model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN)),
        wq_b=SimpleNamespace(weight=weights["index_wq_b"]),
        wk_weights_proj=SimpleNamespace(weight=FakeTensor(INDEX_DIM + R_INDEX_HEADS, R_HIDDEN, name="wk_weights_proj")),
        k_norm=SimpleNamespace(weight=weights["index_k_norm_weight"], bias=weights["index_k_norm_bias"]),
        k_cache=SimpleNamespace(
            kv_cache=FakeTensor(5, R_BLOCK, 132, name="index_k_cache"), cache_config=SimpleNamespace(block_size=R_BLOCK)
        ),
    )
    indexer_attributes.update(indexer or {})
    mla_attributes = dict(
        impl=SimpleNamespace(dcp_world_size=1, index_group=SimpleNamespace(num_layers=1)),
        attn_backend=FakeBackend("FLASHMLA_SPARSE"),
        layer_name=LAYER_NAME,
        scale=R_SOFTMAX_SCALE,
        kv_cache_dtype="fp8_ds_mla",
        q_pad_num_heads=None,
        use_pcp=False,
        hisparse_cache=None,
        W_UK_T=weights["w_uk_t"],
        W_UV=FakeTensor(R_HEADS, KV_LORA, R_V, strides=((R_P + R_V) * KV_LORA, 1, KV_LORA), name="W_UV"),
        _q_scale=FakeTensor(name="_q_scale"),
        _k_scale=FakeTensor(name="_k_scale"),
        kv_cache=FakeTensor(5, R_BLOCK, 656, name="kv_cache"),
    )
    mla_attributes.update(attention or {})
    wrapper_attributes = dict(
        mla_attn=SimpleNamespace(**mla_attributes),
        num_heads=R_HEADS,
        q_lora_rank=R_Q,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=R_P,
        qk_rope_head_dim=R_R,
        v_head_dim=R_V,
        fuse_qkv_rmsnorm=False,
        rotary_emb=DeepseekScalingRotaryEmbedding(False),
        indexer_rope_emb=DeepseekScalingRotaryEmbedding(True),
        indexer=SimpleNamespace(**indexer_attributes),
        skip_topk=False,
        g_proj=None,
        dcp_q_replicate=False,
        **projection_attributes(weights, rms_norm_eps),
    )
    wrapper_attributes.update(wrapper or {})
    attention_module = SimpleNamespace(mla_attn=FakeMlaWrapper(**wrapper_attributes))
    attention_module.weights = weights
    return attention_module


def install_rope_fake(attention=None, *, indexer_keys="hadamard", step_inputs=None, supported=True):
    attention = attention if attention is not None else fake_rope_attention()
    return adapter_module.install(
        attention,
        step_inputs=step_inputs,
        stage_factory=lambda config, weights, plan: FakeStage(config, weights, plan, supported),
        indexer_keys=indexer_keys,
    )


def test_a_rope_layer_is_read_with_its_rotaries_and_the_unpooled_plan():
    attention = fake_rope_attention()
    config, weights, plan = adapter_module.read_layer(attention, indexer_keys="hadamard")
    w = attention.mla_attn
    assert config == dsa_decode.layer_config("dsv32", tp=8, rms_norm_eps=RMS_NORM_EPS).__class__(
        **{**dataclasses.asdict(dsa_decode.layer_config("dsv32", tp=8, rms_norm_eps=RMS_NORM_EPS)),
           "softmax_scale": R_SOFTMAX_SCALE, "rms_norm_eps": RMS_NORM_EPS}
    )
    assert config.rope == dsa_decode.rope_preset_config("dsv32", "attention")
    assert config.indexer_rope == dsa_decode.rope_preset_config("dsv32", "indexer")
    assert config.fuse_qkv_rmsnorm and config.kv_cache_dtype == "fp8_ds_mla"
    assert sorted(weights) == sorted(set(WEIGHT_NAMES) - set(adapter_module.ROPE_UNREAD_WEIGHTS))
    assert weights["fused_qkv_a_proj"] is attention.weights["fused_qkv_a_proj"]
    fused = w.indexer.wk_weights_proj.weight
    assert weights["index_wk"].sliced_from is fused and weights["index_wk"].rows == (0, INDEX_DIM)
    assert weights["index_weights_proj"].rows == (INDEX_DIM, INDEX_DIM + R_INDEX_HEADS)
    assert weights["w_uv"].name == "W_UV.contiguous()"
    assert (plan.indexer_heads, plan.indexer_pool, plan.indexer_topk, plan.ring) == (R_INDEX_HEADS, 1, 2048, 1)
    assert (plan.block_size, plan.max_context) == (R_BLOCK, MAX_MODEL_LEN)


def test_glm5s_plain_rotary_and_interleaved_indexer_are_read():
    attention = fake_rope_attention(
        wrapper={"rotary_emb": RotaryEmbedding(False), "indexer_rope_emb": RotaryEmbedding(False)},
        config={"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    )
    config, _, _ = adapter_module.read_layer(attention, indexer_keys="hadamard")
    want = dsa_decode.RopeConfig(rope_dim=64, theta=1e6, original_max_position=8192, max_position=8192)
    assert config.rope == want and config.indexer_rope == want  # both interleaved, as GLM-5's


def test_yarns_magnitude_terms_come_from_the_config_or_from_the_rotarys_factor():
    rotary = DeepseekScalingRotaryEmbedding(False)
    given = SimpleNamespace(rope_scaling=dict(mscale=1.0, mscale_all_dim=1.0))
    config, problems = adapter_module.rope_config_of(rotary, "w.rotary_emb", given)
    assert problems == [] and (config.mscale, config.mscale_all_dim) == (1.0, 1.0)
    # Without the config: a pair giving the same cos/sin factor (1: no magnitude term).
    config, problems = adapter_module.rope_config_of(rotary, "w.rotary_emb")
    assert problems == [] and config.table_scale == pytest.approx(1.0) and config.mscale_all_dim == 0.0
    # A config whose terms give another factor is not taken.
    other = SimpleNamespace(rope_parameters=dict(mscale=0.5, mscale_all_dim=1.0))
    config, problems = adapter_module.rope_config_of(rotary, "w.rotary_emb", other)
    assert problems == [] and (config.mscale, config.mscale_all_dim) != (0.5, 1.0)


@pytest.mark.parametrize(
    "rotary, named",
    [
        (SimpleNamespace(), "a rotary the stage computes (w.rotary_emb: DeepseekScalingRotaryEmbedding or "
                            "RotaryEmbedding, got SimpleNamespace)"),
        (DeepseekScalingRotaryEmbedding(False, head_size=128), "a rotary of every rope dim (w.rotary_emb.rotary_dim "
                                                                "== head_size: 64 != 128)"),
        (DeepseekScalingRotaryEmbedding(False, cache=np.zeros((16, 32), np.float32)), "a cos/sin table [positions, 64]"),
        (DeepseekScalingRotaryEmbedding(False, base=20000.0), "a rotary whose table the stage rebuilds "
                                                              "(w.rotary_emb.cos_sin_cache"),
        (DeepseekScalingRotaryEmbedding(False, scaling_factor=0.5), "a rotary the library's RopeConfig takes "
                                                                    "(w.rotary_emb: invalid argument: argument 'factor'"),
        (DeepseekScalingRotaryEmbedding(False, beta_fast=None), "the rotary's w.rotary_emb.beta_fast"),
    ],
)
def test_a_rotary_the_stage_cannot_take_is_named(rotary, named):
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(fake_rope_attention(wrapper={"rotary_emb": rotary}), indexer_keys="hadamard")
    assert named in needs_message(error)


ROPE_FAILED_CHECKS = [
    ("wrapper", {"indexer_rope_emb": None}, "64 RoPE dims with the indexer's rotary", "indexer_rope_emb"),
    ("wrapper", {"qk_rope_head_dim": 32}, "64 RoPE dims with the indexer's rotary", "qk_rope_head_dim"),
    ("wrapper", {"q_lora_rank": None}, "a q a-norm and a kv a-norm of one eps", "q_lora_rank"),
    ("attention", {"kv_cache_dtype": "fp8"}, "an FP8 KV cache of DeepSeek-V3.2's 656-byte entries", "fp8_ds_mla"),
    ("attention", {"attn_backend": FakeBackend("FLASHINFER_MLA_SPARSE_SM90")}, "a backend of the 656-byte FP8 cache",
     "FLASHMLA_SPARSE"),
    ("indexer", {"k_cache": SimpleNamespace(kv_cache=FakeTensor(5, R_BLOCK // 4, 132))},
     "an indexer page of a key per token of the KV block", "(16, 132) with block_size 64"),
]


@pytest.mark.parametrize("part, overrides, what, detail", ROPE_FAILED_CHECKS)
def test_each_failed_rope_check_is_named(part, overrides, what, detail):
    attention = fake_rope_attention(**{part: overrides})
    stock = attention.mla_attn.forward
    with pytest.raises(ValueError) as error:
        install_rope_fake(attention)
    message = needs_message(error)
    assert what in message and detail in message, message
    assert attention.mla_attn.forward == stock


def test_unequal_norm_epsilons_and_the_nope_checks_do_not_apply():
    attention = fake_rope_attention()
    attention.mla_attn.kv_a_layernorm.variance_epsilon = 1e-5
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(attention, indexer_keys="hadamard")
    message = needs_message(error)
    assert message == (
        "DSA attention stage needs a q a-norm and a kv a-norm of one eps (w.q_lora_rank is not None and "
        "w.q_a_layernorm.variance_epsilon == w.kv_a_layernorm.variance_epsilon)"
    ), message
    # fuse_qkv_rmsnorm False, FLASHMLA_SPARSE, fp8_ds_mla, no gate, ape or ring: none of the NoPE checks is named.
    adapter_module.read_layer(fake_rope_attention(), indexer_keys="hadamard")


def test_a_rope_layer_needs_the_indexer_keys_basis_named():
    attention = fake_rope_attention()
    for keys in (None, "vllm"):
        with pytest.raises(ValueError) as error:
            install_rope_fake(attention, indexer_keys=keys)
        message = needs_message(error)
        assert "the indexer's keys in the stage's basis" in message and f"indexer_keys={keys!r}" in message, message
    assert adapter_module.ROPE_INDEXER_KEYS == ("hadamard",)
    # Not asked of a NoPE layer.
    install_fake().uninstall()


def test_every_rope_problem_is_named_at_once():
    attention = fake_rope_attention(
        wrapper={"rotary_emb": SimpleNamespace()}, attention={"kv_cache_dtype": "auto", "_k_scale": None},
        config={"index_topk": None},
    )
    del attention.mla_attn.indexer.k_norm.bias
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(attention)
    message = needs_message(error)
    for part in ("656-byte entries", "got SimpleNamespace", "w.indexer.config.index_topk",
                 "k_norm.bias (index_k_norm_bias)", "indexer_keys=None"):
        assert part in message, (part, message)
    assert "_k_scale" not in message, message  # not read at a RoPE layer


def test_the_rope_step_reaches_the_stage_without_a_ring(monkeypatch):
    context = SimpleNamespace(
        attn_metadata={
            LAYER_NAME: SimpleNamespace(
                num_actual_tokens=2, num_decode_tokens=2, block_table=FakeTensor(2, 4, name="block_table"),
                req_id_per_token=FakeTensor(64, name="req_id_per_token"), slot_mapping=FakeTensor(2),
            )
        },
        slot_mapping={LAYER_NAME: FakeTensor(2, name="context.slot_mapping")},
        virtual_engine=0,
    )
    fake_vllm(monkeypatch, lambda: context)
    attention = fake_rope_attention()
    adapter = install_rope_fake(attention)
    assert adapter.rope
    inputs = adapter_module.vllm_step_inputs(adapter, FakeTensor(2), FakeTensor(2, R_HIDDEN))
    indexer = attention.mla_attn.indexer
    assert inputs.before is None and inputs.after is None and inputs.indexer.ring is None
    assert inputs.indexer.k_cache.base is indexer.k_cache.kv_cache and inputs.indexer.k_cache.shape == (5, R_BLOCK * 132)
    assert inputs.kv_cache is attention.mla_attn.mla_attn.kv_cache
    out = attention.mla_attn.forward(FakeTensor(2), FakeTensor(2, R_HIDDEN))
    (args,) = adapter.stage.forward_calls
    assert args.out is out and args.indexer.ring is None  # the tail ring's conversion is a NoPE layer's only
    assert args.indexer.k_cache.base is indexer.k_cache.kv_cache


# --- the real stage on a GPU ---------------------------------------------------------------------------------------


def torch_on_a_gpu():
    try:
        import torch
    except ImportError:
        pytest.skip("the GPU half of the adapter test needs PyTorch (not importable here)")
    if not torch.cuda.is_available():
        pytest.skip("the GPU half of the adapter test needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch


def gpu_layer(monkeypatch):
    """A glm5next TP8 layer on the GPU behind a fake vLLM wrapper that holds
    it in vLLM 0.33's layouts: random BF16 weights at small scales, W_UK_T
    and W_UV the strided views of one kv_b_proj weight, the fused
    wk_weights_proj, 0-dim scales; an FP8 KV cache of random entries, the
    indexer K cache [blocks, pools, 132] and the tail ring [tail blocks, 2,
    ring, 128] (request 0 in tail block 5, request 1 in tail block 3) for two
    requests of two blocks each (contexts of a few hundred tokens: L <=
    2048, the indexer takes every pool), and a fake forward context that
    describes the step set in layer.step. layer.weights: the stage's weights
    as a caller would hand them to dsa_decode.Stage."""
    torch = torch_on_a_gpu()
    config = dsa_decode.layer_config("glm5next", tp=8, rms_norm_eps=RMS_NORM_EPS)
    assert (config.hidden_size, config.num_heads, config.q_lora_rank) == (HIDDEN, HEADS, Q_LORA)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(20261207)

    def normal(*shape, scale, mean=0.0, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=generator, device=device) * scale + mean).to(dtype)

    f32 = torch.float32
    # vLLM's kv_b_proj weight [H (P + V), L]; W_UK_T = [H, P, L], W_UV = [H, L, V] views of it.
    kv_b_proj = normal(HEADS * (NOPE + V_HEAD), KV_LORA, scale=0.02)
    per_head = kv_b_proj.t().view(KV_LORA, HEADS, NOPE + V_HEAD)
    w_uk, w_uv = per_head.split([NOPE, V_HEAD], dim=-1)
    held = {
        "fused_qkv_a_proj": normal(Q_LORA + KV_LORA, HIDDEN, scale=0.02),
        "q_a_norm": normal(Q_LORA, scale=0.05, mean=1.0),
        "kv_a_norm": normal(KV_LORA, scale=0.05, mean=1.0),
        "q_b_proj": normal(HEADS * NOPE, Q_LORA, scale=0.02),
        "w_uk_t": w_uk.permute(1, 2, 0),
        "w_uv": w_uv.transpose(0, 1),
        "o_proj": normal(HIDDEN, HEADS * V_HEAD, scale=0.02),
        "q_scale": torch.tensor(0.05, dtype=f32, device=device),
        "k_scale": torch.tensor(0.05, dtype=f32, device=device),
        "index_wq_b": normal(INDEX_HEADS * INDEX_DIM, Q_LORA, scale=0.02),
        "wk_weights_proj": normal(INDEX_DIM + INDEX_HEADS, HIDDEN, scale=0.02),
        "index_compress_gate": normal(INDEX_DIM, HIDDEN, scale=0.02),
        "index_k_norm_weight": normal(INDEX_DIM, scale=0.05, mean=1.0, dtype=f32),
        "index_k_norm_bias": normal(INDEX_DIM, scale=0.02, dtype=f32),
        "index_ape": normal(POOL, INDEX_DIM, scale=0.02, dtype=f32),
    }
    assert held["w_uv"].stride() == ((NOPE + V_HEAD) * KV_LORA, 1, KV_LORA)
    weights = {name: held[name] for name in WEIGHT_NAMES if name in held}
    weights.update(
        w_uv=held["w_uv"].contiguous(),
        q_scale=held["q_scale"].view(1),
        k_scale=held["k_scale"].view(1),
        index_wk=held["wk_weights_proj"][:INDEX_DIM],
        index_weights_proj=held["wk_weights_proj"][INDEX_DIM:],
    )
    requests, blocks_per_request = 2, 2
    blocks = requests * blocks_per_request
    block_table = torch.arange(blocks, dtype=torch.int32, device=device).view(requests, blocks_per_request)
    tail_blocks = [5, 3]  # each request's own tail block
    random_entries = torch.randn(blocks, BLOCK, KV_LORA, generator=generator, device=device) * 0.5
    caches = {
        # Random entries, so that the attention reads the past, not only the step's own entries.
        "kv_cache": random_entries.to(torch.float8_e4m3fn),
        "tail": torch.zeros(6, 2, RING, INDEX_DIM, dtype=torch.bfloat16, device=device),
        "k_cache": torch.zeros(blocks, BLOCK // POOL, 132, dtype=torch.uint8, device=device),
    }
    attention = fake_attention(
        weights,
        held=held,
        # What vLLM's configuration of the preset holds: its float32 eps, its cache dtype's name.
        attention={
            "scale": config.softmax_scale,
            "kv_cache_dtype": config.kv_cache_dtype,
            "kv_cache": caches["kv_cache"],
        },
        indexer={
            "k_cache": SimpleNamespace(kv_cache=caches["k_cache"], cache_config=SimpleNamespace(block_size=BLOCK)),
            "tail_cache": SimpleNamespace(kv_cache=caches["tail"], prefix=TAIL_PREFIX),
            "vllm_config": SimpleNamespace(num_speculative_tokens=0, model_config=SimpleNamespace(max_model_len=2048)),
        },
        rms_norm_eps=config.rms_norm_eps,
    )
    layer = SimpleNamespace(
        torch=torch,
        device=device,
        config=config,
        plan=StagePlan(max_context=2048),
        weights=weights,
        block_table=block_table,
        tail_blocks=tail_blocks,
        caches=caches,
        attention=attention,
        normal=normal,
        step={},
    )

    def set_step(token_requests, token_positions):
        """The step's tensors, as the forward context will describe them."""
        layer.step.update(
            m=len(token_requests),
            positions=torch.tensor(token_positions, dtype=torch.int64, device=device),
            requests=torch.tensor(token_requests, dtype=torch.int32, device=device),
            slots=torch.tensor(
                [int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK for r, p in zip(token_requests, token_positions)],
                dtype=torch.int64,
                device=device,
            ),
            tail_slots=torch.tensor(
                [tail_blocks[r] * RING + p % RING for r, p in zip(token_requests, token_positions)],
                dtype=torch.int64,
                device=device,
            ),
        )

    def forward_context():
        step = layer.step
        metadata = SimpleNamespace(
            num_actual_tokens=step["m"],
            num_decode_tokens=step["m"],
            block_table=block_table,
            req_id_per_token=step["requests"],
        )
        return SimpleNamespace(
            attn_metadata={LAYER_NAME: metadata, TAIL_PREFIX: SimpleNamespace(slot_mapping=step["tail_slots"])},
            slot_mapping={LAYER_NAME: step["slots"]},
        )

    layer.set_step = set_step
    fake_vllm(monkeypatch, forward_context)
    return layer


def cache_bytes(layer):
    """Copies of the caches' bytes (FP8 as uint8: the stage takes either view)."""
    torch = layer.torch
    return {
        name: (cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache).clone()
        for name, cache in layer.caches.items()
    }


def test_the_installed_forward_equals_the_stage_on_a_gpu(monkeypatch):
    layer = gpu_layer(monkeypatch)
    torch, wrapper = layer.torch, layer.attention.mla_attn
    adapter = adapter_module.install(layer.attention, layer.plan)  # vllm_step_inputs and dsa_decode.Stage
    assert adapter.config == layer.config  # what vLLM's wrapper says is what the preset is
    reference = dsa_decode.Stage(layer.config, layer.weights, layer.plan)
    tail_blocks = layer.tail_blocks

    for token_requests, token_positions in (([0], [300]), ([0, 1], [301, 200]), ([1, 0], [201, 302])):
        m = len(token_requests)
        layer.set_step(token_requests, token_positions)
        hidden = layer.normal(m, HIDDEN, scale=1.0)
        before = cache_bytes(layer)
        direct = cache_bytes(layer)  # the direct run's, as they were before the step
        # The direct run's ring: the stage's own layout, one row per request.
        direct_ring = direct["tail"][tail_blocks].clone()

        out = wrapper.forward(layer.step["positions"], hidden)  # as the model calls it: the installed forward
        assert wrapper.stock_calls == [], f"m = {m}: the stage, not stock, should have run"

        direct_out = torch.empty_like(hidden)
        reference.forward(
            StepArgs(
                hidden=hidden,
                positions=layer.step["positions"],
                token_requests=layer.step["requests"],
                slot_mapping=layer.step["slots"],
                kv_cache=direct["kv_cache"],
                indexer=IndexerState(
                    layer.block_table, direct_ring, direct["k_cache"].view(direct["k_cache"].shape[0], -1)
                ),
                out=direct_out,
            )
        )
        torch.cuda.synchronize()
        assert out.shape == (m, HIDDEN) and out.dtype == torch.bfloat16
        assert torch.isfinite(out.float()).all() and out.abs().max() > 0, f"m = {m}"
        assert torch.equal(out, direct_out), f"m = {m}: the installed forward differs from Stage.forward"
        after = cache_bytes(layer)
        for name in ("kv_cache", "k_cache"):
            assert torch.equal(after[name], direct[name]), f"m = {m}: {name} differs"
        # vLLM's tail blocks hold what the stage's ring rows hold; the others are untouched.
        expected_tail = before["tail"].clone()
        expected_tail[tail_blocks] = direct_ring
        assert torch.equal(after["tail"], expected_tail), f"m = {m}: the tail ring differs"
        assert not torch.equal(after["tail"], before["tail"]), f"m = {m}: the step stashed no tail entry"
        assert not torch.equal(after["kv_cache"], before["kv_cache"]), f"m = {m}: the step wrote no KV entry"
    adapter.uninstall()


def test_the_installed_forward_runs_stock_past_16_tokens_and_raises_the_stages_errors_on_a_gpu(monkeypatch):
    layer = gpu_layer(monkeypatch)
    torch, wrapper = layer.torch, layer.attention.mla_attn
    adapter = adapter_module.install(layer.attention, layer.plan)

    layer.set_step([0] * 17, list(range(400, 417)))
    before = cache_bytes(layer)
    hidden = layer.normal(17, HIDDEN, scale=1.0)
    result = wrapper.forward(layer.step["positions"], hidden)
    assert result[0] == "stock" and result[1] is hidden
    assert wrapper.stock_calls == [(layer.step["positions"], hidden, None)]
    after = cache_bytes(layer)
    assert all(torch.equal(after[name], before[name]) for name in after), "a stock step wrote the caches"

    # A bad argument is the stage's error, named, not a silent stock step.
    layer.set_step([0], [303])
    with pytest.raises(ValueError, match="argument 'positions'"):
        wrapper.forward(layer.step["positions"].to(torch.int32), layer.normal(1, HIDDEN, scale=1.0))
    torch.cuda.synchronize()
    adapter.uninstall()
