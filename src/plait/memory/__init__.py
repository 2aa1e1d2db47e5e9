"""Memory techniques, below the parallel wrappers that use them: recomputation
(``recompute``), activation offload (``offload``), saved-tensor metering (``saved_memory``),
mixed precision (``precision``) and dynamic loss scaling (``loss_scale``)."""
