"""Packs FlashInfer's SM90 sparse-MLA path for the GPU machine (run by scripts/fetch-peers).

The GPU machine is offline and the device tool carries at most 64 MiB, so the
released wheel (62 MB, 332 MB unpacked) cannot travel as it is. This script
takes the unpacked wheel and keeps what vLLM's FLASHINFER_MLA_SPARSE_SM90
backend runs (BatchMLAPagedAttentionWrapper, backend "fa3", BF16 query, FP8
e4m3 KV, head_dim_ckv 512, head_dim_kpe 0, int32 indices):

  site/flashinfer/          FlashInfer's Python package, unchanged, without its
                            data/ folder except:
    data/aot/<uri>/<uri>.so   the one JIT module that configuration loads,
                              compiled here ahead of time by FlashInfer's own
                              JIT machinery (its flags, its ninja file) for
                              sm_90a; FlashInfer loads data/aot/<uri>/<uri>.so
                              instead of compiling (jit/env.py get_aot_artifacts)
    data/csrc/batch_mla_config.jinja, batch_mla_sm90_{plan,run,binding}.cu
                              the sources its module generator copies when it
                              names the module (read before the AOT lookup)
    data/include, cutlass, cccl, spdlog: exactly the headers that compile read
                              (ninja's dependency record), so that FlashInfer can
                              JIT-compile the same module on the GPU machine should
                              the prebuilt one fail to load there (about 30 s)
  site/tvm_ffi/             apache-tvm-ffi (FlashInfer's FFI; a CPython 3.12 wheel)
  deps/                     small pure dependencies FlashInfer imports (packaging,
                            requests, tqdm, nvidia-ml-py, ...): appended to
                            sys.path, so the GPU machine's own copies win
  flashinfer-pack.json      versions, the module's name, the compiler, sizes

  python3 bench/peers/flashinfer_pack.py WHEEL_DIR TVM_FFI_WHEEL DEPS_WHEEL_DIR OUT.tar.xz

WHEEL_DIR is the unpacked flashinfer-python wheel; this python must import torch
and a tvm_ffi for itself (the build venv of scripts/fetch-peers). Nothing of
FlashInfer enters the repository: the tarball goes to .deps/peers/ (ignored).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

# What vLLM 0.33's FLASHINFER_MLA_SPARSE_SM90 plans for glm5next (flashinfer_mla_sparse_sm90.py):
# q_data_type bf16, kv_data_type float8_e4m3fn, output bf16, int32 indptr, ckv 512, kpe 0, no profiler.
MODULE_ARGS = dict(backend="fa3", q="bfloat16", kv="float8_e4m3fn", o="bfloat16", idx="int32", ckv=512, kpe=0)
CSRC_FILES = ("batch_mla_config.jinja", "batch_mla_sm90_plan.cu", "batch_mla_sm90_run.cu", "batch_mla_sm90_binding.cu")


def module_spec():
    """FlashInfer's JitSpec of the fa3 module (imports flashinfer: call after sys.path is set)."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_mla_module

    a = MODULE_ARGS
    return gen_batch_mla_module(
        a["backend"], getattr(torch, a["q"]), getattr(torch, a["kv"]), getattr(torch, a["o"]),
        getattr(torch, a["idx"]), a["ckv"], a["kpe"], False,
    )


def add_tree(tar: tarfile.TarFile, src: Path, arcname: str) -> None:
    """Adds src (file or folder) deterministically: sorted, owner 0, mtime 0."""
    paths = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    for p in paths:
        if "__pycache__" in p.parts or p.suffix == ".pyc":
            continue
        rel = arcname if src.is_file() else f"{arcname}/{p.relative_to(src).as_posix()}"
        info = tarfile.TarInfo(rel)
        data = p.read_bytes()
        info.size = len(data)
        info.mode = 0o755 if os.access(p, os.X_OK) else 0o644
        info.mtime = 0
        tar.addfile(info, io.BytesIO(data))


def unzip(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)


def main() -> int:
    if len(sys.argv) != 5:
        print(__doc__)
        return 2
    wheel_dir, tvm_wheel, deps_dir, out = (Path(x).resolve() for x in sys.argv[1:])
    work = Path(tempfile.mkdtemp(prefix="dsa-fi-pack-"))
    try:
        os.environ["FLASHINFER_WORKSPACE_BASE"] = str(work / "ws")
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "9.0a"
        os.environ.setdefault("MAX_JOBS", "2")
        sys.path.insert(0, str(wheel_dir))
        import flashinfer

        spec = module_spec()
        t0 = time.time()
        spec.build(verbose=False)
        build_s = time.time() - t0
        so = spec.jit_library_path
        if not so.exists():
            raise SystemExit(f"[flashinfer-pack] {so} was not built")
        print(f"[flashinfer-pack] built {spec.name} in {build_s:.0f} s ({so.stat().st_size} bytes)", flush=True)

        # The headers that compile read, from ninja's dependency record (paths in the wheel's data/).
        deps = subprocess.run(["ninja", "-t", "deps"], cwd=spec.build_dir, capture_output=True, text=True, check=True)
        data = (wheel_dir / "flashinfer" / "data").resolve()
        headers = sorted({
            Path(line.strip()).resolve() for line in deps.stdout.splitlines()
            if line.startswith("    ") and Path(line.strip()).resolve().is_relative_to(data)
        })
        if len(headers) < 50:
            raise SystemExit(f"[flashinfer-pack] only {len(headers)} headers in ninja's record: not a full compile")

        site = work / "site"
        shutil.copytree(wheel_dir / "flashinfer", site / "flashinfer", ignore=shutil.ignore_patterns("data", "__pycache__"))
        for h in headers:
            dst = site / "flashinfer" / "data" / h.relative_to(data)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(h, dst)
        for name in CSRC_FILES:
            dst = site / "flashinfer" / "data" / "csrc" / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(data / "csrc" / name, dst)
        aot = site / "flashinfer" / "data" / "aot" / spec.name
        aot.mkdir(parents=True)
        shutil.copy2(so, aot / f"{spec.name}.so")
        for d in wheel_dir.glob("flashinfer_python-*.dist-info"):
            shutil.copytree(d, site / d.name)
        unzip(tvm_wheel, site)
        depdir = work / "deps"
        wheels = sorted(deps_dir.glob("*.whl"))
        for w in wheels:
            unzip(w, depdir)

        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        info = {
            "flashinfer": flashinfer.__version__,
            "flashinfer_git_commit": getattr(flashinfer, "__git_commit__", "?"),
            "module": spec.name,
            "module_args": MODULE_ARGS,
            "arch": "sm_90a",
            "nvcc": nvcc,
            "tvm_ffi_wheel": tvm_wheel.name,
            "deps_wheels": [w.name for w in wheels],
            "headers": len(headers),
            "build_seconds": round(build_s, 1),
        }
        (work / "flashinfer-pack.json").write_text(json.dumps(info, indent=1) + "\n")

        tmp = out.with_name(out.name + ".tmp")
        with tarfile.open(tmp, "w:xz", preset=6) as tar:
            add_tree(tar, work / "flashinfer-pack.json", "flashinfer-pack.json")
            add_tree(tar, site, "site")
            add_tree(tar, depdir, "deps")
        tmp.replace(out)
        print(f"[flashinfer-pack] {out} ({out.stat().st_size} bytes): {len(headers)} headers, "
              f"{len(wheels)} dependency wheels", flush=True)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
