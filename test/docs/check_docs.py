"""Checks that the repository's Markdown documents point only at what the repository has:
every relative link [text](path) names a tracked file or directory, and no document refers to a
path on the machine it was written on (/work/..., ../shared/...).

    python3 test/docs/check_docs.py <repository root>

Prints every bad reference (file:line: what) and exits 1 if there is one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"(?<![\w.])(/work/\S+|\.\./shared/\S*)")


def main() -> int:
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    files = subprocess.run(["git", "-C", root, "ls-files", "*.md"], capture_output=True,
                           text=True, check=True).stdout.split()
    if not files:
        print("check_docs: no Markdown files found under", root)
        return 1
    bad = []
    for rel in files:
        path = os.path.join(root, rel)
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for target in LINK.findall(line):
                    if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                        continue  # a URL or an anchor in the same file
                    where = os.path.normpath(os.path.join(os.path.dirname(path),
                                                          target.split("#")[0]))
                    if not where.startswith(root + os.sep) or not os.path.exists(where):
                        bad.append(f"{rel}:{n}: link to {target}, which is not in the repository")
                for outside in OUTSIDE.findall(line):
                    bad.append(f"{rel}:{n}: refers to {outside}, outside the repository")
    for line in bad:
        print(line)
    print(f"check_docs: {len(files)} documents, {len(bad)} bad references")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
