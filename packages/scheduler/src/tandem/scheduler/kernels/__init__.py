"""tandem's own kernels: the C++ CPU sources and their build, and the Triton kernels."""
