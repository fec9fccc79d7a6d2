"""The kernel build's object cache: an object's key follows exactly its own inputs."""

from __future__ import annotations

from pathlib import Path

from roseinfer.kernels.build import local_includes, object_key


def _tree(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    (tmp_path / "stub").mkdir()
    a = tmp_path / "a.cpp"
    a.write_text('#include "x.h"\n#include <vector>\nint a() { return X; }\n')
    x = tmp_path / "x.h"
    x.write_text('#pragma once\n#include "y.h"\n#define X Y\n')
    y = tmp_path / "stub" / "y.h"
    y.write_text("#define Y 1\n")
    z = tmp_path / "z.h"
    z.write_text("#define Z 2\n")
    return a, x, y, z


def test_local_includes_are_transitive_and_only_local(tmp_path: Path) -> None:
    a, x, y, _ = _tree(tmp_path)
    roots = (tmp_path, tmp_path / "stub")
    assert local_includes(a, roots) == sorted([x.resolve(), y.resolve()])


def test_object_key_follows_included_headers_only(tmp_path: Path, monkeypatch) -> None:
    a, _, y, z = _tree(tmp_path)
    import roseinfer.kernels.build as build

    roots = (tmp_path, tmp_path / "stub")
    monkeypatch.setattr(build, "local_includes", lambda src: local_includes(src, roots))
    cmd = ["g++", "-O3"]
    k0 = object_key(a, cmd)
    z.write_text("#define Z 3\n")  # not included by a.cpp: same object
    assert object_key(a, cmd) == k0
    y.write_text("#define Y 2\n")  # included through x.h: a new object
    k1 = object_key(a, cmd)
    assert k1 != k0
    assert object_key(a, ["g++", "-O2"]) != k1  # other flags: a new object


def test_extra_flags_reach_the_compiler_and_the_library_key(monkeypatch) -> None:
    """ROSEINFER_KERNEL_CFLAGS (another ISA variant on the same machine) builds a library
    of its own: the flags are in the compile command and in the key."""
    import roseinfer.kernels.build as build

    monkeypatch.delenv("ROSEINFER_KERNEL_CFLAGS", raising=False)
    key, flags = build._key(), build._flags()[1]
    monkeypatch.setenv("ROSEINFER_KERNEL_CFLAGS", "-DROSEINFER_NO_VNNI  -mno-avxvnni")
    assert build.extra_flags() == ["-DROSEINFER_NO_VNNI", "-mno-avxvnni"]
    assert build._flags()[1] == [*flags, "-DROSEINFER_NO_VNNI", "-mno-avxvnni"]
    assert build._key() != key
