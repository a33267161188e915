"""Build FlashInfer's attention modules ahead of time and pack them with the package, for a GPU host that cannot
compile them at first use (no nvcc, no package index, or no minutes to spare at start).

    python benchmarks/flashinfer_aot.py --out flashinfer-aot.tgz                  # bf16, head_dim 128, sm_90a
    python benchmarks/flashinfer_aot.py --out fi.tgz --head-dim 64 128 --dtype float16 --arch 8.0

It runs where nvcc and flashinfer-python (the release to be served) are installed; no GPU is needed. For each head
dim, with and without a sliding window, it builds the modules the `flashinfer` attention backend loads: FlashInfer's
FA2 prefill module (extend, and decode on the tensor cores) and its CUDA-core decode module. FlashInfer's own
build links against libcuda, which a machine without a GPU driver lacks: the link is then rerun against an empty
stand-in with the same soname (the real driver library is what loads at run time). The archive holds the package
(its CUTLASS and spdlog sources left out: nothing compiles on the host) with each module at
`flashinfer/data/aot/<name>/<name>.so`, where FlashInfer loads a module without compiling it. On the GPU host:

    tar xzf flashinfer-aot.tgz -C <a folder on PYTHONPATH>     # plus apache-tvm-ffi (and nvidia-ml-py) installed
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

DTYPES = ("bfloat16", "float16")
SKIP = ("cutlass", "spdlog")  # under flashinfer/data: sources for compiling, not needed to load built modules


def module_specs(head_dims: Iterable[int], dtype: str) -> list:
    """FlashInfer JitSpecs of the modules our backend loads for these head dims (16-bit q/kv/out, int32 indices)."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module

    dt = getattr(torch, dtype)
    specs = []
    for d in head_dims:
        for window in (False, True):
            specs.append(gen_batch_prefill_module("fa2", dt, dt, dt, torch.int32, d, d, 0, window, False, False))
            specs.append(gen_batch_decode_module(dt, dt, dt, torch.int32, d, d, 0, window, False))
    return specs


def _cuda_lib_dir() -> Path:
    nvcc = shutil.which("nvcc")
    candidates = [Path(os.environ["CUDA_HOME"]) / "lib64"] if os.environ.get("CUDA_HOME") else []
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        candidates += [root / "lib64", root / "lib"]
    candidates += [Path("/usr/local/cuda/lib64")]
    for c in candidates:
        if list(c.glob("libcudart.so*")):
            return c
    raise FileNotFoundError("no CUDA runtime library (libcudart.so) next to nvcc, under CUDA_HOME or /usr/local/cuda")


def _stub_libcuda(folder: Path) -> Path:
    """An empty shared library named libcuda.so.1: enough for the linker; the driver's own loads at run time."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "stub.c"
    src.write_text("void radixserve_libcuda_stub(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), "-Wl,-soname,libcuda.so.1",
                    str(src)], check=True)
    link = folder / "libcuda.so"
    if not link.exists():
        link.symlink_to("libcuda.so.1")
    return folder


def build(spec, stub_dir: Path, log: Callable[[str], None] = print) -> Path:  # noqa: ANN001  (a FlashInfer JitSpec)
    """Build one module (relinking against the stand-in libcuda if FlashInfer's link fails) and return its .so."""
    try:
        spec.build(verbose=False)
    except Exception as exc:  # noqa: BLE001  (ninja's failure surfaces as RuntimeError / CalledProcessError)
        objects = spec.get_object_paths()
        missing = [str(o) for o in objects if not Path(o).exists()]
        if missing:
            raise RuntimeError(f"{spec.name}: compilation failed ({exc}); missing {missing[:3]}") from exc
        log(f"  {spec.name}: relinking against the stand-in libcuda ({type(exc).__name__})")
        subprocess.run(["c++", *map(str, objects), "-shared", f"-L{_cuda_lib_dir()}", f"-L{stub_dir}", "-lcudart",
                        "-lcuda", "-o", str(spec.jit_library_path)], check=True)
    if not Path(spec.jit_library_path).exists():
        raise RuntimeError(f"{spec.name}: no library at {spec.jit_library_path} after the build")
    return Path(spec.jit_library_path)


def bundle(package_dir: Path, modules: dict[str, Path], out: Path, extra: Iterable[Path] = ()) -> None:
    """Write `out` (.tgz): the package at `package_dir` (a folder named flashinfer) without data/cutlass and
    data/spdlog, each module as flashinfer/data/aot/<name>/<name>.so, and the `extra` paths (e.g. dist-info) at the
    top level."""
    if package_dir.name != "flashinfer" or not (package_dir / "__init__.py").exists():
        raise ValueError(f"{package_dir} is not the flashinfer package folder")

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if "__pycache__" in parts or (len(parts) > 2 and parts[1] == "data" and parts[2] in SKIP):
            return None
        return info

    with tarfile.open(out, "w:gz") as tar:
        tar.add(package_dir, arcname="flashinfer", filter=keep)
        for name, so in modules.items():
            tar.add(so, arcname=f"flashinfer/data/aot/{name}/{name}.so")
        for path in extra:
            tar.add(path, arcname=path.name, filter=keep)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .tgz to write")
    p.add_argument("--head-dim", type=int, nargs="+", default=[128])
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--arch", default="9.0a", help="FLASHINFER_CUDA_ARCH_LIST (9.0a: Hopper)")
    p.add_argument("--workspace", default=None, help="FlashInfer's build folder (default: a temporary one)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: $MAX_JOBS, else ninja's)")
    args = p.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be positive, got {args.jobs}")
    if shutil.which("nvcc") is None:
        sys.exit("flashinfer_aot: nvcc is not on PATH")
    work = Path(args.workspace or tempfile.mkdtemp(prefix="flashinfer-aot-"))
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = args.arch
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(work)
    if args.jobs is not None:
        os.environ["MAX_JOBS"] = str(args.jobs)  # FlashInfer's ninja runs take it
    import flashinfer  # after the environment: FlashInfer reads it at import

    stub = _stub_libcuda(work / "stub")
    modules = {}
    for spec in module_specs(args.head_dim, args.dtype):
        print(f"building {spec.name}", flush=True)
        modules[spec.name] = build(spec, stub)
    package = Path(flashinfer.__file__).resolve().parent
    extra = [d for d in package.parent.glob("flashinfer_python-*.dist-info")]
    bundle(package, modules, Path(args.out), extra)
    print(f"wrote {args.out}: flashinfer {flashinfer.__version__}, {len(modules)} modules "
          f"({', '.join(sorted(modules))})")


if __name__ == "__main__":
    main()
