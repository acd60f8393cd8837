"""Every public name of meshtrain, meshtrain.distributed and meshtrain.scaling
has a docstring (the bound ones beyond pybind11's signature line)."""

import inspect

import meshtrain
from meshtrain import distributed
from meshtrain.scaling import mesh_utils, sharding


def documented(obj):
    lines = [line for line in (getattr(obj, "__doc__", None) or "").strip().split("\n") if line.strip()]
    if lines and "(" in lines[0] and ") ->" in lines[0]:  # pybind11's signature line
        lines = lines[1:]
    return bool(lines)


def test_every_public_name_has_a_docstring():
    missing = []
    for mod in (meshtrain, distributed, mesh_utils, sharding):
        for name in getattr(mod, "__all__", [n for n in dir(mod) if not n.startswith("_")]):
            obj = getattr(mod, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue
            if not documented(obj):
                missing.append(f"{mod.__name__}.{name}")
            if isinstance(obj, type):
                for attr, member in vars(obj).items():
                    is_property = isinstance(member, property) or type(member).__name__ == "property"
                    if not attr.startswith("_") and (callable(member) or is_property) and not documented(member):
                        missing.append(f"{mod.__name__}.{name}.{attr}")
    assert not missing, missing
