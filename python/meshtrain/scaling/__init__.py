"""The seeds' scaling API (``mesh_utils``, ``sharding``) on meshtrain's rules.

The names, arguments and defaults are those of the Python system meshtrain
brings to C++; what they compute is meshtrain's (docs/mesh-planning.md,
docs/strategies.md, docs/configs.md). Where the seeds' functions were
ill-defined (shapes that leave devices idle, an axis on several
dimensions, sizes counted by the first dimension), each docstring says
what meshtrain does instead.
"""

from . import mesh_utils, sharding

__all__ = ["mesh_utils", "sharding"]
