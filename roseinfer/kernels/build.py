"""Build the CPU kernel library (``csrc/*.cpp``) with the system C++ compiler.

The shared library is compiled once per (source, torch version, CPU flags) into
``build/roseinfer-kernels/<key>/`` at the repository root (or ``$ROSEINFER_KERNEL_DIR``),
under a file lock so concurrent processes build it once.  ``-march=native`` is safe
because the key includes this CPU's flags: another machine builds its own copy.
``python -m roseinfer.kernels.build`` builds it ahead of time (``make setup``).
``$ROSEINFER_KERNEL_CFLAGS`` adds compile flags (part of the key): on a VNNI machine
``-DROSEINFER_NO_VNNI`` builds the AVX2 loops, ``-mno-avxvnni`` AVX-512 VNNI's encoding
(tests compare each variant with the portable kernels).
No ninja or pybind: one ``g++ -c`` per source file (run in parallel) against the torch
headers, then one link.  Object files are kept in ``objects/`` beside the libraries,
keyed by their source, the local headers it includes (transitively), the flags and the
same torch / CPU / Python key, so after an edit only the sources it touches recompile
(the oldest objects beyond ``MAX_OBJECTS`` are deleted).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
LIB_NAME = "roseinfer_cpu_kernels.so"
MAX_OBJECTS = 200  # object cache bound (a few builds' worth of every source)
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


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
    h.update(" ".join(extra_flags()).encode())
    return h.hexdigest()[:16]


def extra_flags() -> list[str]:
    """Compile flags from ``$ROSEINFER_KERNEL_CFLAGS`` (whitespace-separated)."""
    return os.environ.get("ROSEINFER_KERNEL_CFLAGS", "").split()


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


# Sources whose plain C++ arithmetic must round alike everywhere, so no mul + add is
# contracted into an FMA there (GCC contracts by default in C++, and whether it does
# depends on the target's tuning: -march=znver4 and -march=icelake-server builds of the
# row ops gave other bits): the int8 KV attention's two implementations, the row ops.
_NO_CONTRACT = frozenset({"attention_q8.cpp", "rowops.cpp"})


def _file_flags(src: Path) -> list[str]:
    """Flags of one source beyond the common ones (``_NO_CONTRACT``)."""
    return ["-ffp-contract=off"] if src.name in _NO_CONTRACT else []


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
        f"-I{sysconfig.get_paths()['include']}", *extra_flags(),
    ]
    link_flags = ["-shared", "-fopenmp", f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-lc10",
                  "-ltorch_cpu", "-ltorch"]
    return cxx, compile_flags, link_flags


def local_includes(src: Path, roots: tuple[Path, ...] = (CSRC, CSRC / "stub")) -> list[Path]:
    """The headers under ``roots`` that ``src`` includes with quotes, transitively (sorted,
    no repeats)."""
    seen: set[Path] = set()
    todo = [src]
    while todo:
        data = todo.pop().read_bytes()
        for name in _INCLUDE.findall(data):
            for base in roots:
                path = (base / name.decode()).resolve()
                if path.is_file() and path not in seen:
                    seen.add(path)
                    todo.append(path)
                    break
    return sorted(seen)


def object_key(src: Path, cmd: list[str]) -> str:
    """What an object file depends on: its source, its local headers, the command
    (compiler and flags) and the library key's torch / CPU / Python parts."""
    import torch

    h = hashlib.sha256()
    for f in (src, *local_includes(src)):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update("\0".join(cmd).encode())
    h.update(torch.__version__.encode() + _cpu_flags().encode() + sys.version.encode())
    return h.hexdigest()[:20]


def _prune_objects(objects: Path, keep: set[Path]) -> None:
    """Delete the least recently used objects beyond MAX_OBJECTS (never ``keep``)."""
    files = sorted(objects.glob("*.o"), key=lambda f: f.stat().st_mtime, reverse=True)
    for f in files[MAX_OBJECTS:]:
        if f not in keep:
            f.unlink(missing_ok=True)


def _compile(out: Path, work: Path, verbose: bool) -> tuple[int, str]:
    """Compile the sources whose objects are not cached (in parallel) and link ``out``:
    (rc, log)."""
    cxx, cflags, lflags = _flags()
    objects = build_dir() / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    objs: list[Path] = []
    procs: list[tuple[subprocess.Popen[str], Path, Path]] = []
    for src in sources():
        args = [*cflags, *_file_flags(src)]
        obj = objects / f"{src.stem}-{object_key(src, [cxx, *args])}.o"
        objs.append(obj)
        if obj.exists():
            obj.touch()  # recently used: kept by the pruning
            continue
        tmp = work / obj.name
        cmd = [cxx, "-c", str(src), "-o", str(tmp), *args]
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True), tmp, obj))
    log, rc = "", 0
    for p, tmp, obj in procs:
        out_text, _ = p.communicate()
        log += out_text
        rc = rc or p.returncode
        if p.returncode == 0:
            os.replace(tmp, obj)  # atomic: another builder may share the cache
    _prune_objects(objects, set(objs))
    if rc == 0:
        cmd = [cxx, *map(str, objs), "-o", str(out), *lflags]
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
