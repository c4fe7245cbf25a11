"""The helix runtime: two micro-batch strands at once (``dhelix_compile.helix``).

step.py     ``helix(model, loss_fn)`` and ``HelixStep``: input checks, the F, M..., B sequence
strands.py  how a forward and the previous micro-batch's backward meet in one merged call
"""
