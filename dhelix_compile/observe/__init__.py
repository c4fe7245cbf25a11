"""What dhelix shows of its work: dumps, timelines, graph pictures, measured profiles, the report.

Imported only when a dump or a profile is asked for (``dump_dir``, ``profile_steps``, the
``report`` command), never on a plain backend import: the core passes an observer in.

    dumps.py          ``GraphDumper``: each graph before/after every pass, summary.json, index.html
    timeline.py       predicted schedules as Chrome traces and SVG Gantt charts
    graph_picture.py  the scheduled graph as an SVG
    measured.py       ``profile_steps``: torch.profiler runs cut into segments, predicted vs measured
    report.py         the table over a dump folder (``dhelix report``)
"""
