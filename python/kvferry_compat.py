"""Opt-in `mooncake.engine` and `nixl` on kvferry: code that does
`from mooncake.engine import TransferEngine`, or `from nixl._api import
nixl_agent`, runs on kvferry.

    python3 -m kvferry_compat install           # mooncake, next to kvferry
    python3 -m kvferry_compat install --nixl    # nixl (docs/nixl.md)
    python3 -m kvferry_compat status [--nixl]
    python3 -m kvferry_compat uninstall [--nixl]

`install` writes a small package (mooncake/__init__.py and
mooncake/engine.py; or nixl/__init__.py, nixl/_api.py, nixl/_bindings.py
and nixl/_utils.py), which re-exports kvferry's classes, into the
directory kvferry is installed in, or --target DIR. It refuses when the
real package is importable or already in that directory, and `uninstall`
removes only the package it wrote. Nothing is installed unless asked.
"""
import argparse
import importlib.util
import os
import shutil
import sys

MARKER = "__kvferry_mooncake_shim__"

_INIT = f'''"""kvferry's stand-in for Mooncake's Python package (kvferry_compat).

Only `mooncake.engine` is provided. Remove it with
`python3 -m kvferry_compat uninstall`.
"""
{MARKER} = True
'''

_ENGINE = '''"""mooncake.engine on kvferry (kvferry_compat)."""
from kvferry import (  # noqa: F401
    InnerTransferEngine,
    SUPPORT_CUDA,
    SUPPORT_EFA,
    SUPPORT_HIP,
    SUPPORT_INTRA_NVLINK,
    SUPPORT_MNNVL,
    SUPPORT_MUSA,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
)
'''


# What nixl/__init__.py re-exports (as NIXL's does); nixl._api has these and
# nixlXferTelemetry.
_NIXL_NAMES = ("DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
               "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle")


def _imports(module, names):
    return f"from {module} import (  # noqa: F401\n" + "".join(
        f"    {n},\n" for n in names) + ")\n"


_NIXL_INIT = f'''"""kvferry's stand-in for NIXL's Python package (kvferry_compat --nixl).

nixl._api and nixl._bindings run on a kvferry engine: docs/nixl.md. Remove
it with `python3 -m kvferry_compat uninstall --nixl`.
"""
{MARKER} = True
''' + _imports("nixl._api", _NIXL_NAMES)

_NIXL_API = ('"""nixl._api on kvferry (kvferry_compat --nixl)."""\n' +
             _imports("kvferry._nixl", _NIXL_NAMES + ("nixlXferTelemetry",)))

_NIXL_BINDINGS = '''"""nixl._bindings on kvferry (kvferry_compat --nixl): the telemetry
record, descriptor lists, enums and the twelve exceptions."""
from kvferry._nixl import _bindings_namespace

globals().update(_bindings_namespace())
del _bindings_namespace
'''

_NIXL_UTILS = '''"""nixl._utils on kvferry (kvferry_compat --nixl)."""
import pickle


def get_serialized_descs(descs):
    return pickle.dumps(descs)


def deserialize_descs(data):
    return pickle.loads(data)
'''

# package -> (its files, what the real one is called in messages)
_PACKAGES = {
    "mooncake": ({"__init__.py": _INIT, "engine.py": _ENGINE}, "Mooncake"),
    "nixl": ({"__init__.py": _NIXL_INIT, "_api.py": _NIXL_API, "_bindings.py": _NIXL_BINDINGS,
              "_utils.py": _NIXL_UTILS}, "NIXL"),
}


def _default_target():
    spec = importlib.util.find_spec("kvferry")
    if spec is None or spec.origin is None:
        raise SystemExit("kvferry_compat: kvferry is not importable here; install kvferry first")
    # The directory holding the kvferry package (or module).
    origin = os.path.abspath(spec.origin)
    if spec.submodule_search_locations is not None:  # a package: .../kvferry/__init__.py
        origin = os.path.dirname(origin)
    return os.path.dirname(origin)


def _ours(package_dir):
    init = os.path.join(package_dir, "__init__.py")
    try:
        with open(init, encoding="utf-8") as f:
            return MARKER in f.read()
    except OSError:
        return False


def _real(target, package="mooncake"):
    """Where the real package is, or None."""
    here = os.path.join(target, package)
    if os.path.exists(here) and not _ours(here):
        return here
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if not _ours(location):
                return location
    return None


def install(target=None, package_name="mooncake"):
    target = target or _default_target()
    files, real_name = _PACKAGES[package_name]
    real = _real(target, package_name)
    if real is not None:
        raise SystemExit(f"kvferry_compat: a real {real_name} is installed at {real}; "
                         "not shadowing it (uninstall it first, or use kvferry's own API)")
    package = os.path.join(target, package_name)
    os.makedirs(package, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(package, name), "w", encoding="utf-8") as f:
            f.write(text)
    return package


def uninstall(target=None, package_name="mooncake"):
    package = os.path.join(target or _default_target(), package_name)
    if not os.path.exists(package):
        return None
    if not _ours(package):
        raise SystemExit(f"kvferry_compat: {package} is not kvferry's; leaving it alone")
    shutil.rmtree(package)
    return package


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m kvferry_compat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["install", "uninstall", "status"])
    parser.add_argument("--target", help="directory to install into (default: kvferry's)")
    parser.add_argument("--nixl", action="store_true",
                        help="the nixl package (nixl._api, nixl._bindings), not mooncake")
    args = parser.parse_args(argv)
    package = "nixl" if args.nixl else "mooncake"
    real_name = _PACKAGES[package][1]
    if args.command == "install":
        usage = ("`from nixl._api import nixl_agent`" if args.nixl
                 else "`from mooncake.engine import TransferEngine`")
        print(f"installed {install(args.target, package)}: {usage} now runs on kvferry")
    elif args.command == "uninstall":
        removed = uninstall(args.target, package)
        print(f"removed {removed}" if removed else "nothing to remove")
    else:
        spec = importlib.util.find_spec(package)
        if spec is None:
            print(f"no {package} package is importable")
        else:
            where = list(spec.submodule_search_locations or [spec.origin])
            kind = "kvferry's stand-in" if all(_ours(w) for w in where) else f"a real {real_name}"
            print(f"{package} is {kind}: {', '.join(where)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
