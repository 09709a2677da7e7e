#!/usr/bin/env python3
"""Runs Python unittest files and prints one GoogleTest-style line per case
([       OK ], [  FAILED  ], [  SKIPPED ]) so that tools/test_summary.py can
count them. Exits 1 when a case failed.

    pyunit_gtest.py [--prefix=NAME] [--only=CLASS.METHOD]... TEST_FILE.py...

--only runs just the named cases (all when none is named); a name that
matches no case is an error.

Each file is imported from its own path (its directory first on sys.path),
as `python3 TEST_FILE.py` would run it.
"""
import importlib.util
import os
import sys
import time
import unittest


class GtestResult(unittest.TextTestResult):
    def __init__(self, prefix, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefix = prefix
        self.started = 0.0

    def _name(self, test):
        cls = type(test).__name__
        return f"{self.prefix}{cls}.{getattr(test, '_testMethodName', str(test))}"

    def _line(self, tag, test):
        ms = int((time.monotonic() - self.started) * 1000)
        print(f"[{tag}] {self._name(test)} ({ms} ms)", flush=True)

    def startTest(self, test):
        super().startTest(test)
        self.started = time.monotonic()
        print(f"[ RUN      ] {self._name(test)}", flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._line("       OK ", test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        print(self._exc_info_to_string(err, test), flush=True)
        self._line("  FAILED  ", test)

    def addError(self, test, err):
        super().addError(test, err)
        print(self._exc_info_to_string(err, test), flush=True)
        self._line("  FAILED  ", test)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        print(f"skipped: {reason}", flush=True)
        self._line("  SKIPPED ", test)


def _cases(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _cases(t)
        else:
            yield t


def main(argv):
    prefix = ""
    files, only = [], []
    for arg in argv[1:]:
        if arg.startswith("--prefix="):
            prefix = arg.split("=", 1)[1] + "."
        elif arg.startswith("--only="):
            only.append(arg.split("=", 1)[1])
        else:
            files.append(arg)
    if not files:
        print(__doc__, file=sys.stderr)
        return 2
    suite = unittest.TestSuite()
    for path in files:
        path = os.path.abspath(path)
        sys.path.insert(0, os.path.dirname(path))
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        suite.addTests(unittest.defaultTestLoader.loadTestsFromModule(module))
    if only:
        chosen = [t for t in _cases(suite)
                  if f"{type(t).__name__}.{getattr(t, '_testMethodName', '')}" in only]
        found = {f"{type(t).__name__}.{t._testMethodName}" for t in chosen}
        missing = [name for name in only if name not in found]
        if missing:
            print(f"pyunit_gtest: no case named {', '.join(missing)}", file=sys.stderr)
            return 2
        suite = unittest.TestSuite(chosen)
    runner = unittest.TextTestRunner(
        stream=open(os.devnull, "w"), verbosity=0,
        resultclass=lambda *a, **k: GtestResult(prefix, *a, **k))
    result = runner.run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
