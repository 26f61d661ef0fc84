"""tests/reference/kernel_cases: the stand-alone program that checks builds Python cannot load (the NEON build
under qemu, scripts/neon_checks.sh), run here on a host build so the program and its checks keep working."""

import shutil

import pytest
import torch

from tests.reference import kernel_cases


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    if shutil.which("cc") is None:
        pytest.skip("needs cc to build the program")
    return kernel_cases.build("cc", "portable", tmp_path_factory.mktemp("kernel_cases") / "kernel_cases")


def test_the_portable_build_passes_through_the_program(program):
    assert kernel_cases.check_build(program, row_counts=(1, 8, 40)) == 6 * 2 * 3


@pytest.mark.parametrize("name", ["dequantized", "one_by_one", "silu_fused", "q8"])
def test_the_checks_catch_a_wrong_value(program, name):
    r = kernel_cases.run_case(program, "", 3, 64, 5, 2, seed=7)  # Q4_1, 64 rows, 5 activation rows
    kernel_cases.check_case(r, 3, 64, 5)
    v = r[name]
    v[3] = torch.nextafter(v[3], torch.tensor(float("inf"))) if name != "q8" else v[3] + 1e-2
    with pytest.raises(AssertionError):
        kernel_cases.check_case(r, 3, 64, 5)
