"""Pipeline parallelism with model folding: torch's pipeline schedules, F and B merged (``helix_pipeline``).

pairing.py   which forward and backward of a rank run as one merged graph (pure schedule arithmetic)
schedule.py  ``helix_pipeline(schedule, **options)``: checks, the paired order, the compiled stages
"""
