"""The probes of bench/torch_idioms.py, one module a family (common: what they share)."""
