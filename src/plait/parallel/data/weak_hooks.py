"""Tensor hooks that do not keep their owner alive.

A hook registered on a parameter (``register_post_accumulate_grad_hook``) is held by
the tensor's C++ side, which Python's garbage collector cannot see into: a bound
method of the wrapper that owns the parameter makes a cycle (parameter -> hook ->
wrapper -> module -> parameter) that is never collected, and every DataParallel or
ZeRO wrapper built and dropped would stay in memory with its buffers and optimizer
state. ``weak_method`` hands the tensor a function that holds its wrapper weakly:
once the wrapper is gone the hook does nothing."""

from __future__ import annotations

import weakref


def weak_method(method):
    """A function calling the bound ``method`` while its object lives, a no-op after."""
    reference = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = reference()
        if bound is not None:
            return bound(*args, **kwargs)
        return None

    return call
