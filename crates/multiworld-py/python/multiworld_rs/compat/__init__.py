"""multiworld_rs.compat: the older multiworld library's API on multiworld_rs.

Code written for the older library (PyPI ``multiworld``) runs with only its
import lines changed, ``multiworld`` -> ``multiworld_rs.compat``::

    from multiworld_rs.compat.manager import WorldManager
    from multiworld_rs.compat.communicator import BrokenWorldException

    world_manager = WorldManager()
    await world_manager.initialize_world("world1", 0, 2, addr="127.0.0.1", port=30500)
    try:
        await world_manager.communicator.recv(tensor, 1, "world1")
    except BrokenWorldException as e:
        world_manager.remove_world("world1")

No torch patch is needed; ``remove_world`` frees the name for a new
generation; tensors are numpy arrays, CPU torch tensors or ``__dlpack__``
objects. See docs/python.md, "Compatibility with the older library".
"""

from .._api import ReduceOp
from .communicator import DEFAULT_WORLD_NAME, BrokenWorldException, WorldCommunicator
from .manager import WorldManager

__all__ = ["WorldManager", "WorldCommunicator", "BrokenWorldException", "DEFAULT_WORLD_NAME", "ReduceOp"]
