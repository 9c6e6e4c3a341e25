"""CUDA templates (*.cu.j2) and device helpers (*.cuh), shipped inside the fuser wheel."""
