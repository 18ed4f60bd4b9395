"""The small-row kernel in front of MKL (mtplx/small_gemm.py, mtplx/native/small_gemm.c)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mtplx import fast_path, small_gemm

pytestmark = pytest.mark.skipif(fast_path.KERNEL is None,
                                reason=f"small-row kernel not active here: {fast_path.activate().kernel_reason}")

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
_i, _f, _p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


def _kernel() -> ctypes.CDLL:
    lib = fast_path.KERNEL
    lib.mtplx_small_sgemm.argtypes = [_i, _i, _i, _f, _p, _i, _p, _i, _f, _p, _i]
    lib.cblas_sgemm.argtypes = [_i, _i, _i, _i, _i, _i, _f, _p, _i, _p, _i, _f, _p, _i]
    return lib


def _small(x: np.ndarray, w: np.ndarray, alpha=1.0, beta=0.0, c: np.ndarray | None = None) -> np.ndarray:
    """C = alpha * x @ w.T + beta * C through the kernel; x and w may be row slices of wider arrays."""
    m, k = x.shape
    n = w.shape[0]
    c = np.full((m, n), np.nan, np.float32) if c is None else c
    _kernel().mtplx_small_sgemm(m, n, k, alpha, x.ctypes.data, x.strides[0] // 4, w.ctypes.data, w.strides[0] // 4,
                                beta, c.ctypes.data, c.strides[0] // 4)
    return c


# Both tile widths where the kernel was built with AVX-512 (set_wide switches them), else AVX2's.
WIDTHS = [False, True] if small_gemm.wide() else [False]


@pytest.fixture(params=WIDTHS, ids=lambda w: "avx512" if w else "avx2")
def width(request):
    small_gemm.set_wide(fast_path.KERNEL, request.param)
    yield request.param
    small_gemm.set_wide(fast_path.KERNEL, small_gemm.wide())


@pytest.mark.parametrize("k", [8, 9, 15, 16, 17, 64, 257])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 130])
def test_products_are_right_for_any_shape_and_stride(n, k, width):
    rng = np.random.default_rng(n * 1000 + k)
    wide_x = rng.standard_normal((16, k + 5)).astype(np.float32)  # rows longer than K: lda > K
    wide_w = rng.standard_normal((n, k + 3)).astype(np.float32)
    x, w = wide_x[:, :k], wide_w[:, :k]
    for m in (1, 2, 3, 4, 5, 11, 16):
        got = _small(x[:m], w)  # C starts as NaN: with beta 0 it must never be read
        want = x[:m].astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("k", [300, 256, 13])  # a masked last step of the wide tiles, none, only one
def test_a_rows_result_does_not_depend_on_the_other_rows(k, width):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((32, k)).astype(np.float32)
    w = rng.standard_normal((50, k)).astype(np.float32)
    alone = np.concatenate([_small(x[i:i + 1], w) for i in range(32)])
    for m in range(1, 33):  # a decode step, a verify of k + 1 tokens, a batch of rows x tokens
        assert np.array_equal(_small(x[:m], w), alone[:m])
        # every output column sums alike whichever tile it lands in (columns 0.. and a narrow last tile)
        assert np.array_equal(_small(x[:m], w[7:]), alone[:m, 7:])


@pytest.mark.skipif(not small_gemm.wide(), reason="the kernel has no AVX-512 tiles here")
def test_the_wide_tiles_run_where_the_cpu_has_them():
    """Built with AVX-512 on a CPU that has it, the sixteen-lane tiles are the default, and their
    sums differ from the AVX2 tiles' only by rounding."""
    assert ctypes.c_int.in_dll(fast_path.KERNEL, "mtplx_small_wide").value == 1
    rng = np.random.default_rng(11)
    x, w = rng.standard_normal((5, 640)).astype(np.float32), rng.standard_normal((64, 640)).astype(np.float32)
    wide = _small(x, w)
    small_gemm.set_wide(fast_path.KERNEL, False)
    try:
        narrow = _small(x, w)
    finally:
        small_gemm.set_wide(fast_path.KERNEL, True)
    np.testing.assert_allclose(wide, narrow, rtol=1e-5, atol=1e-4)
    assert not np.array_equal(wide, narrow)  # other summation orders: the switch really switched


def test_alpha_and_beta():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 40)).astype(np.float32), rng.standard_normal((5, 40)).astype(np.float32)
    c = rng.standard_normal((3, 5)).astype(np.float32)
    got = _small(x, w, alpha=0.5, beta=2.0, c=c.copy())
    np.testing.assert_allclose(got, 0.5 * (x @ w.T) + 2.0 * c, rtol=1e-5, atol=1e-5)


def test_calls_it_does_not_take_go_on_to_mkl():
    """More rows than it takes, another layout, or a K under 8: the BLAS behind it answers."""
    rng = np.random.default_rng(5)
    lib = _kernel()
    for m, n, k, tb in ((40, 30, 64, TRANS), (4, 30, 64, NO_TRANS), (4, 30, 5, TRANS)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k) if tb == TRANS else (k, n)).astype(np.float32)
        c = np.zeros((m, n), np.float32)
        lib.cblas_sgemm(ROW_MAJOR, NO_TRANS, tb, m, n, k, 1.0, x.ctypes.data, k, w.ctypes.data, w.shape[1], 0.0,
                        c.ctypes.data, n)
        np.testing.assert_allclose(c, x @ (w.T if tb == TRANS else w), rtol=1e-4, atol=1e-4)


def test_mlx_matmuls_run_through_it_and_the_switch_hands_them_back():
    import mlx.core as mx

    x, w = mx.random.normal((6, 256), key=mx.random.key(1)), mx.random.normal((640, 256), key=mx.random.key(2))
    whole = x @ w.T
    # Row by row equals all rows at once, bit for bit: the kernel's fixed summation order.
    assert all(mx.array_equal(whole[i:i + 1], x[i:i + 1] @ w.T).item() for i in range(6))
    small_gemm.set_enabled(fast_path.KERNEL, False)
    try:
        by_mkl = x @ w.T
    finally:
        small_gemm.set_enabled(fast_path.KERNEL, True)
    assert mx.allclose(whole, by_mkl, rtol=1e-4, atol=1e-4).item()
    assert fast_path.label(True, "fp32", fast_path.activate()) == f"cpu fp32 + mkl + {small_gemm.name()}"


def test_an_unbuildable_kernel_leaves_mkl_alone_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernel, why = small_gemm.load()
    assert kernel is None and "could not build" in why
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left under any name
    monkeypatch.setenv(small_gemm.ENV, "off")
    assert small_gemm.load() == (None, f"{small_gemm.ENV}=off")


def test_a_product_shared_with_the_helper_thread_is_bit_identical(width):
    """Column chunks computed by two threads give exactly the one-thread result (shapes that end
    mid-chunk, every tile path), and products called from two threads at once stay right."""
    import threading

    lib = _kernel()
    split = ctypes.c_long.in_dll(lib, "mtplx_small_split_macs")
    threads = ctypes.c_int.in_dll(lib, "mtplx_small_threads")
    saved = split.value, threads.value
    rng = np.random.default_rng(11)
    try:
        split.value = 1
        for m, n, k in ((1, 4096, 256), (2, 97, 64), (3, 200, 33), (4, 640, 256), (5, 130, 640), (16, 1000, 72),
                        (32, 49, 8)):
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = rng.standard_normal((n, k)).astype(np.float32)
            threads.value = 0
            alone = _small(x, w)
            threads.value = 1
            for _ in range(3):
                assert np.array_equal(_small(x, w), alone)
        x = rng.standard_normal((8, 256)).astype(np.float32)
        w = rng.standard_normal((2000, 256)).astype(np.float32)
        want = _small(x, w)
        results, errors = [], []

        def caller():
            try:
                for _ in range(20):
                    results.append(np.array_equal(_small(x, w), want))
            except Exception as exc:  # surfaced below
                errors.append(exc)

        workers = [threading.Thread(target=caller) for _ in range(3)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        assert not errors and len(results) == 60 and all(results)
    finally:
        split.value, threads.value = saved


def test_avx512_is_built_only_where_wanted_and_the_cpu_has_it(monkeypatch):
    from mtplx import native_build

    has = native_build.cpu_has("avx512f")
    monkeypatch.setenv(native_build.WIDE_ENV, "on")
    assert small_gemm.wide() == has and ("-mavx512f" in small_gemm.BUILD.flags()) == has
    assert "-mavx512f" not in native_build.ATTENTION.flags()  # a kernel without such a path never gets it
    wide_build = small_gemm.BUILD.built()
    monkeypatch.setenv(native_build.WIDE_ENV, "off")
    assert not small_gemm.wide() and small_gemm.name() == "small-row kernel"
    assert small_gemm.BUILD.built() != wide_build or not has  # its own cached library, never the other's


def test_the_helpers_polling_time_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(small_gemm.SPIN_ENV, "150")
    assert small_gemm.spin_ns() == 150_000
    for bad in ("", "soon", "nan", "inf"):
        monkeypatch.setenv(small_gemm.SPIN_ENV, bad)
        assert small_gemm.spin_ns() is None  # ignored: the default stands, nothing fails at import
    monkeypatch.setenv(small_gemm.SPIN_ENV, "-5")
    assert small_gemm.spin_ns() == 0


def test_a_damaged_cached_build_is_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = small_gemm._built()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"\x7fELF" + b"\0" * 12)  # a cut-short library under the final name
    kernel, why = small_gemm.load()
    assert why is None and kernel is not None and target.stat().st_size > 1000


def test_a_serving_process_keeps_the_helper_only_for_a_big_enough_step(monkeypatch):
    """fit_helper (launch.open_engine): the embedded models' steps (~4M multiply-adds) decode
    through `mtplx serve` faster without the helper, a real checkpoint's (hundreds of millions)
    much slower; MTPLX_SMALL_GEMM_THREADS, when set, decides instead."""
    lib = _kernel()
    threads = ctypes.c_int.in_dll(lib, "mtplx_small_threads")
    saved = threads.value
    monkeypatch.setattr(small_gemm, "threads_wanted", lambda: True)  # as on any machine with 2+ cores
    try:
        monkeypatch.delenv(small_gemm.THREADS_ENV, raising=False)
        assert small_gemm.fit_helper(lib, 4_000_000) is False and threads.value == 0
        assert small_gemm.fit_helper(lib, 281_000_000) is True and threads.value == 1
        assert small_gemm.fit_helper(lib, small_gemm.HELPER_FROM_MACS) is True
        monkeypatch.setenv(small_gemm.THREADS_ENV, "on")
        assert small_gemm.fit_helper(lib, 4_000_000) is True and threads.value == 1
        monkeypatch.setattr(small_gemm, "threads_wanted", lambda: False)  # =off, or one core
        assert small_gemm.fit_helper(lib, 281_000_000) is False and threads.value == 0
    finally:
        threads.value = saved
