"""ptx_kernels: attention kernels (Pallas for TPU/GPU) and pure-JAX references.

Installed from the folder `kernels/` under the import name `ptx_kernels`
(PyPI's `kernels` is another project). Depends on jax only; never imports ptx.
"""
