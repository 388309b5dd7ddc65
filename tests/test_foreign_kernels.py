"""Foreign kernels and prepared weights of the call plan (kiln/runtime/steps.py): a native
function of another shared object launched in the same native call as a unit's kernels,
registered in its kernel table once; weights prepared from several parameters, written
again only when one of them changes; packs run before every kernel."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kiln.backends.cpu.codegen import FOREIGN_ROWS, table_runner
from kiln.backends.cpu.standalone import load_library, runner_library
from kiln.runtime.call_plan import CallPlan, ForeignKernel, HostLauncher, NativeRunStep, PrepareStep, SlotSpec

SOURCE = """
/* p[0] = const float *x, p[1] = const long *n, p[2] = float *out: out = 2x + 1 */
void kiln_test_affine(void *const *p) {
  const float *x = p[0]; const long *n = p[1]; float *out = p[2];
  for (long i = 0; i < n[0]; i++) out[i] = 2.0f * x[i] + 1.0f;
}
/* p[0] = const float *x, p[1] = float *out: out = x * x */
void kiln_test_square(void *const *p) {
  const float *x = p[0]; float *out = p[1];
  for (long i = 0; i < 5; i++) out[i] = x[i] * x[i];
}
"""


@pytest.fixture(scope="module")
def lib():
    library = load_library(SOURCE)
    if library is None or runner_library() is None:
        pytest.skip("needs a C compiler")
    return library


def _address(library, name: str) -> int:
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value


def _runner(table_lib) -> HostLauncher:
    table_lib.kiln_add_kernel.argtypes, table_lib.kiln_add_kernel.restype = [ctypes.c_void_p], ctypes.c_long
    return table_lib


def test_foreign_kernels_run_in_one_native_call_in_order(lib):
    runner = _runner(runner_library())
    affine = ForeignKernel(_address(lib, "kiln_test_affine"), "kiln_test_affine")
    square = ForeignKernel(_address(lib, "kiln_test_square"), "kiln_test_square")
    rows = {k.address: runner.kiln_add_kernel(ctypes.c_void_p(k.address)) for k in (affine, square)}
    assert all(row >= 1 for row in rows.values()) and len(set(rows.values())) == 2
    # registering again gives the same row
    assert runner.kiln_add_kernel(ctypes.c_void_p(affine.address)) == rows[affine.address]
    launcher = HostLauncher(runner.kiln_run, rows)
    # slot 0: x (argument), 1: n (constant), 2: y = 2x + 1 (arena), 3: z = y * y (fresh output)
    step = NativeRunStep(launcher, ((affine, (0, 1, 2), ()), (square, (2, 3), ())))
    plan = CallPlan(num_slots=4, num_args=1, constants={1: torch.tensor([5])},
                    planned=[SlotSpec(2, (5,), torch.float32, offset=0), SlotSpec(3, (5,), torch.float32)],
                    arena_bytes=20, steps=[step], outputs=[3])
    x = torch.randn(5)
    (z,) = plan([x])
    torch.testing.assert_close(z, (2 * x + 1) ** 2)
    x2 = torch.randn(5)
    torch.testing.assert_close(plan([x2])[0], (2 * x2 + 1) ** 2)


def test_an_unregistered_foreign_kernel_is_refused(lib):
    affine = ForeignKernel(_address(lib, "kiln_test_affine"), "kiln_test_affine")
    launcher = HostLauncher(runner_library().kiln_run, {})
    with pytest.raises(RuntimeError, match="kiln_test_affine was not registered"):
        launcher.bind([(affine, (0, 1, 2), ())], set(), [None] * 3)


def test_a_kernel_table_has_a_fixed_number_of_foreign_rows(lib):
    table = load_library(table_runner([]) + "\n/* a table of its own */\n")
    table.kiln_add_kernel.argtypes, table.kiln_add_kernel.restype = [ctypes.c_void_p], ctypes.c_long
    rows = [table.kiln_add_kernel(ctypes.c_void_p(0x1000 + 16 * i)) for i in range(FOREIGN_ROWS + 1)]
    assert rows[:FOREIGN_ROWS] == list(range(1, FOREIGN_ROWS + 1)) and rows[-1] == -1


def test_prepared_tensors_are_written_again_only_when_a_source_changes():
    writes = []

    def write(sources, targets):
        writes.append(1)
        targets[0].copy_(sources[0] * sources[1])

    a, b = torch.randn(3), torch.randn(3)
    plan = CallPlan(num_slots=3, num_args=2, constants={}, planned=[SlotSpec(2, (3,), torch.float32, persistent=True)],
                    arena_bytes=0, steps=[PrepareStep((((0, 1), (2,), write, "a * b"),))], outputs=[2])
    torch.testing.assert_close(plan([a, b])[0], a * b)
    plan([a, b])
    assert len(writes) == 1
    b.mul_(2)  # in place: its version counter moves
    torch.testing.assert_close(plan([a, b])[0], a * b)
    assert len(writes) == 2
    c = torch.randn(3)  # another tensor
    torch.testing.assert_close(plan([c, b])[0], c * b)
    assert len(writes) == 3
    a.data = torch.randn(3)  # the same tensor object on new storage
    torch.testing.assert_close(plan([a, b])[0], a * b)
    assert len(writes) == 4
    plan([a, b])
    assert len(writes) == 4


def test_only_the_parts_whose_sources_changed_are_written_again():
    writes = []

    def write(sources, targets):
        writes.append(len(sources))
        targets[0].copy_(sources[0] + 1)

    a, b = torch.randn(3), torch.randn(3)
    parts = (((0,), (2,), write, "a + 1"), ((1,), (3,), write, "b + 1"))
    plan = CallPlan(num_slots=4, num_args=2, constants={},
                    planned=[SlotSpec(2, (3,), torch.float32, persistent=True),
                             SlotSpec(3, (3,), torch.float32, persistent=True)],
                    arena_bytes=0, steps=[PrepareStep(parts)], outputs=[2, 3])
    plan([a, b])
    assert len(writes) == 2
    b.add_(1.0)
    got = plan([a, b])
    torch.testing.assert_close(got[1], b + 1)
    torch.testing.assert_close(got[0], a + 1)
    assert len(writes) == 3  # a's part was not written again
