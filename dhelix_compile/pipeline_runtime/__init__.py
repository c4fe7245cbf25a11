"""Pipeline parallelism with model folding: torch's pipeline schedules, F and B merged (``helix_pipeline``).

pairing.py          which forward and backward of a rank run as one merged graph (pure schedule arithmetic)
schedule.py         ``helix_pipeline(schedule, **options)``: checks, the paired order, the compiled stages
steps.py            the step loop: FORWARD and FULL_BACKWARD as torch's runtime runs them, the backward in two halves
boundaries.py       where two stages' layouts differ: the boundary tensors' plans and transfers
stage_transfers.py  a stage's sends and receives replaced by the boundaries' own
"""
