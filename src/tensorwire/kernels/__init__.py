"""Small Triton kernels tensorwire launches itself (imported lazily: triton is optional)."""
