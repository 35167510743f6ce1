"""Builds and loads the peers of issue 37 from their own sources.

The source trees come from .deps/peers/ (scripts/fetch-peers: compressed
tarballs at pinned commits, listed in .deps/peers/MANIFEST); they are unpacked
on the GPU machine into DSA_PEERS_SRC (default /tmp/dsa-peers-src). Each peer
is a torch extension of ours (bench/peers/<peer>/: a binding and, where
needed, small stand-ins), compiled with torch.utils.cpp_extension from the
peer's own files for sm_90a only:

  flashmla   FlashMLA's SM90 sparse FP8 decode (its MODEL1 and V32 instantiations, the
             scheduler-metadata and combine kernels) behind FlashMLA's own host
             interface; used through FlashMLA's Python interface
             (flash_mla/flash_mla_interface.py).
  deepgemm   DeepGEMM's attention and runtime APIs (host code); DeepGEMM
             compiles its kernels itself at run time through NVCC (its JIT),
             into DG_JIT_CACHE_DIR = .deps/peers-build/deepgemm-jit.
  vllm_topk  vLLM's csrc/cooperative_topk.cu (the decode top-k vLLM picks on
             SM90 for up to 64 rows of top-512), as torch.ops.dsa_peer_vllm.

FlashInfer (the attention vLLM 0.33 serves glm5next with on Hopper) is not
built here: .deps/peers/flashinfer.tar.xz (bench/peers/flashinfer_pack.py, run
by scripts/fetch-peers) holds its released Python package, its fa3 MLA module
compiled ahead of time for sm_90a and apache-tvm-ffi; load_flashinfer() puts
them on sys.path and FlashInfer loads its module as it loads any AOT module.

Built modules are kept in .deps/peers-build/ (DSA_PEERS_BUILD) with a stamp
of what they were built from (tarball hashes, our binding files, flags, torch
and CUDA versions): a later call that carries .deps loads them instead of
rebuilding. Run as a script to build one peer in its own process:
  python3 bench/peers/peers.py build flashmla|deepgemm|vllm_topk
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEPS = Path(os.environ.get("DSA_PEERS_DEPS", ROOT / ".deps" / "peers"))
BUILD = Path(os.environ.get("DSA_PEERS_BUILD", ROOT / ".deps" / "peers-build"))
SRC = Path(os.environ.get("DSA_PEERS_SRC", "/tmp/dsa-peers-src"))
ARCH_FLAG = "-gencode=arch=compute_90a,code=sm_90a"


def manifest() -> dict[str, dict[str, str]]:
    """.deps/peers/MANIFEST: tree name -> source, pin (commit or version), sha256."""
    path = DEPS / "MANIFEST"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run scripts/fetch-peers (on a machine with network)")
    trees = {}
    for line in path.read_text().splitlines():
        if line.strip():
            name, source, pin, sha = line.split("\t")
            trees[name] = {"source": source, "pin": pin, "sha256": sha}
    return trees


def unpack(name: str) -> Path:
    """The unpacked tree of .deps/peers/<name>.tar.gz under SRC/<name> (unpacked once per tarball hash)."""
    sha = manifest()[name]["sha256"]
    dest = SRC / name
    stamp = dest / ".dsa-peers-sha256"
    if stamp.exists() and stamp.read_text() == sha:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    tarball = next((DEPS / f"{name}{ext}" for ext in (".tar.gz", ".tar.xz") if (DEPS / f"{name}{ext}").exists()), None)
    if tarball is None:
        raise FileNotFoundError(f"{DEPS}/{name}.tar.gz (or .tar.xz) missing: run scripts/fetch-peers")
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(dest)
    stamp.write_text(sha)
    return dest


def cuda_home() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent)
    return "/usr/local/cuda"


@dataclass
class Spec:
    """One extension: its module name, its trees and how it is compiled."""

    peer: str
    module: str
    trees: list[str]
    python_module: bool = True
    sources: list[Path] = field(default_factory=list)
    includes: list[Path] = field(default_factory=list)
    cflags: list[str] = field(default_factory=list)
    cuda_cflags: list[str] = field(default_factory=list)
    ldflags: list[str] = field(default_factory=list)
    ours: list[Path] = field(default_factory=list)  # our files compiled in (their bytes go into the stamp)


def spec(peer: str) -> Spec:
    if peer == "flashmla":
        src, cutlass = unpack("flashmla"), unpack("flashmla-cutlass")
        csrc = src / "csrc"
        ours = [HERE / "flashmla" / "binding.cpp", HERE / "flashmla" / "left_out.cpp"]
        # FlashMLA's setup.py flags for its nvcc compiles, less the diagnostics-only
        # ones (-lineinfo, --source-in-ptx, ptxas -v and its warnings); SM90a only.
        return Spec(
            peer,
            "flash_mla_cuda",
            ["flashmla", "flashmla-cutlass"],
            sources=ours
            + [
                csrc / "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
                csrc / "smxx/decode/combine/combine.cu",
                csrc / "sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
                csrc / "sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu",
                # The V3.2 format (d_qk 576, 656-byte entries): the rows `sparse_mla dsv32 vs FlashMLA V32`.
                csrc / "sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
                csrc / "sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
            ],
            includes=[csrc, csrc / "kerutils/include", csrc / "sm90", cutlass / "include", cutlass / "tools/util/include"],
            cflags=["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"],
            cuda_cflags=[
                "-O3",
                "-std=c++20",
                "-DNDEBUG",
                "-D_USE_MATH_DEFINES",
                "-Wno-deprecated-declarations",
                "-U__CUDA_NO_HALF_OPERATORS__",
                "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_HALF2_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "--expt-relaxed-constexpr",
                "--expt-extended-lambda",
                "--use_fast_math",
                "--ptxas-options=--register-usage-level=10",
                ARCH_FLAG,
            ],
            ours=ours,
        )
    if peer == "deepgemm":
        src, cutlass, fmt = unpack("deepgemm"), unpack("deepgemm-cutlass"), unpack("deepgemm-fmt")
        home = cuda_home()
        ours = [HERE / "deepgemm" / "binding.cpp"]
        # DeepGEMM's setup.py: C++17, its include dirs, cudart and nvrtc.
        return Spec(
            peer,
            "deep_gemm_C",
            ["deepgemm", "deepgemm-cutlass", "deepgemm-fmt"],
            sources=ours,
            includes=[
                src / "csrc",
                Path(home) / "include",
                Path(home) / "include" / "cccl",
                src / "deep_gemm" / "include",
                cutlass / "include",
                fmt / "include",
            ],
            cflags=["-std=c++17", "-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations"],
            ldflags=[f"-L{home}/lib64", "-lcudart", "-lnvrtc"],
            ours=ours,
        )
    if peer == "vllm_topk":
        src = unpack("vllm-topk")
        ours = [HERE / "vllm_topk" / "binding.cpp", HERE / "vllm_topk" / "torch_utils.h"]
        # vLLM compiles it with torch's own nvcc flags (which cpp_extension adds)
        # for 9.0a, and USE_CUDA for the stable C shim's CUDA calls.
        return Spec(
            peer,
            "dsa_peer_vllm_topk",
            ["vllm-topk"],
            python_module=False,
            sources=[HERE / "vllm_topk" / "binding.cpp", src / "csrc" / "cooperative_topk.cu"],
            includes=[HERE / "vllm_topk", src / "csrc"],
            cflags=["-O3", "-std=c++17", "-DNDEBUG", "-DUSE_CUDA"],
            cuda_cflags=["-O3", "-std=c++17", "-DNDEBUG", "-DUSE_CUDA", "--expt-relaxed-constexpr", ARCH_FLAG],
            ours=ours,
        )
    raise ValueError(f"unknown peer {peer!r} (flashmla, deepgemm, vllm_topk)")


PEERS = ("flashmla", "deepgemm", "vllm_topk")


def stamp_of(s: Spec) -> str:
    import torch

    trees = manifest()
    h = hashlib.sha256()
    for t in s.trees:
        h.update(f"{t}={trees[t]['sha256']};".encode())
    for f in s.ours:
        h.update(f.name.encode() + f.read_bytes())
    h.update(json.dumps([s.module, s.cflags, s.cuda_cflags, s.ldflags, [str(x) for x in s.sources]]).encode())
    h.update(f"torch={torch.__version__};cuda={torch.version.cuda};nvcc={nvcc_version()}".encode())
    return h.hexdigest()


def nvcc_version() -> str:
    try:
        out = subprocess.run([str(Path(cuda_home()) / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
        return out.stdout.strip().splitlines()[-1]
    except OSError:
        return "none"


def built_path(s: Spec) -> Path:
    return BUILD / f"{s.module}.so"


def is_current(s: Spec) -> bool:
    stamp = BUILD / f"{s.module}.stamp"
    return built_path(s).exists() and stamp.exists() and stamp.read_text() == stamp_of(s)


def build(peer: str, verbose: bool = True) -> Path:
    """Compiles one peer into BUILD/<module>.so (unless current); returns its path."""
    s = spec(peer)
    if is_current(s):
        return built_path(s)
    from torch.utils import cpp_extension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    build_dir = SRC / "build" / s.module
    if build_dir.exists():
        shutil.rmtree(build_dir)
    build_dir.mkdir(parents=True)
    t0 = time.time()
    cpp_extension.load(
        name=s.module,
        sources=[str(x) for x in s.sources],
        extra_cflags=s.cflags,
        extra_cuda_cflags=s.cuda_cflags,
        extra_ldflags=s.ldflags,
        extra_include_paths=[str(x) for x in s.includes],
        build_directory=str(build_dir),
        verbose=verbose,
        is_python_module=s.python_module,
        with_cuda=True,
    )
    BUILD.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build_dir / f"{s.module}.so", built_path(s))
    (BUILD / f"{s.module}.stamp").write_text(stamp_of(s))
    print(f"[peers] built {peer} in {time.time() - t0:.0f} s -> {built_path(s)}", flush=True)
    return built_path(s)


def build_all(peers=PEERS) -> dict[str, str]:
    """Builds the stale peers, each in its own process, all at once. Returns peer -> error ('' = ready)."""
    errors, procs = {}, {}
    for p in peers:
        try:
            if is_current(spec(p)):
                errors[p] = ""
                continue
        except Exception as e:  # a missing tree
            errors[p] = f"{type(e).__name__}: {e}"
            continue
        (SRC / "logs").mkdir(parents=True, exist_ok=True)
        log = open(SRC / "logs" / f"build_{p}.log", "w")
        procs[p] = (subprocess.Popen([sys.executable, __file__, "build", p], stdout=log, stderr=subprocess.STDOUT), log)
    for p, (proc, log) in procs.items():
        rc = proc.wait()
        log.close()
        if rc == 0:
            errors[p] = ""
        else:
            tail = Path(log.name).read_text().splitlines()[-15:]
            errors[p] = f"build failed (exit {rc}): " + " | ".join(x.strip() for x in tail if x.strip())[-1500:]
    return errors


def _load_module(name: str, path: Path):
    spec_ = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    return module


def load_flashmla():
    """FlashMLA's Python interface module, over our build of its sparse decode."""
    import torch  # noqa: F401  (the extension needs torch's libraries loaded)

    s = spec("flashmla")
    ext = _load_module(s.module, built_path(s))
    sys.modules["flash_mla.cuda"] = ext
    pkg = str(unpack("flashmla"))
    if pkg not in sys.path:
        sys.path.insert(0, pkg)
    import flash_mla.flash_mla_interface as interface

    return interface


def load_deepgemm():
    """Our DeepGEMM module, initialized for its JIT (headers, CUDA, cache dir)."""
    import torch  # noqa: F401

    s = spec("deepgemm")
    ext = _load_module(s.module, built_path(s))
    # DeepGEMM's library root: include/ holding deep_gemm/, cute/ and cutlass/,
    # as its setup.py arranges the installed package.
    src, cutlass = unpack("deepgemm"), unpack("deepgemm-cutlass")
    root = SRC / "deepgemm-root"
    inc = root / "include"
    inc.mkdir(parents=True, exist_ok=True)
    for name, target in (
        ("deep_gemm", src / "deep_gemm" / "include" / "deep_gemm"),
        ("cute", cutlass / "include" / "cute"),
        ("cutlass", cutlass / "include" / "cutlass"),
    ):
        link = inc / name
        if not link.exists():
            link.symlink_to(target)
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(BUILD / "deepgemm-jit"))
    ext.init(str(root), cuda_home())
    return ext


def load_vllm_topk():
    """torch.ops.dsa_peer_vllm (cooperative_topk)."""
    import torch

    s = spec("vllm_topk")
    torch.ops.load_library(str(built_path(s)))
    return torch.ops.dsa_peer_vllm


FLASHINFER_PACK = "flashinfer"  # .deps/peers/flashinfer.tar.xz


def load_flashinfer():
    """FlashInfer's BatchMLAPagedAttentionWrapper, from the carried package, with its fa3 module
    (BF16 q, FP8 e4m3 KV, ckv 512, kpe 0, int32 indices) loaded. Returns a namespace: Wrapper,
    version, commit, module (its JIT name), prebuilt (True: the module compiled by fetch-peers;
    False: FlashInfer JIT-compiled it here from the carried headers, the prebuilt one having
    failed to load: the log says why)."""
    import types

    import torch

    root = unpack(FLASHINFER_PACK)
    info = json.loads((root / "flashinfer-pack.json").read_text())
    site, deps = str(root / "site"), str(root / "deps")
    # Before FlashInfer's first import: its JIT workspace (module names, generated sources, a
    # compile should one be needed) and tvm-ffi's cache in the scratch folder, not in $HOME.
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(SRC / "flashinfer-workspace"))
    os.environ.setdefault("TVM_FFI_CACHE_DIR", str(SRC / "tvm-ffi-cache"))
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("FLASHINFER_LOGGING_LEVEL", "warning")
    if site not in sys.path:
        sys.path.insert(0, site)  # FlashInfer and tvm-ffi: ours
    if deps not in sys.path:
        sys.path.append(deps)  # small pure dependencies: the machine's own copies first
    import flashinfer
    from flashinfer.jit import env as jit_env
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    from flashinfer.mla._batch_mla._backends._fa_common import get_batch_mla_module

    if not str(Path(flashinfer.__file__).resolve()).startswith(str(Path(site).resolve())):
        raise RuntimeError(f"flashinfer imported from {flashinfer.__file__}, not the carried {site}")
    if flashinfer.__version__ != info["flashinfer"]:
        raise RuntimeError(f"flashinfer {flashinfer.__version__} imported, packed {info['flashinfer']}")
    name = info["module"]
    jit_so = jit_env.FLASHINFER_JIT_DIR / name / f"{name}.so"
    jit_before = jit_so.exists() and jit_so.stat().st_mtime
    # The function FlashInfer's fa3 plan() calls (lru-cached: plan() reuses what this loads).
    get_batch_mla_module("fa3", torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16, torch.int32, 512, 0, False)
    prebuilt = bool(jit_env.get_aot_artifacts(name)) and (jit_so.exists() and jit_so.stat().st_mtime) == jit_before
    return types.SimpleNamespace(
        Wrapper=BatchMLAPagedAttentionWrapper,
        version=flashinfer.__version__,
        commit=getattr(flashinfer, "__git_commit__", info.get("flashinfer_git_commit", "?")),
        module=name,
        prebuilt=prebuilt,
        info=info,
    )


def build_listing() -> dict[str, int]:
    """File -> size under BUILD (to tell whether a run built or JIT-compiled anything)."""
    if not BUILD.exists():
        return {}
    return {str(p.relative_to(BUILD)): p.stat().st_size for p in BUILD.rglob("*") if p.is_file()}


def pack_build(out: Path, before: dict[str, int]) -> list[Path]:
    """When BUILD changed since `before`: the changed parts (each module with its stamp, and
    DeepGEMM's JIT cache) as OUT/peers-build.tar.gz, unpacking to peers-build/... (into .deps/
    here, so that later calls carry and reuse them); split into OUT/peers-build-<part>.tar.gz
    when one file would pass the device tool's 16 MB a file. Few files: it returns at most 8."""
    now = build_listing()
    if now == before:
        return []
    out.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[str]] = {}
    for rel in now:
        if rel.startswith("deepgemm-jit/tmp/"):
            continue
        top = rel.split("/")[0]
        key = "deepgemm-jit" if top == "deepgemm-jit" else top.split(".")[0]
        parts.setdefault(key, []).append(rel)
    changed = {k: v for k, v in parts.items() if any(before.get(f) != now[f] for f in v)}

    def write(path: Path, keys) -> Path:
        with tarfile.open(path, "w:gz") as tar:
            for key in keys:
                for rel in sorted(changed[key]):
                    tar.add(BUILD / rel, arcname=f"peers-build/{rel}")
        return path

    one = write(out / "peers-build.tar.gz", sorted(changed))
    if one.stat().st_size <= 15 * 2**20:
        return [one]
    one.unlink()
    return [write(out / f"peers-build-{key}.tar.gz", [key]) for key in sorted(changed)]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        print(__doc__)
        sys.exit(2)
