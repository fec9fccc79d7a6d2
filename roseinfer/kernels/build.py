"""Build the CPU kernel library (``csrc/*.cpp``) with the system C++ compiler.

The shared library is compiled once per (source, torch version, CPU flags) into
``build/roseinfer-kernels/<key>/`` at the repository root (or ``$ROSEINFER_KERNEL_DIR``),
under a file lock so concurrent processes build it once.  ``-march=native`` is safe
because the key includes this CPU's flags: another machine builds its own copy.
``python -m roseinfer.kernels.build`` builds it ahead of time (``make setup``).
No ninja or pybind: one ``g++ -c`` per source file (run in parallel) against the torch
headers, then one link.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
LIB_NAME = "roseinfer_cpu_kernels.so"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_dir() -> Path:
    env = os.environ.get("ROSEINFER_KERNEL_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "build" / "roseinfer-kernels"


def _key() -> str:
    import torch

    h = hashlib.sha256()
    for f in sorted(CSRC.rglob("*.[ch]*")):
        h.update(f.read_bytes())
    h.update(Path(__file__).read_bytes())  # the flags are part of what is built
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def _file_flags(src: Path) -> list[str]:
    """Flags of one source beyond the common ones: the int8 KV attention's two
    implementations must round alike, so no mul + add is contracted into an FMA there
    (GCC contracts by default in C++)."""
    return ["-ffp-contract=off"] if src.name == "attention_q8.cpp" else []


def _flags() -> tuple[str, list[str], list[str]]:
    """(compiler, compile flags, link flags)."""
    import torch
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"
    lib_dir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [
        "-fPIC", "-std=c++17", "-O3", "-march=native", "-fopenmp", "-DNDEBUG",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H", "-w",
        *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{CSRC / 'stub'}",
        f"-I{sysconfig.get_paths()['include']}",
    ]
    link_flags = ["-shared", "-fopenmp", f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-lc10",
                  "-ltorch_cpu", "-ltorch"]
    return cxx, compile_flags, link_flags


def _compile(out: Path, work: Path, verbose: bool) -> tuple[int, str]:
    """Compile every source (in parallel) into ``work`` and link ``out``: (rc, log)."""
    cxx, cflags, lflags = _flags()
    objs, procs = [], []
    for src in sources():
        obj = work / (src.stem + ".o")
        cmd = [cxx, "-c", str(src), "-o", str(obj), *cflags, *_file_flags(src)]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
        objs.append(str(obj))
    log, rc = "", 0
    for p in procs:
        out_text, _ = p.communicate()
        log += out_text
        rc = rc or p.returncode
    if rc == 0:
        cmd = [cxx, *objs, "-o", str(out), *lflags]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log += proc.stdout + proc.stderr
        rc = proc.returncode
    return rc, log


def build(verbose: bool = False) -> Path:
    """Return the path of the built library, compiling it if needed (raises on failure)."""
    target_dir = build_dir() / _key()
    lib = target_dir / LIB_NAME
    if lib.exists():
        return lib
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():
            return lib
        tmp = target_dir / f"{LIB_NAME}.{os.getpid()}.tmp"
        work = target_dir / f"obj.{os.getpid()}"
        work.mkdir(exist_ok=True)
        try:
            rc, log = _compile(tmp, work, verbose)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if rc != 0:
            tmp.unlink(missing_ok=True)
            (target_dir / "build.log").write_text(log)
            raise RuntimeError(
                f"building the CPU kernels failed (log: {target_dir / 'build.log'}):\n"
                + log[-2000:]
            )
        tmp.rename(lib)
    return lib


if __name__ == "__main__":
    try:
        path = build(verbose="-v" in sys.argv)
    except Exception as exc:  # noqa: BLE001 - report and fall back, never fail setup
        print(f"roseinfer: CPU kernels not built ({exc}); the PyTorch path will be used")
        sys.exit(0)
    print(f"roseinfer: CPU kernels at {path}")
