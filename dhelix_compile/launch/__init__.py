"""Ranks on this machine: the one launcher (``ranks``) and where the ranks run (``link``).

    link.py    LinkSpec; two network namespaces joined by a rate-limited veth, or loopback
    ranks.py   launch_ranks: start, supervise, time out, kill and reap rank processes
    forkserver.py  a process that has imported torch and forks ranks instead of cold starts

The bench and the demo launch their worker scripts with it; ``dhelix_compile.testing.multirank``
runs Python functions on ranks with it.
"""
