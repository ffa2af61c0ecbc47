"""The optional triton import, and nothing else: every kernel file (attention.py, ext/fused_kernels.py, the kernels of
other extensions) takes `triton` and `tl` from here. triton has Linux wheels only, so it is optional: without it,
`triton.jit` leaves each kernel a plain function that is never called and `tl.constexpr` annotates nothing, so the
kernel files still load and the PyTorch references run on macOS and Windows. HAVE_TRITON says which case this is. The
backend table that imports the kernel files is kernels.py; this file imports none of them, so the imports point one
way."""

from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    triton = SimpleNamespace(jit=lambda fn: fn)  # @triton.jit leaves the function as it is
    tl = SimpleNamespace(constexpr=None)  # kernel signatures annotate with tl.constexpr
    HAVE_TRITON = False
