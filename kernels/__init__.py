"""Fused distillation kernels (Triton on CUDA, C++ on CPU). Pure functions on tensors."""
