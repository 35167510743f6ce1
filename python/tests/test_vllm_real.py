"""dsa_decode.vllm on vLLM's real classes (vLLM 0.33 or newer, CPU only).

Where vLLM imports (the environment `bash scripts/setup-vllm` makes,
.venv-vllm), the tests build vLLM's own glm5next attention module,
Glm5NextMLAAttention (vllm/models/glm5next/common/attention.py), from a
scaled-down model config the way vLLM's model builds it, load its weights
through vLLM's weight loaders, run vLLM's process_weights_after_loading,
lay its three caches out with vLLM's own view code and bind them with its
bind_kv_cache, and install the adapter on it: every attribute and view the
adapter reads must resolve, the checks must pass (or name what is missing),
and the library's own argument checks must accept vLLM's tensors except for
their device (there is no GPU here). vllm_step_inputs is run under vLLM's
own forward context with its metadata classes and the tail ring's slots
from vLLM's compute_kpool_tail_slot_mapping; the ring conversion runs on
CPU tensors.

The limit of a CPU machine: vLLM's CUDA platform module needs the driver
(libcuda), so the attention backend vLLM would pick on SM90 is set by name
(FLASHINFER_MLA_SPARSE_SM90, platforms/cuda.py:140-148) where the CPU
platform refuses sparse attention; nothing runs on a GPU, so the stage's
forward on vLLM's tensors is left to the GPU tests (test_vllm_adapter.py's
GPU half builds the same layouts by hand).

Where vLLM does not import here but .venv-vllm exists, one test runs this
module under .venv-vllm's Python (dsa_decode from this Python's path) and
passes on its result; without either, everything skips with the reason."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

import dsa_decode
from dsa_decode import vllm as adapter_module

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".venv-vllm"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # read by vLLM's platform detection on import

try:
    import torch
    import vllm.models.glm5next.common.attention  # noqa: F401  (the module the tests build from)

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

LAYER = "model.layers.0.self_attn"


# --- without vLLM here: run this module in .venv-vllm ---------------------------------------------------------------


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM imports in this Python: the tests below run here")
def test_vllm_real_classes_in_their_environment():
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip("vLLM is not installed: `bash scripts/setup-vllm` installs it into .venv-vllm (opt-in)")
    package_root = str(Path(os.path.abspath(dsa_decode.__file__)).parents[1])  # the package this Python imports
    env = dict(os.environ, PYTHONPATH=package_root, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "-k",
            "not in_their_environment",
            __file__,
        ],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f".venv-vllm's run of {__file__} failed:\n{output[-6000:]}"
    summary = output.strip().splitlines()[-1]
    assert (
        " passed" in summary and "skipped" not in summary
    ), f"a real-class test skipped in .venv-vllm:\n{output[-3000:]}"


# --- vLLM's glm5next attention module ---------------------------------------------------------------------------


needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM does not import in this Python (see the test above)")

# A scaled-down glm5next: glm5next's per-head sizes (NoPE, L 512, P = V =
# 256, index dim 128), 4 heads, D 256, Q 512.
SMALL = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=512,  # the stage takes q_lora_rank >= kv_lora_rank
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    qk_rope_head_dim=0,
    v_head_dim=256,
    num_hidden_layers=1,
    vocab_size=128,
    pad_token_id=0,
    rms_norm_eps=1e-6,
    index_topk=2048,
    index_head_dim=128,
    # Checkpoint fields that transformers' config does not declare and vLLM
    # reads (Glm5NextMLAAttention.__init__, the decoder layer in model.py).
    indexer_rope_interleave=False,
    mla_use_nope=True,
)
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 256, 6, 4096


class World:
    """One process's vLLM state: the distributed group (gloo, world size
    1) is set up once, each layer gets its own VllmConfig."""

    ready = False

    @classmethod
    def init(cls, vllm_config):
        if cls.ready:
            return
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
        cls.ready = True


def sm90_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.FLASHINFER_MLA_SPARSE_SM90


def small_vllm_config(monkeypatch, hf, prefix, block_size):
    """hf's config.json in a checkpoint folder (ModelConfig reads one) and the
    VllmConfig a CUDA deployment leaves: an FP8 cache of block_size."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.platforms import current_platform

    folder = tempfile.mkdtemp(prefix=prefix)
    hf.save_pretrained(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_config = ModelConfig(model=folder, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="bfloat16")
    # The CPU platform's config hook is not the one a GPU deployment runs (it
    # forces its own block size, 16, and vLLM 0.34's wants triton-cpu): off.
    monkeypatch.setattr(current_platform, "check_and_update_config", lambda config: None)
    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=block_size, cache_dtype="fp8"))
    # Set after construction, as a CUDA platform's hook leaves them.
    vllm_config.model_config = model_config
    vllm_config.cache_config.block_size = block_size
    vllm_config.attention_config.sparse_mla_prefill_workspace_factor = 5
    return vllm_config, model_config


def mla_attention_kwargs(vllm_config, config):
    """The arguments a decoder layer gives vLLM's MLA attention modules."""
    return dict(
        vllm_config=vllm_config,
        config=config,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        max_position_embeddings=config.max_position_embeddings,
        cache_config=vllm_config.cache_config,
        quant_config=None,
        prefix=LAYER,
        topk_indices_buffer=torch.zeros(16, config.index_topk, dtype=torch.int32),
    )


def build_layer(monkeypatch, *, heads, pool, speculative_tokens=0):
    """vLLM's Glm5NextMLAAttention as its model builds it (models/glm5next/
    common/model.py: the decoder layer's call), weights loaded through vLLM's
    loaders and processed, caches laid out and bound by vLLM's code."""
    from transformers import Glm5NextTextConfig
    from vllm.config import set_current_vllm_config
    from vllm.models.glm5next.common.attention import Glm5NextMLAAttention
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    hf = Glm5NextTextConfig(**SMALL, index_n_heads=heads, index_kpool=pool, architectures=["Glm5NextForCausalLM"])
    vllm_config, model_config = small_vllm_config(monkeypatch, hf, "glm5next-small-", BLOCK_SIZE)
    if speculative_tokens:
        monkeypatch.setattr(type(vllm_config), "num_speculative_tokens", property(lambda self: speculative_tokens))
    # The backend vLLM's CUDA platform picks on SM90 for head size 512; the
    # CPU platform raises for sparse attention.
    backend = sm90_backend()
    monkeypatch.setattr(current_platform, "get_attn_backend_cls", lambda *args, **kwargs: backend.get_path())
    config = model_config.hf_text_config
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
        World.init(vllm_config)
        attention = Glm5NextMLAAttention(
            **mla_attention_kwargs(vllm_config, config),
            skip_rope=config.mla_use_nope,
        )
    layer = SimpleNamespace(attention=attention, vllm_config=vllm_config, config=config, hf=hf)
    load_weights(layer)
    bind_caches(layer)
    return layer


def load_weights(layer):
    """Random checkpoint tensors through each parameter's vLLM weight loader
    (the fused wk_weights_proj by its shard ids 0 = wk and 1 = weights_proj,
    as Glm5NextForCausalLM.load_weights hands them), then the model
    loader's process_weights_after_loading (MLAAttention's: W_UK_T, W_UV)."""
    generator = torch.Generator().manual_seed(44)
    checkpoint = {}
    attention = layer.attention
    with torch.no_grad():
        for name, parameter in attention.named_parameters():
            if name.endswith("wk_weights_proj.weight"):
                continue
            value = (torch.randn(parameter.shape, generator=generator) * 0.02).to(parameter.dtype)
            loader = getattr(parameter, "weight_loader", None)
            if loader is not None:
                loader(parameter, value)
            else:
                parameter.copy_(value)
            checkpoint[name] = value
        indexer = attention.mla_attn.indexer
        fused = indexer.wk_weights_proj.weight
        head_dim, heads = indexer.head_dim, indexer.n_head
        wk = (torch.randn(head_dim, fused.shape[1], generator=generator) * 0.02).to(fused.dtype)
        weights_proj = (torch.randn(heads, fused.shape[1], generator=generator) * 0.02).to(fused.dtype)
        fused.weight_loader(fused, wk, 0)
        fused.weight_loader(fused, weights_proj, 1)
        checkpoint["indexer.wk"], checkpoint["indexer.weights_proj"] = wk, weights_proj
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(layer.vllm_config):  # the model loader's own pass over the modules
        process_weights_after_loading(attention, layer.vllm_config.model_config, torch.device("cpu"))
    layer.checkpoint = checkpoint


def bind_caches(layer):
    """Each cache layer's spec (get_kv_cache_spec), its per-layer view made
    by vLLM's create_kv_cache_views in a block-outermost layout shared with a
    second layer (so every block stride is padded past the layer's page), and
    vLLM's bind_kv_cache on it."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layer_kv_cache_shape_bytes, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    attention = layer.attention
    mla = attention.mla_attn.mla_attn
    layer.specs = {}
    indexer = attention.mla_attn.indexer  # (glm5next's attention module holds it too; DeepSeek-V3.2's only here)
    tail = getattr(indexer, "tail_cache", None)  # DeepSeek-V3.2's indexer keeps no tail ring
    for cache_layer in (mla, indexer.k_cache) + ((tail,) if tail is not None else ()):
        spec = cache_layer.get_kv_cache_spec(layer.vllm_config)
        page = 1
        for size in compute_layer_kv_cache_shape_bytes(spec, 1):
            page *= size
        layers = [getattr(cache_layer, "layer_name", None) or cache_layer.prefix, "model.layers.1.other"]
        tensor = KVCacheTensor(
            size=page * len(layers) * NUM_BLOCKS, layers=layers, layer_stride=page, block_stride=page * len(layers)
        )
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        view = create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout.BLHNC, tensor)[0]
        cache_layer.bind_kv_cache(view)
        layer.specs[layers[0]] = spec


class RecordingStage:
    """The stage factory's product where there is no GPU: what install()
    created it with, then the library's own Stage creation on the same
    tensors (which stops at the device check)."""

    def __init__(self, config, weights, plan):
        self.config, self.weights, self.plan = config, weights, plan
        try:
            dsa_decode.Stage(config, weights, plan)
            self.library_error = None
        except dsa_decode.InvalidArgument as error:
            self.library_error = str(error)

    def supports(self, m, num_actual_tokens, num_decode_tokens):
        return dsa_decode.supports(m, num_actual_tokens, num_decode_tokens, self.plan.max_tokens)

    def forward(self, args):
        raise AssertionError("no stage forward runs without a GPU")


def install(layer, **kwargs):
    return adapter_module.install(layer.attention, stage_factory=RecordingStage, **kwargs)


def same_memory(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def library_shape_is_configurable():
    return bool(adapter_module.library_indexer_fields())


# The library's fixed shape before configurable indexer shapes, and a shape
# vLLM's served checkpoint has (16 heads, vLLM's comment at
# models/glm5next/common/attention.py ~365) with transformers' default pool.
SUPPORTED = dict(heads=32, pool=4)
SERVED = dict(heads=16, pool=16)


@needs_vllm
def test_vllms_hopper_backend_is_the_one_the_adapter_takes(monkeypatch):
    backend = sm90_backend()
    cls = backend.get_class()
    from vllm.platforms.interface import DeviceCapability

    assert backend.name == "FLASHINFER_MLA_SPARSE_SM90" and backend.name in adapter_module.KV_CACHE_BACKENDS
    assert cls.is_sparse() and cls.is_mla() and cls.supports_compute_capability(DeviceCapability(9, 0))
    assert 512 in cls.get_supported_head_sizes()  # kv_lora_rank 512 + rope 0
    # Its KV cache: the flat [blocks, block_size, 512] the stage reads.
    assert cls.get_kv_cache_shape(7, BLOCK_SIZE, 1, 512, "fp8") == (7, BLOCK_SIZE, 512)
    layer = build_layer(monkeypatch, **SUPPORTED)
    impl = layer.attention.mla_attn.mla_attn.impl
    # Its query is BF16 (no query quant): the stage's FP8 query departs from it.
    assert type(impl).__name__ == "FlashInferMLASparseSM90Impl" and impl.supports_quant_query_input is False


@needs_vllm
def test_vllms_weights_and_layouts_are_what_the_adapter_reads(monkeypatch):
    layer = build_layer(monkeypatch, **SUPPORTED)
    attention = layer.attention
    w, indexer = attention.mla_attn, attention.indexer
    mla = w.mla_attn
    names = dict(attention.named_parameters())
    for name in (
        "indexer.wk_weights_proj.weight",
        "indexer.index_kpool_compress_gate",
        "indexer.index_kpool_compress_ape",
        "indexer.wq_b.weight",
        "indexer.k_norm.weight",
        "indexer.k_norm.bias",
        "fused_qkv_a_proj.weight",
        "q_b_proj.weight",
        "o_proj.weight",
    ):
        assert name in names, f"vLLM has no parameter {name}: {sorted(names)}"
    D, heads, pool = SMALL["hidden_size"], SUPPORTED["heads"], SUPPORTED["pool"]
    # The fused wk + weights_proj: rows [:128] wk, [128:] weights_proj (vLLM's loader put them there).
    fused = indexer.wk_weights_proj.weight
    assert tuple(fused.shape) == (128 + heads, D)
    assert torch.equal(fused[:128], layer.checkpoint["indexer.wk"])
    assert torch.equal(fused[128:], layer.checkpoint["indexer.weights_proj"])
    assert tuple(indexer.index_kpool_compress_gate.shape) == (128, D)
    assert indexer.index_kpool_compress_gate.dtype == torch.bfloat16
    assert tuple(indexer.index_kpool_compress_ape.shape) == (pool, 128)
    assert indexer.index_kpool_compress_ape.dtype == torch.float32
    assert indexer.k_norm.weight.dtype == torch.float32 and indexer.k_norm.bias.dtype == torch.float32
    # W_UV: a strided view of kv_b_proj's weight, [H, L, V] strides ((P+V) L, 1, L); W_UK_T [H, P, L].
    H, L, P, V = SMALL["num_attention_heads"], 512, 256, 256
    assert tuple(mla.W_UV.shape) == (H, L, V) and mla.W_UV.stride() == ((P + V) * L, 1, L)
    assert tuple(mla.W_UK_T.shape) == (H, P, L) and mla.W_UK_T.stride() == ((P + V) * L, L, 1)
    assert same_memory(mla.W_UV, w.kv_b_proj.weight)
    assert mla._q_scale.dim() == 0 and mla._k_scale.dim() == 0
    # o_proj: a RowParallelLinear without bias (no reduction at TP 1).
    assert type(w.o_proj).__name__ == "RowParallelLinear" and w.o_proj.bias is None
    assert w.o_proj.tp_size == 1 and w.o_proj.reduce_results and w.o_proj.input_is_parallel
    # The caches as bound: [blocks, block_size, 512] FP8, [blocks, pools, 132]
    # uint8, [tail blocks, 2, ring, 128] BF16, blocks strided past the page.
    assert tuple(mla.kv_cache.shape) == (NUM_BLOCKS, BLOCK_SIZE, 512)
    assert tuple(indexer.k_cache.kv_cache.shape) == (NUM_BLOCKS, BLOCK_SIZE // pool, 132)
    assert indexer.k_cache.kv_cache.dtype == torch.uint8
    tail = indexer.tail_cache.kv_cache
    assert tuple(tail.shape) == (NUM_BLOCKS, 2, pool, 128) and tail.dtype == torch.bfloat16
    assert tail.stride(0) == 2 * (2 * pool * 128)  # two layers' pages per block
    # The indexer's config fields the adapter reads.
    for field, name in adapter_module.INDEXER_CONFIG_ATTRIBUTES.items():
        assert getattr(indexer.config, name) is not None, name


@needs_vllm
def test_install_on_vllms_module_resolves_everything(monkeypatch):
    layer = build_layer(monkeypatch, **SUPPORTED)
    attention = layer.attention
    w, indexer = attention.mla_attn, attention.indexer
    mla = w.mla_attn
    stock = w.forward
    adapter = install(layer)
    assert adapter.installed and w.forward == adapter.forward
    config = adapter.config
    assert (config.hidden_size, config.num_heads, config.q_lora_rank, config.kv_lora_rank) == (256, 4, 512, 512)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (256, 0, 256)
    assert config.softmax_scale == pytest.approx(256**-0.5) and config.rms_norm_eps == pytest.approx(1e-6)
    assert config.kv_cache_dtype == "fp8"
    weights = adapter.weights
    assert list(weights) == list(dsa_decode.WEIGHT_NAMES)
    # In place: vLLM's own tensors or views of them.
    assert weights["fused_qkv_a_proj"] is w.fused_qkv_a_proj.weight
    assert weights["q_b_proj"] is w.q_b_proj.weight and weights["o_proj"] is w.o_proj.weight
    assert weights["w_uk_t"] is mla.W_UK_T
    assert weights["index_wq_b"] is indexer.wq_b.weight
    assert weights["index_compress_gate"] is indexer.index_kpool_compress_gate
    assert weights["index_ape"] is indexer.index_kpool_compress_ape
    fused = indexer.wk_weights_proj.weight
    assert weights["index_wk"].data_ptr() == fused.data_ptr() and tuple(weights["index_wk"].shape) == (128, 256)
    assert weights["index_weights_proj"].data_ptr() == fused[128:].data_ptr()
    assert tuple(weights["index_weights_proj"].shape) == (32, 256)
    for name in ("q_scale", "k_scale"):
        assert tuple(weights[name].shape) == (1,) and same_memory(weights[name], getattr(mla, "_" + name))
    # W_UV: one contiguous copy, the same values.
    assert weights["w_uv"].is_contiguous() and not same_memory(weights["w_uv"], mla.W_UV)
    assert torch.equal(weights["w_uv"], mla.W_UV)
    # The plan: the layer's ring, block size and max_model_len.
    plan = adapter.plan
    assert (plan.ring, plan.block_size, plan.max_context) == (4, BLOCK_SIZE, MAX_MODEL_LEN)
    assert adapter.reduce is None  # TP 1: vLLM's o_proj does not reduce
    # The library's own checks take every one of vLLM's tensors but for its device.
    error = adapter.stage.library_error
    head = "invalid argument: DSA attention stage needs valid weights and plan: "
    assert error is not None and error.startswith(head), error
    complaints = error[len(head) :].split("; ")
    assert len(complaints) == len(dsa_decode.WEIGHT_NAMES), error
    assert all(" expected a CUDA tensor, got " in part for part in complaints), error
    adapter.uninstall()
    assert w.forward == stock


@needs_vllm
def test_a_shape_the_library_does_not_run_is_named(monkeypatch):
    layer = build_layer(monkeypatch, **SERVED)
    w = layer.attention.mla_attn
    stock = w.forward
    if library_shape_is_configurable():
        # The generalized library runs 16 heads x pools of 16 (ring 16).
        adapter = install(layer)
        assert adapter.plan.ring == 16
        adapter.uninstall()
        return
    with pytest.raises(ValueError) as error:
        install(layer)
    message = str(error.value)
    assert message.startswith("DSA attention stage needs an indexer the installed dsa_decode runs"), message
    assert "index_n_heads=16" in message and "index_kpool=16" in message and "tail ring 16" in message, message
    assert "plan.ring" in message, message  # the library's own words
    assert w.forward == stock


@needs_vllm
def test_speculative_tokens_double_the_ring(monkeypatch):
    # ring = kpool * next_power_of_2(ceil((kpool + spec) / kpool)): 4 -> 8 with 1..4 drafts.
    layer = build_layer(monkeypatch, **SUPPORTED, speculative_tokens=2)
    assert layer.attention.indexer.tail_cache.kv_cache.shape[2] == 8
    assert adapter_module.vllm_tail_ring(4, 2) == 8 and adapter_module.vllm_tail_ring(16, 0) == 16
    adapter = install(layer)
    assert adapter.plan.ring == 8
    adapter.uninstall()


@needs_vllm
def test_a_failed_check_names_vllms_attribute(monkeypatch):
    layer = build_layer(monkeypatch, **SUPPORTED)
    mla = layer.attention.mla_attn.mla_attn
    monkeypatch.setattr(mla, "kv_cache_dtype", "auto")
    monkeypatch.setattr(layer.attention.indexer, "index_kpool_compress_gate", None)
    with pytest.raises(ValueError) as error:
        install(layer)
    message = str(error.value)
    assert "an FP8 KV cache (str(mla.kv_cache_dtype)" in message, message
    assert "w.indexer.index_kpool_compress_gate (index_compress_gate)" in message, message


def decode_context(layer, requests, positions):
    """vLLM's forward context of a pure decode step: one token per request
    at these positions, its metadata in vLLM's classes, the tail slots from
    vLLM's compute_kpool_tail_slot_mapping (its CPU path)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import FlashInferMLASparseSM90Metadata
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadata, compute_kpool_tail_slot_mapping

    m = len(requests)
    attention = layer.attention
    mla, indexer = attention.mla_attn.mla_attn, attention.indexer
    rows = torch.tensor(requests, dtype=torch.int32)
    position = torch.tensor(positions, dtype=torch.int64)
    block_table = torch.arange(1, 1 + 2 * 2, dtype=torch.int32).view(2, 2)  # 2 requests x 2 blocks, block 0 null
    slots = torch.tensor(
        [int(block_table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for r, p in zip(requests, positions)]
    )
    ring = indexer.tail_cache.kv_cache.shape[2]
    tail_table = torch.tensor([[5], [3]], dtype=torch.int32)  # each request's own tail block
    query_start = torch.arange(m + 1, dtype=torch.int32)
    order = sorted(range(m), key=lambda t: requests[t])  # vLLM orders a step's tokens by request
    assert order == list(range(m)), "decode_context takes tokens in request order"
    tail_slots = compute_kpool_tail_slot_mapping(
        torch.zeros(m, dtype=torch.int64), tail_table, query_start, position, m, len(requests), ring
    )
    fields = {f.name for f in dataclasses.fields(FlashInferMLASparseSM90Metadata)}
    given = dict(
        num_reqs=m,
        max_query_len=1,
        max_seq_len=max(positions) + 1,
        num_actual_tokens=m,
        query_start_loc=query_start,
        slot_mapping=slots,
        num_decodes=m,
        num_decode_tokens=m,
        num_prefills=0,
        block_table=block_table,
        req_id_per_token=torch.cat([rows, torch.full((16 - m,), -1, dtype=torch.int32)]),
        block_size=BLOCK_SIZE,
    )
    required = [
        f.name
        for f in dataclasses.fields(FlashInferMLASparseSM90Metadata)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.init
    ]
    absent = [name for name in required if name not in given]
    metadata = FlashInferMLASparseSM90Metadata(
        **{k: v for k, v in given.items() if k in fields}, **{name: None for name in absent}
    )
    tail_metadata = DeepseekV32IndexerMetadata(
        seq_lens=position + 1,
        max_seq_len=max(positions) + 1,
        slot_mapping=tail_slots,
        num_decodes=m,
        num_decode_tokens=m,
        num_prefills=0,
        num_prefill_tokens=0,
        positions=position,
    )
    attn_metadata = {mla.layer_name: metadata, indexer.tail_cache.prefix: tail_metadata}
    context = set_forward_context(attn_metadata, layer.vllm_config, num_tokens=m, slot_mapping={mla.layer_name: slots})
    return context, SimpleNamespace(
        metadata=metadata, tail_slots=tail_slots, tail_table=tail_table, positions=position, slots=slots
    )


@needs_vllm
def test_step_inputs_from_vllms_forward_context_and_the_tail_ring(monkeypatch):
    layer = build_layer(monkeypatch, **SUPPORTED)
    adapter = install(layer)
    attention = layer.attention
    mla, indexer = attention.mla_attn.mla_attn, attention.indexer
    tail = indexer.tail_cache.kv_cache
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        tail.copy_(torch.randn(tail.shape, generator=generator).to(tail.dtype))
    before = tail.clone()
    requests, positions = [0, 1], [301, 206]
    context, step = decode_context(layer, requests, positions)
    hidden = torch.zeros(2, SMALL["hidden_size"], dtype=torch.bfloat16)
    with context:
        inputs = adapter_module.vllm_step_inputs(adapter, step.positions, hidden)
    assert inputs is not None
    assert (inputs.num_actual_tokens, inputs.num_decode_tokens) == (2, 2)
    assert inputs.token_requests.tolist() == requests
    assert inputs.slot_mapping is step.slots and inputs.kv_cache is mla.kv_cache
    assert inputs.indexer.block_table is step.metadata.block_table
    k_cache = inputs.indexer.k_cache
    assert tuple(k_cache.shape) == (NUM_BLOCKS, BLOCK_SIZE // 4 * 132) and same_memory(
        k_cache, indexer.k_cache.kv_cache
    )
    assert k_cache.stride() == indexer.k_cache.kv_cache.stride()[:1] + (1,)
    # The tail slots vLLM computed: each token's own tail block * ring + pos % ring.
    ring = tail.shape[2]
    assert step.tail_slots.tolist() == [5 * ring + 301 % ring, 3 * ring + 206 % ring]
    # The conversion: the step's requests' tail blocks in their block-table rows...
    inputs.before()
    rows = adapter.tail_ring.rows
    assert tuple(rows.shape) == (2, 2, ring, 128) and rows.is_contiguous()
    assert torch.equal(rows[0], before[5]) and torch.equal(rows[1], before[3])
    # ... and back after the stage wrote them; no other tail block changes.
    with torch.no_grad():
        rows[0, 0, 301 % ring] = 1.5
        rows[1, 1, 206 % ring] = -2.0
    inputs.after()
    expected = before.clone()
    expected[5, 0, 301 % ring] = 1.5
    expected[3, 1, 206 % ring] = -2.0
    assert torch.equal(tail, expected)
    adapter.uninstall()


@needs_vllm
def test_the_installed_forward_runs_stock_outside_a_decode_step(monkeypatch):
    """No forward context (a profile run): vllm_step_inputs answers None and
    vLLM's own forward runs, with the adapter installed."""
    layer = build_layer(monkeypatch, **SUPPORTED)
    adapter = install(layer)
    calls = []
    monkeypatch.setattr(adapter, "stock", lambda *args: calls.append(args) or "stock")
    hidden = torch.zeros(1, SMALL["hidden_size"], dtype=torch.bfloat16)
    assert adapter_module.vllm_step_inputs(adapter, torch.zeros(1, dtype=torch.int64), hidden) is None
    assert layer.attention.mla_attn.forward(torch.zeros(1, dtype=torch.int64), hidden) == "stock"
    assert len(calls) == 1
    adapter.uninstall()


class WritingStage(RecordingStage):
    """A stand-in for the stage's forward on the CPU: records its arguments,
    writes a known output and stashes into the ring rows it was given, as
    the stage's prepare step does for each token (slot pos % ring)."""

    def __init__(self, config, weights, plan):
        super().__init__(config, weights, plan)
        self.calls = []

    def forward(self, args):
        self.calls.append(args)
        args.out.fill_(0.25)
        for t in range(args.hidden.shape[0]):
            row, slot = int(args.token_requests[t]), int(args.positions[t]) % args.indexer.ring.shape[2]
            args.indexer.ring[row, :, slot] = float(t + 1)


@needs_vllm
def test_the_installed_forward_under_vllms_forward_context(monkeypatch):
    """w.forward as vLLM's model calls it, in vLLM's forward context: the
    step's tensors reach the stage, the output is the stage's, and what the
    stage stashed in its ring rows lands in vLLM's tail blocks."""
    layer = build_layer(monkeypatch, **SUPPORTED)
    adapter = adapter_module.install(layer.attention, stage_factory=WritingStage)
    indexer = layer.attention.indexer
    tail = indexer.tail_cache.kv_cache
    before = tail.clone()
    requests, positions = [0, 1], [301, 206]
    context, step = decode_context(layer, requests, positions)
    hidden = torch.ones(2, SMALL["hidden_size"], dtype=torch.bfloat16)
    with context:
        out = layer.attention(hidden, step.positions)  # Glm5NextMLAAttention.forward -> w.forward
    (args,) = adapter.stage.calls
    assert args.hidden is hidden and args.positions is step.positions and args.out is out
    assert args.token_requests.tolist() == requests and args.slot_mapping is step.slots
    assert args.kv_cache is layer.attention.mla_attn.mla_attn.kv_cache
    assert args.indexer.ring is adapter.tail_ring.rows
    assert tuple(out.shape) == (2, SMALL["hidden_size"]) and bool((out == 0.25).all())
    ring = tail.shape[2]
    expected = before.clone()
    expected[5, :, 301 % ring] = 1.0  # request 0's tail block
    expected[3, :, 206 % ring] = 2.0  # request 1's
    assert torch.equal(tail, expected)
    adapter.uninstall()


# --- vLLM's DeepSeek-V3.2 / GLM-5 attention module (DeepseekV2MLAAttention) -------------------------------------------

# Scaled-down DeepSeek-V3.2 and GLM-5 layers: the presets' per-head sizes and
# rotaries (P 128 / 192, R 64, V 128 / 256, L 512, index dim 128), 4 heads,
# D 256, Q 512, 16 / 32 index heads; the rotary fields as their config.json
# give them (transformers 5's rope_parameters).
ROPE_SMALL = {
    "dsv32": dict(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=512,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        index_n_heads=16,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        architectures=["DeepseekV32ForCausalLM"],
    ),
    "glm5": dict(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=512,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=32,
        max_position_embeddings=202752,
        rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        # A GLM-5 checkpoint field transformers' config does not declare; vLLM reads it.
        indexer_rope_interleave=True,
        architectures=["GlmMoeDsaForCausalLM"],
    ),
}
ROPE_COMMON = dict(
    num_hidden_layers=1,
    vocab_size=128,
    pad_token_id=0,
    index_head_dim=128,
    index_topk=2048,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=64,
    intermediate_size=128,
    first_k_dense_replace=1,
)
ROPE_BLOCK = 64  # vLLM's KV block for V3.2 (FlashMLA's pages)


def rope_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.FLASHMLA_SPARSE


def build_rope_layer(monkeypatch, model):
    """vLLM's DeepseekV2MLAAttention of a DeepSeek-V3.2 or GLM-5 layer as its
    decoder layer builds it (models/deepseek_v2.py; GlmMoeDsaForCausalLM is
    DeepseekV2ForCausalLM), with the backend vLLM's CUDA platform picks on
    SM90 for a quantized cache of head size 576 (FLASHMLA_SPARSE, which
    canonicalizes the cache dtype "fp8" to "fp8_ds_mla"), weights loaded
    through vLLM's loaders and processed, caches bound by vLLM's code."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker import workspace

    cls = DeepseekV32Config if model == "dsv32" else GlmMoeDsaConfig
    hf = cls(**ROPE_COMMON, **ROPE_SMALL[model])
    vllm_config, model_config = small_vllm_config(monkeypatch, hf, f"{model}-small-", ROPE_BLOCK)
    backend = rope_backend()
    monkeypatch.setattr(current_platform, "get_attn_backend_cls", lambda *args, **kwargs: backend.get_path())
    config = model_config.hf_text_config
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
        World.init(vllm_config)
        if workspace._manager is None:  # the model runner's, which FlashMLA's impl reserves from
            workspace.init_workspace_manager(torch.device("cpu"))
        attention = DeepseekV2MLAAttention(
            **mla_attention_kwargs(vllm_config, config),
        )
    layer = SimpleNamespace(attention=attention, vllm_config=vllm_config, config=config, hf=hf, model=model)
    load_weights(layer)
    bind_caches(layer)
    return layer


def rope_install(layer, **kwargs):
    return adapter_module.install(layer.attention, stage_factory=RecordingStage, indexer_keys="hadamard", **kwargs)


@needs_vllm
@pytest.mark.parametrize("model", ["dsv32", "glm5"])
def test_vllms_rope_layer_is_what_the_adapter_reads(monkeypatch, model):
    layer = build_rope_layer(monkeypatch, model)
    w = layer.attention.mla_attn
    mla, indexer = w.mla_attn, w.indexer
    # FLASHMLA_SPARSE took the quantized cache as fp8_ds_mla: 656-byte entries.
    assert mla.attn_backend.get_name() in adapter_module.ROPE_KV_CACHE_BACKENDS
    assert mla.kv_cache_dtype == adapter_module.ROPE_KV_CACHE_DTYPE
    assert tuple(mla.kv_cache.shape) == (NUM_BLOCKS, ROPE_BLOCK, 656) and mla.kv_cache.dtype == torch.uint8
    # DeepSeek-V3.2's indexer: a key per token, 132 bytes, no pools or ring.
    assert tuple(indexer.k_cache.kv_cache.shape) == (NUM_BLOCKS, ROPE_BLOCK, 132)
    assert not hasattr(indexer, "tail_cache") and not hasattr(indexer, "index_kpool_compress_gate")
    # The rotaries: vLLM's classes, styles and tables.
    yarn = model == "dsv32"
    assert type(w.rotary_emb).__name__ == ("DeepseekScalingRotaryEmbedding" if yarn else "RotaryEmbedding")
    assert w.rotary_emb.is_neox_style is False
    assert w.indexer_rope_emb.is_neox_style is (model == "dsv32")  # not indexer_rope_interleave
    assert tuple(w.rotary_emb.cos_sin_cache.shape) == ((163840 if yarn else 202752), 64)
    # vLLM norms q_c and kv_c apart (no fused norm on this module): the stage's one launch computes the same two.
    assert w.fuse_qkv_rmsnorm is False
    assert w.q_a_layernorm.variance_epsilon == w.kv_a_layernorm.variance_epsilon
    # The softmax scale of the rotary.
    assert mla.scale == pytest.approx(dsa_decode.rope_softmax_scale(dsa_decode.rope_preset_config(model), 192 if yarn else 256))


@needs_vllm
@pytest.mark.parametrize("model", ["dsv32", "glm5"])
def test_install_on_vllms_rope_layer_maps_its_rotaries(monkeypatch, model):
    layer = build_rope_layer(monkeypatch, model)
    w = layer.attention.mla_attn
    mla, indexer = w.mla_attn, w.indexer
    stock = w.forward
    adapter = rope_install(layer)
    assert adapter.installed and adapter.rope
    config = adapter.config
    small = ROPE_SMALL[model]
    assert (config.hidden_size, config.num_heads, config.q_lora_rank, config.kv_lora_rank) == (256, 4, 512, 512)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (
        small["qk_nope_head_dim"], 64, small["v_head_dim"])
    assert config.kv_cache_dtype == "fp8_ds_mla" and config.rotary_embedding and config.fuse_qkv_rmsnorm
    assert config.softmax_scale == mla.scale
    # vLLM's rotaries are the presets' (rope_preset_config: the sources in docs/rope.md).
    assert config.rope == dsa_decode.rope_preset_config(model, "attention")
    assert config.indexer_rope == dsa_decode.rope_preset_config(model, "indexer")
    # The unpooled indexer's plan: vLLM's block, no ring, max_model_len.
    plan = adapter.plan
    assert (plan.indexer_heads, plan.indexer_pool, plan.indexer_topk) == (small["index_n_heads"], 1, 2048)
    assert (plan.ring, plan.block_size, plan.max_context) == (1, ROPE_BLOCK, MAX_MODEL_LEN)
    # Weights in place (no static scales, gate or ape), W_UV copied once.
    weights = adapter.weights
    assert sorted(weights) == sorted(set(dsa_decode.WEIGHT_NAMES) - set(adapter_module.ROPE_UNREAD_WEIGHTS))
    assert weights["fused_qkv_a_proj"] is w.fused_qkv_a_proj.weight
    assert tuple(weights["fused_qkv_a_proj"].shape) == (512 + 512 + 64, 256)
    assert tuple(weights["q_b_proj"].shape) == (4 * (small["qk_nope_head_dim"] + 64), 512)
    assert weights["w_uk_t"] is mla.W_UK_T and weights["w_uv"].is_contiguous()
    fused = indexer.wk_weights_proj.weight
    assert weights["index_wk"].data_ptr() == fused.data_ptr()
    assert tuple(weights["index_weights_proj"].shape) == (small["index_n_heads"], 256)
    # The library's checks take every one of vLLM's tensors but for its device.
    error = adapter.stage.library_error
    head = "invalid argument: DSA attention stage needs valid weights and plan: "
    assert error is not None and error.startswith(head), error
    complaints = error[len(head) :].split("; ")
    assert len(complaints) == len(weights) and all(" expected a CUDA tensor, got " in c for c in complaints), error
    adapter.uninstall()
    assert w.forward == stock


@needs_vllm
def test_vllms_rope_layer_needs_the_indexer_keys_basis(monkeypatch):
    layer = build_rope_layer(monkeypatch, "dsv32")
    w = layer.attention.mla_attn
    stock = w.forward
    with pytest.raises(ValueError) as error:
        adapter_module.install(layer.attention, stage_factory=RecordingStage)
    message = str(error.value)
    assert message.startswith("DSA attention stage needs the indexer's keys in the stage's basis"), message
    assert "indexer_keys='hadamard'" in message and "indexer_k_quant_and_cache" in message, message
    assert w.forward == stock


@needs_vllm
def test_a_rotary_the_stage_does_not_compute_is_named(monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    layer = build_rope_layer(monkeypatch, "glm5")
    w = layer.attention.mla_attn
    # vLLM's linear scaling: no RopeConfig expresses it.
    with set_current_vllm_config(layer.vllm_config):
        linear = get_rope(64, 4096, False, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    monkeypatch.setattr(w, "rotary_emb", linear)
    # An indexer rotary whose table is not the one its attributes give.
    monkeypatch.setattr(w.indexer_rope_emb, "base", 20000.0)
    with pytest.raises(ValueError) as error:
        rope_install(layer)
    message = str(error.value)
    assert "a rotary the stage computes (w.rotary_emb: DeepseekScalingRotaryEmbedding or RotaryEmbedding, got " \
        "LinearScalingRotaryEmbedding)" in message, message
    assert "w.indexer_rope_emb.cos_sin_cache" in message and "theta=20000.0" in message, message


@needs_vllm
def test_vllms_rope_layer_with_an_unquantized_cache_is_refused(monkeypatch):
    layer = build_rope_layer(monkeypatch, "dsv32")
    mla = layer.attention.mla_attn.mla_attn
    monkeypatch.setattr(mla, "kv_cache_dtype", "auto")
    with pytest.raises(ValueError) as error:
        rope_install(layer)
    message = str(error.value)
    assert "an FP8 KV cache of DeepSeek-V3.2's 656-byte entries (str(mla.kv_cache_dtype) == 'fp8_ds_mla')" in message


def rope_decode_context(layer, requests, positions):
    """vLLM's forward context of a pure decode step of a RoPE layer: one token
    per request, FlashMLA's sparse metadata class."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata

    m = len(requests)
    mla = layer.attention.mla_attn.mla_attn
    rows = torch.tensor(requests, dtype=torch.int32)
    position = torch.tensor(positions, dtype=torch.int64)
    block_table = torch.arange(1, 1 + 2 * 2, dtype=torch.int32).view(2, 2)
    slots = torch.tensor(
        [int(block_table[r, p // ROPE_BLOCK]) * ROPE_BLOCK + p % ROPE_BLOCK for r, p in zip(requests, positions)]
    )
    given = dict(
        num_reqs=m,
        max_query_len=1,
        max_seq_len=max(positions) + 1,
        num_actual_tokens=m,
        query_start_loc=torch.arange(m + 1, dtype=torch.int32),
        slot_mapping=slots,
        num_decodes=m,
        num_decode_tokens=m,
        num_prefills=0,
        block_table=block_table,
        req_id_per_token=torch.cat([rows, torch.full((16 - m,), -1, dtype=torch.int32)]),
        block_size=ROPE_BLOCK,
    )
    fields = {f.name for f in dataclasses.fields(FlashMLASparseMetadata)}
    required = [
        f.name
        for f in dataclasses.fields(FlashMLASparseMetadata)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.init
    ]
    metadata = FlashMLASparseMetadata(
        **{k: v for k, v in given.items() if k in fields}, **{name: None for name in required if name not in given}
    )
    context = set_forward_context(
        {mla.layer_name: metadata}, layer.vllm_config, num_tokens=m, slot_mapping={mla.layer_name: slots}
    )
    return context, SimpleNamespace(metadata=metadata, positions=position, slots=slots)


@needs_vllm
def test_rope_step_inputs_from_vllms_forward_context(monkeypatch):
    layer = build_rope_layer(monkeypatch, "dsv32")
    adapter = rope_install(layer)
    w = layer.attention.mla_attn
    mla, indexer = w.mla_attn, w.indexer
    context, step = rope_decode_context(layer, [0, 1], [101, 70])
    hidden = torch.zeros(2, 256, dtype=torch.bfloat16)
    with context:
        inputs = adapter_module.vllm_step_inputs(adapter, step.positions, hidden)
    assert inputs is not None and inputs.before is None and inputs.after is None
    assert (inputs.num_actual_tokens, inputs.num_decode_tokens) == (2, 2)
    assert inputs.token_requests.tolist() == [0, 1] and inputs.slot_mapping is step.slots
    assert inputs.kv_cache is mla.kv_cache and inputs.indexer.block_table is step.metadata.block_table
    assert inputs.indexer.ring is None
    k_cache = inputs.indexer.k_cache
    assert tuple(k_cache.shape) == (NUM_BLOCKS, ROPE_BLOCK * 132) and same_memory(k_cache, indexer.k_cache.kv_cache)
    adapter.uninstall()


class RopeWritingStage(RecordingStage):
    def __init__(self, config, weights, plan):
        super().__init__(config, weights, plan)
        self.calls = []

    def forward(self, args):
        self.calls.append(args)
        args.out.fill_(0.5)


@needs_vllm
def test_the_installed_forward_of_a_rope_layer_under_vllms_forward_context(monkeypatch):
    layer = build_rope_layer(monkeypatch, "glm5")
    adapter = adapter_module.install(layer.attention, stage_factory=RopeWritingStage, indexer_keys="hadamard")
    context, step = rope_decode_context(layer, [0, 1], [101, 70])
    hidden = torch.ones(2, 256, dtype=torch.bfloat16)
    with context:
        out = layer.attention(step.positions, hidden, None)  # DeepseekV2MLAAttention.forward -> w.forward
    (args,) = adapter.stage.calls
    assert args.hidden is hidden and args.positions is step.positions and args.out is out
    assert args.kv_cache is layer.attention.mla_attn.mla_attn.kv_cache and args.indexer.ring is None
    assert tuple(out.shape) == (2, 256) and bool((out == 0.5).all())
    adapter.uninstall()
