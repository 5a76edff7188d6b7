#!/usr/bin/env python3
"""Lists the shared libraries pdlib's Python extension needs at run time, and who provides them.

  python3 python/tools/wheel_deps.py                 # the pdlib this interpreter imports
  python3 python/tools/wheel_deps.py dist/pdlib-*.whl
  python3 python/tools/wheel_deps.py path/to/_pdlib.cpython-311-x86_64-linux-gnu.so

The extension links pdlib itself statically; what it still loads comes from the host: gRPC,
protobuf, Abseil, UCX, rdma-core (and the C/C++ runtimes every program needs). For each library
`ldd` resolves, the Debian package that ships it (`dpkg -S`) when dpkg knows it. Exit status 1
when a library is not found on this host (ldd's "not found"), so a user sees what to install.
"""

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Everything a C++ program loads anyway: not worth listing as a dependency.
BASE = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libgcc_s", "libstdc++", "libpthread",
        "libdl.so", "librt.so")


def extension_of(arg: str | None, scratch: Path) -> Path:
    if arg is None:
        spec = importlib.util.find_spec("pdlib._pdlib")
        if spec is None or spec.origin is None:
            sys.exit("wheel_deps: this interpreter cannot import pdlib._pdlib (install pdlib first)")
        return Path(spec.origin)
    path = Path(arg)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            names = [n for n in wheel.namelist() if n.startswith("pdlib/_pdlib") and n.endswith(".so")]
            if not names:
                sys.exit(f"wheel_deps: {path} has no pdlib/_pdlib*.so")
            wheel.extract(names[0], scratch)
            return scratch / names[0]
    return path


def needed_of(ext: Path) -> list[str]:
    """The libraries the extension itself names (DT_NEEDED), without the ones they load."""
    if shutil.which("readelf") is None:
        return []
    out = subprocess.run(["readelf", "-d", str(ext)], capture_output=True, text=True)
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.stdout.splitlines()
            if "(NEEDED)" in line]


def package_of(lib: str) -> str:
    if shutil.which("dpkg") is None:
        return ""
    out = subprocess.run(["dpkg", "-S", lib], capture_output=True, text=True)
    if out.returncode != 0:
        # /lib and /usr/lib are one directory on Debian 12; dpkg knows one of the two names.
        alt = lib[4:] if lib.startswith("/usr/") else "/usr" + lib
        out = subprocess.run(["dpkg", "-S", alt], capture_output=True, text=True)
    return out.stdout.split(":", 1)[0] if out.returncode == 0 else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", help="a wheel, an extension .so, or nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        ext = extension_of(args.target, Path(scratch))
        out = subprocess.run(["ldd", str(ext)], capture_output=True, text=True, check=True)
        direct = set(needed_of(ext))
    rows = []
    missing = 0
    for line in out.stdout.splitlines():
        line = line.strip()
        name = line.split()[0]
        if any(name.startswith(b) for b in BASE) or "=>" not in line:
            continue
        where = line.split("=>", 1)[1].split("(")[0].strip()
        if where == "not found":
            missing += 1
            rows.append((name, "NOT FOUND on this host", "", name in direct))
        else:
            package = package_of(where) or ("the CUDA toolkit" if "cuda" in where else "?")
            rows.append((name, where, package, name in direct))
    mine = [r for r in rows if r[3]]
    print(f"{ext.name} needs at run time ({len(mine)} libraries it links, besides the C/C++ "
          f"runtime; {len(rows) - len(mine)} more that those load):")
    for name, where, package, _ in mine:
        print(f"  {name:40} {where:60} {package}")
    packages = sorted({p for _, _, p, _ in rows if p and p != "?"})
    print("Debian packages (with what those load): " + " ".join(packages))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
