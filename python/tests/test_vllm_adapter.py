"""dsa_decode.vllm: the stage installed on a vLLM MLA wrapper.

vLLM cannot be installed here, so the tests build a wrapper with the same
attribute contract (w = attention.mla_attn, mla = w.mla_attn, impl =
mla.impl, vLLM's names). The CPU tests need neither PyTorch nor a GPU: their
tensors are FakeTensor (a shape, strides, new_empty, slicing) and the stage
is a FakeStage passed as install's stage_factory. The GPU test builds real
glm5next TP8 weights and caches with PyTorch and checks that the installed
forward returns exactly what dsa_decode.Stage.forward gives on the same
inputs."""

from __future__ import annotations

import sys
import types
import warnings
from types import SimpleNamespace

import pytest

import dsa_decode
from dsa_decode import vllm as adapter_module
from dsa_decode.ops import IndexerState
from dsa_decode.stage import WEIGHT_NAMES, StagePlan, StepArgs

# glm5next at TP8 (presets.h), written out so that the CPU tests need no extension call.
HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, V_HEAD = 4096, 8, 1536, 512, 256, 256
INDEX_HEADS, INDEX_DIM, BLOCK = 32, 128, 256
SOFTMAX_SCALE = 256**-0.5
RMS_NORM_EPS = 1e-6
LAYER_NAME = "model.layers.3.self_attn.mla_attn.attn"


class FakeTensor:
    """What the adapter reads of a tensor without PyTorch: shape, stride(),
    new_empty (the output) and a slice (token_requests[:m])."""

    def __init__(self, *shape, strides=None, name=""):
        self.shape = tuple(shape)
        contiguous, step = [], 1
        for size in reversed(self.shape):
            contiguous.insert(0, step)
            step *= size
        self._strides = tuple(strides) if strides is not None else tuple(contiguous)
        self.name = name

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def new_empty(self, shape):
        return FakeTensor(*shape, name=f"new_empty of {self.name}")

    def __getitem__(self, index):
        assert isinstance(index, slice) and index.start is None and index.step is None
        view = FakeTensor(min(index.stop, self.shape[0]), *self.shape[1:], name=f"{self.name}[:{index.stop}]")
        view.sliced_from = self
        return view


def fake_weights():
    """The layer's weights by WEIGHT_NAMES key, as FakeTensors of their shapes."""
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
        "index_ape": (4, INDEX_DIM),
    }
    return {name: FakeTensor(*shapes[name], name=name) for name in WEIGHT_NAMES}


class FakeMlaWrapper:
    """vLLM's MultiHeadLatentAttentionWrapper as far as the adapter reads it;
    its class forward is the stock forward, and records its calls."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)
        self.stock_calls = []

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        self.stock_calls.append((positions, hidden_states, llama_4_scaling))
        return ("stock", hidden_states)


def fake_attention(weights, *, wrapper=None, attention=None, impl=None, indexer=None, rms_norm_eps=RMS_NORM_EPS):
    """vLLM's attention module of a glm5next DSA layer (attention.mla_attn =
    the wrapper) over these weights; the keyword dicts override attributes of
    the wrapper, its MLAAttention, the backend impl and the indexer."""
    indexer_attributes = dict(
        wq_b=SimpleNamespace(weight=weights["index_wq_b"]),
        wk=SimpleNamespace(weight=weights["index_wk"]),
        weights_proj=SimpleNamespace(weight=weights["index_weights_proj"]),
        compress_gate=SimpleNamespace(weight=weights["index_compress_gate"]),
        k_norm=SimpleNamespace(weight=weights["index_k_norm_weight"], bias=weights["index_k_norm_bias"]),
        ape=weights["index_ape"],
        ring_cache=FakeTensor(2, 2, 4, INDEX_DIM, name="ring"),
        k_cache=SimpleNamespace(kv_cache=FakeTensor(4, BLOCK // 4 * 132, name="index_k_cache")),
    )
    indexer_attributes.update(indexer or {})
    impl_attributes = dict(dcp_world_size=1)
    impl_attributes.update(impl or {})
    mla_attributes = dict(
        impl=SimpleNamespace(**impl_attributes),
        layer_name=LAYER_NAME,
        scale=SOFTMAX_SCALE,
        kv_cache_dtype="fp8",
        q_pad_num_heads=None,
        use_pcp=False,
        hisparse_cache=None,
        W_UK_T=weights["w_uk_t"],
        W_UV=weights["w_uv"],
        _q_scale=weights["q_scale"],
        _k_scale=weights["k_scale"],
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
        fused_qkv_a_proj=SimpleNamespace(weight=weights["fused_qkv_a_proj"]),
        q_a_layernorm=SimpleNamespace(weight=weights["q_a_norm"], variance_epsilon=rms_norm_eps),
        kv_a_layernorm=SimpleNamespace(weight=weights["kv_a_norm"], variance_epsilon=rms_norm_eps),
        q_b_proj=SimpleNamespace(weight=weights["q_b_proj"]),
        o_proj=SimpleNamespace(weight=weights["o_proj"]),
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
    config, read = adapter_module.read_layer(fake_attention(weights))
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
        # The wrapper's own objects: W_UV too, where the seed made a contiguous copy.
        assert read[name] is weights[name], name


def test_read_layer_takes_an_fp8_e4m3_cache_dtype():
    config, _ = adapter_module.read_layer(fake_attention(fake_weights(), attention={"kv_cache_dtype": "fp8_e4m3"}))
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
]
SEED_REQUIREMENTS = sorted({what for _, _, what, _ in FAILED_CHECKS} | {"a column-major W_UK"})


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
    attention = fake_attention(fake_weights(), indexer={"compress_gate": SimpleNamespace()})
    attention.mla_attn.indexer.k_norm.bias = None  # a LayerNorm without bias
    del attention.mla_attn.indexer.ape
    with pytest.raises(ValueError) as error:
        adapter_module.read_layer(attention)
    message = needs_message(error)
    for path, name in (
        ("compress_gate.weight", "index_compress_gate"),
        ("k_norm.bias", "index_k_norm_bias"),
        ("ape", "index_ape"),
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
    assert adapter.stage.plan == StagePlan(batch_invariant=invariant)
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


# --- vllm_step_inputs: vLLM's forward context ----------------------------------------------------------------------


def fake_vllm(monkeypatch, get_forward_context):
    """Makes `from vllm.forward_context import get_forward_context` find this function."""
    package = types.ModuleType("vllm")
    package.__path__ = []
    forward_context = types.ModuleType("vllm.forward_context")
    forward_context.get_forward_context = get_forward_context
    package.forward_context = forward_context
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm.forward_context", forward_context)


def fake_context(m, **metadata_overrides):
    metadata = SimpleNamespace(
        num_actual_tokens=m,
        num_decode_tokens=m,
        block_table=FakeTensor(2, 2, name="block_table"),
        req_id_per_token=FakeTensor(64, name="req_id_per_token"),  # vLLM's persistent buffer, longer than m
        slot_mapping=FakeTensor(m, name="md.slot_mapping"),
    )
    metadata.__dict__.update(metadata_overrides)
    return SimpleNamespace(
        attn_metadata={LAYER_NAME: metadata},
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
    assert inputs.indexer.ring is indexer.ring_cache and inputs.indexer.k_cache is indexer.k_cache.kv_cache
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


def test_the_installed_forward_runs_the_stage_through_vllms_context(monkeypatch):
    fake_vllm(monkeypatch, lambda: fake_context(1))
    adapter = install_fake()
    out = adapter.wrapper.forward(FakeTensor(1), FakeTensor(1, HIDDEN))
    assert adapter.stage.forward_calls and adapter.stage.forward_calls[0].out is out


def no_forward_context():
    raise AssertionError("Forward context is not set. Please use `set_forward_context` to set the forward context.")


@pytest.mark.parametrize(
    "case",
    ["vllm not importable", "no forward context", "no metadata for the layer", "metadata None", "no ring", "no table"],
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
    elif case == "no ring":
        del attention.mla_attn.indexer.ring_cache
    elif case == "no table":
        del context.attn_metadata[LAYER_NAME].block_table
    adapter = install_fake(attention)
    positions, hidden = FakeTensor(1), FakeTensor(1, HIDDEN)
    if case in ("no ring", "no table"):  # maybe a wrong name in the tables: said once per layer
        missing = "ring" if case == "no ring" else "block_table"
        with pytest.warns(RuntimeWarning, match=f"no {missing} found.*run the stock forward"):
            assert adapter_module.vllm_step_inputs(adapter, positions, hidden) is None
    else:
        assert adapter_module.vllm_step_inputs(adapter, positions, hidden) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a second time
        assert adapter.forward(positions, hidden) == ("stock", hidden)
    assert adapter.stage.forward_calls == []


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
    """A glm5next TP8 layer on the GPU behind a fake vLLM wrapper: random
    BF16 weights at small scales, an FP8 KV cache of random entries and an
    empty indexer state for two requests of two blocks each (contexts of a
    few hundred tokens: L <= 2048, the indexer takes every pool), and a fake
    forward context that describes the step set in layer.step."""
    torch = torch_on_a_gpu()
    config = dsa_decode.layer_config("glm5next", tp=8, rms_norm_eps=RMS_NORM_EPS)
    assert (config.hidden_size, config.num_heads, config.q_lora_rank) == (HIDDEN, HEADS, Q_LORA)
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(20261207)

    def normal(*shape, scale, mean=0.0, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=generator, device=device) * scale + mean).to(dtype)

    f32 = torch.float32
    weights = {
        "fused_qkv_a_proj": normal(Q_LORA + KV_LORA, HIDDEN, scale=0.02),
        "q_a_norm": normal(Q_LORA, scale=0.05, mean=1.0),
        "kv_a_norm": normal(KV_LORA, scale=0.05, mean=1.0),
        "q_b_proj": normal(HEADS * NOPE, Q_LORA, scale=0.02),
        "w_uk_t": normal(HEADS, NOPE, KV_LORA, scale=0.02),
        "w_uv": normal(HEADS, KV_LORA, V_HEAD, scale=0.02),
        "o_proj": normal(HIDDEN, HEADS * V_HEAD, scale=0.02),
        "q_scale": torch.tensor([0.05], dtype=f32, device=device),
        "k_scale": torch.tensor([0.05], dtype=f32, device=device),
        "index_wq_b": normal(INDEX_HEADS * INDEX_DIM, Q_LORA, scale=0.02),
        "index_wk": normal(INDEX_DIM, HIDDEN, scale=0.02),
        "index_weights_proj": normal(INDEX_HEADS, HIDDEN, scale=0.02),
        "index_compress_gate": normal(INDEX_DIM, HIDDEN, scale=0.02),
        "index_k_norm_weight": normal(INDEX_DIM, scale=0.05, mean=1.0, dtype=f32),
        "index_k_norm_bias": normal(INDEX_DIM, scale=0.02, dtype=f32),
        "index_ape": normal(4, INDEX_DIM, scale=0.02, dtype=f32),
    }
    requests, blocks_per_request = 2, 2
    blocks = requests * blocks_per_request
    block_table = torch.arange(blocks, dtype=torch.int32, device=device).view(requests, blocks_per_request)
    random_entries = torch.randn(blocks, BLOCK, KV_LORA, generator=generator, device=device) * 0.5
    caches = {
        # Random entries, so that the attention reads the past, not only the step's own entries.
        "kv_cache": random_entries.to(torch.float8_e4m3fn),
        "ring": torch.zeros(requests, 2, 4, INDEX_DIM, dtype=torch.bfloat16, device=device),
        "k_cache": torch.zeros(blocks, BLOCK // 4 * 132, dtype=torch.uint8, device=device),
    }
    attention = fake_attention(
        weights,
        # What vLLM's configuration of the preset holds: its float32 eps, its cache dtype's name.
        attention={
            "scale": config.softmax_scale,
            "kv_cache_dtype": config.kv_cache_dtype,
            "kv_cache": caches["kv_cache"],
        },
        indexer={"ring_cache": caches["ring"], "k_cache": SimpleNamespace(kv_cache=caches["k_cache"])},
        rms_norm_eps=config.rms_norm_eps,
    )
    layer = SimpleNamespace(
        torch=torch,
        device=device,
        config=config,
        plan=StagePlan(max_context=2048),
        weights=weights,
        block_table=block_table,
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
        )

    def forward_context():
        step = layer.step
        metadata = SimpleNamespace(
            num_actual_tokens=step["m"],
            num_decode_tokens=step["m"],
            block_table=block_table,
            req_id_per_token=step["requests"],
        )
        return SimpleNamespace(attn_metadata={LAYER_NAME: metadata}, slot_mapping={LAYER_NAME: step["slots"]})

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

    for token_requests, token_positions in (([0], [300]), ([0, 1], [301, 200]), ([1, 0], [201, 302])):
        m = len(token_requests)
        layer.set_step(token_requests, token_positions)
        hidden = layer.normal(m, HIDDEN, scale=1.0)
        before = cache_bytes(layer)
        direct_caches = cache_bytes(layer)  # the direct run's, as they were before the step

        out = wrapper.forward(layer.step["positions"], hidden)  # as the model calls it: the installed forward
        assert wrapper.stock_calls == [], f"m = {m}: the stage, not stock, should have run"

        direct = torch.empty_like(hidden)
        reference.forward(
            StepArgs(
                hidden=hidden,
                positions=layer.step["positions"],
                token_requests=layer.step["requests"],
                slot_mapping=layer.step["slots"],
                kv_cache=direct_caches["kv_cache"],
                indexer=IndexerState(layer.block_table, direct_caches["ring"], direct_caches["k_cache"]),
                out=direct,
            )
        )
        torch.cuda.synchronize()
        assert out.shape == (m, HIDDEN) and out.dtype == torch.bfloat16
        assert torch.isfinite(out.float()).all() and out.abs().max() > 0, f"m = {m}"
        assert torch.equal(out, direct), f"m = {m}: the installed forward differs from Stage.forward"
        after = cache_bytes(layer)
        for name in after:
            assert torch.equal(after[name], direct_caches[name]), f"m = {m}: {name} differs"
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
