"""Triton kernels, compiled at run time for the device a tensor lives on.

Each kernel sits in its own module, which imports Triton when it is imported; this package
itself imports nothing, so ``import gpumem`` stays lean.

Modules:

    crc32c   per-chunk CRC32C of a byte tensor (``chunk_crc32c_triton``), many in one launch

On a machine without CUDA the kernels run in Triton's interpreter: set ``TRITON_INTERPRET=1``
before the first kernel module is imported (Triton decides it when a kernel is defined).
"""
