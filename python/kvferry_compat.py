"""Opt-in `mooncake.engine` on kvferry: code that does
`from mooncake.engine import TransferEngine` runs on kvferry.

    python3 -m kvferry_compat install     # next to kvferry, in this environment
    python3 -m kvferry_compat status
    python3 -m kvferry_compat uninstall

`install` writes a small `mooncake` package (mooncake/__init__.py and
mooncake/engine.py, which re-export kvferry's TransferEngine and friends)
into the directory kvferry is installed in, or --target DIR. It refuses when
a real Mooncake is importable or already in that directory, and `uninstall`
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


def _real_mooncake(target):
    """Where a real Mooncake is, or None."""
    here = os.path.join(target, "mooncake")
    if os.path.exists(here) and not _ours(here):
        return here
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if not _ours(location):
                return location
    return None


def install(target=None):
    target = target or _default_target()
    real = _real_mooncake(target)
    if real is not None:
        raise SystemExit(f"kvferry_compat: a real Mooncake is installed at {real}; "
                         "not shadowing it (uninstall it first, or use `from kvferry import "
                         "TransferEngine`)")
    package = os.path.join(target, "mooncake")
    os.makedirs(package, exist_ok=True)
    for name, text in (("__init__.py", _INIT), ("engine.py", _ENGINE)):
        with open(os.path.join(package, name), "w", encoding="utf-8") as f:
            f.write(text)
    return package


def uninstall(target=None):
    package = os.path.join(target or _default_target(), "mooncake")
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
    args = parser.parse_args(argv)
    if args.command == "install":
        print(f"installed {install(args.target)}: `from mooncake.engine import TransferEngine` "
              "now runs on kvferry")
    elif args.command == "uninstall":
        removed = uninstall(args.target)
        print(f"removed {removed}" if removed else "nothing to remove")
    else:
        spec = importlib.util.find_spec("mooncake")
        if spec is None:
            print("no mooncake package is importable")
        else:
            where = list(spec.submodule_search_locations or [spec.origin])
            kind = "kvferry's stand-in" if all(_ours(w) for w in where) else "a real Mooncake"
            print(f"mooncake is {kind}: {', '.join(where)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
