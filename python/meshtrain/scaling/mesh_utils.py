"""Device meshes by the seeds' names (``DeviceMeshManager``, ``create_device_mesh``).

A meshtrain mesh lives on the ranks of a job: ``meshtrain.DeviceMesh(world,
shape, axis_names)`` inside ``meshtrain.launch``. The functions here work
before any job exists, as the seeds' did before touching devices: they
return a ``meshtrain.NamedShape`` (the shape and axis names, what ``--mesh``
spells), or, given ``world`` (a rank's Communicator inside a launch), the
live ``DeviceMesh`` over it.
"""

from .. import _meshtrain

NamedShape = _meshtrain.NamedShape


def _mesh(shape, axis_names, world):
    shape, axis_names = list(shape), list(axis_names)
    if world is None:
        return NamedShape(shape, axis_names)
    return _meshtrain.DeviceMesh(world, shape, axis_names)


class DeviceMeshManager:
    """Creates and plans device meshes.

    ``mesh_shape`` and ``axis_names`` are the defaults of ``create_mesh``.
    """

    def __init__(self, mesh_shape=None, axis_names=None):
        self.mesh_shape = tuple(mesh_shape) if mesh_shape is not None else None
        self.axis_names = tuple(axis_names) if axis_names is not None else None

    def create_mesh(self, mesh_shape=None, axis_names=None, world=None):
        """The mesh of ``mesh_shape`` x ``axis_names`` (the manager's when None).

        Without ``world``: a NamedShape. With ``world`` (collective over it):
        the DeviceMesh. Any number of axes works (the seeds' built only 2-D
        device grids); a shape must use every rank of ``world``.
        """
        shape = mesh_shape if mesh_shape is not None else self.mesh_shape
        names = axis_names if axis_names is not None else self.axis_names
        if shape is None or names is None:
            raise _meshtrain.InvalidArgument(
                "DeviceMeshManager.create_mesh: no mesh_shape or axis_names (hint: pass them here or to "
                "DeviceMeshManager(mesh_shape=..., axis_names=...))")
        return _mesh(shape, names, world)

    def create_mesh_from_config(self, parallel_config, world=None):
        """The mesh of a ParallelismConfig (its mesh_shape and mesh_axis_names)."""
        return _mesh(parallel_config.mesh_shape, parallel_config.mesh_axis_names, world)

    def create_data_parallel_mesh(self, device_count, axis_name="data", world=None):
        """A 1-D mesh of ``device_count`` devices along ``axis_name``."""
        return _mesh([device_count], [axis_name], world)

    def get_optimal_mesh_shape(self, device_count, dimensions=2):
        """The most balanced shape of ``dimensions`` axes using exactly ``device_count`` devices.

        meshtrain uses every device and balances every dimension count (the
        seeds' 2-D rule was unbalanced, 16 -> (2, 8), and 4-D and up gave
        (n, 1, 1, ...)): 8 -> (2, 4), 16 -> (4, 4), 32 x 4 axes -> (2, 2, 2, 4).
        """
        return tuple(_meshtrain.get_optimal_mesh_shape(device_count, dimensions))

    def optimize_for_transformer(self, device_count, model_size, sequence_length, device_memory="80GB",
                                 devices_per_node=8):
        """The mesh shape to train a transformer of ``model_size`` ("7B", "350M") on ``device_count`` devices.

        meshtrain's planner (plan::optimize_for_transformer,
        docs/mesh-planning.md) reads the sequence length and the device
        memory (the seeds' ignored the sequence) and names its axes: see
        ``plan_for_transformer`` for the names and the reasons.
        """
        return tuple(self.plan_for_transformer(device_count, model_size, sequence_length, device_memory,
                                               devices_per_node).shape)

    def plan_for_transformer(self, device_count, model_size, sequence_length, device_memory="80GB",
                             devices_per_node=8):
        """optimize_for_transformer's MeshPlan: shape, axis_names, reasons, to_spec()."""
        return _meshtrain.optimize_for_transformer(device_count, model_size, sequence_length, device_memory,
                                                   devices_per_node)

    def validate_mesh_config(self, mesh_shape, device_count):
        """True when ``mesh_shape`` uses exactly ``device_count`` devices.

        A shape that leaves devices idle is invalid in meshtrain (the seeds'
        accepted it); ``meshtrain.validate_mesh_config`` raises with the reason.
        """
        try:
            _meshtrain.validate_mesh_config(list(mesh_shape), device_count)
        except _meshtrain.InvalidArgument:
            return False
        return True


def create_device_mesh(mesh_shape, axis_names, world=None):
    """DeviceMeshManager().create_mesh(mesh_shape, axis_names, world)."""
    return _mesh(mesh_shape, axis_names, world)


def get_optimal_mesh_shape(device_count, dimensions=2):
    """DeviceMeshManager().get_optimal_mesh_shape(device_count, dimensions)."""
    return tuple(_meshtrain.get_optimal_mesh_shape(device_count, dimensions))
