"""Shared fixtures for the native-kernel tests."""

import ctypes
import shutil
import subprocess

import pytest

from roofline.cpu import ops as cpu_ops


@pytest.fixture(scope="session")
def portable_kernels(tmp_path_factory):
    """cpu_kernels.c and quant_kernels.c built without -march=native (no AVX2, as on aarch64: the plain C loops), with every
    kernel's ctypes signature set as cpu_ops sets it."""
    if shutil.which("cc") is None:
        pytest.skip("needs cc to build the portable variant")
    path = tmp_path_factory.mktemp("portable") / "portable.so"
    subprocess.run(["cc", "-O2", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-std=c11",
                    *map(str, cpu_ops.SOURCES), "-o", str(path), "-lm"], check=True)
    lib = ctypes.CDLL(str(path))
    for name, argtypes in cpu_ops._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, cpu_ops._RESTYPES.get(name)
    return lib
