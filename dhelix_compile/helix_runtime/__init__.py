"""The helix runtime: two micro-batch strands at once (``dhelix_compile.helix``).

step.py               ``helix(model, loss_fn)`` and ``HelixStep``: input checks, the F, M..., B sequence
strand_handoff.py     how a forward and the previous micro-batch's backward meet in one merged call:
                      the partner thread parks one call, the next takes it
merged_candidates.py  which merged graph two strands run as: candidates planned, one chosen, compiled
"""
