"""CUDA: side-stream copies and pinning (cuda-python), and checksums of GPU sources computed on
the GPU beside their copies."""
