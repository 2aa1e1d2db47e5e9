"""plait.train: data, training loops and metrics."""
