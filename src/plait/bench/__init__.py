"""Benchmarks: collective bandwidth in the nccl-tests format (`plait bench`)."""
