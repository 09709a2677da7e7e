"""libkvferry.so exports exactly the functions c/kvferry.h declares, all in
the version script, and nothing else (no C++ or Abseil symbol leaks)."""
import re
import subprocess
import sys
import unittest

HEADER, SCRIPT, LIBRARY = sys.argv[1:4]
del sys.argv[1:4]


def declared():
    text = open(HEADER).read()
    return set(re.findall(r"^[a-z][a-z0-9_ *]*?\b(kvferry_[a-z0-9_]+)\(", text, re.M))


def scripted():
    text = re.sub(r"/\*.*?\*/", "", open(SCRIPT).read(), flags=re.S)
    block = text.split("global:")[1].split("local:")[0]
    return {n.strip() for n in block.split(";") if n.strip()}


def exported():
    out = subprocess.run(["nm", "-D", "--defined-only", LIBRARY], check=True,
                         capture_output=True, text=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        # Upper case: global; "u": GNU unique (global too). Lower case are
        # local entries the linker keeps for TLS relocations: not bindable.
        if len(parts) == 3 and (parts[1].isupper() or parts[1] == "u") and parts[1] != "A":
            names.add(parts[2].split("@")[0])
    return names


class ExportedSymbols(unittest.TestCase):
    def test_header_and_version_script_agree(self):
        self.assertEqual(declared(), scripted())
        self.assertGreater(len(declared()), 50)

    def test_library_exports_exactly_the_header(self):
        self.assertEqual(exported(), declared())


if __name__ == "__main__":
    unittest.main()
