"""Joint-graph passes: rewrites of AOTAutograd's joint forward-backward graph, before it is partitioned.

``pass_list.JOINT_PASSES`` orders them; ``joint_passes(disabled)`` is what the capture hands
Inductor as its ``joint_custom_pre_pass``. See ``graph_passes/README.md``.
"""

from __future__ import annotations

from graph_passes.joint.pass_list import JOINT_PASSES, JointPass, JointPasses, joint_passes

__all__ = ["JOINT_PASSES", "JointPass", "JointPasses", "joint_passes"]
