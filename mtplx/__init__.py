"""mtplx: run and inspect LLM sessions on MLX.

Importing the package loads the CPU fast path's BLAS (Linux x86_64, ~1 ms) so that it is in place
before anything imports MLX; see mtplx/fast_path.py.
"""

from mtplx import fast_path as _fast_path

_fast_path.activate()
