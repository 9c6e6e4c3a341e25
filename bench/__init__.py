"""Benchmarks of fuser against torch.compile, PyTorch eager and a device copy (bench/README.md)."""
