#!/usr/bin/env python3
"""Sums the test cases of one or more Bazel runs.

Usage: test_summary.py [--gtest_log=LOG ...] BEP_JSON [BEP_JSON ...]

Each argument is a file written by `bazel test --build_event_json_file=FILE`.
Only the test.xml files named in those files are read (the latest attempt of
each test shard), never stale files under bazel-testlogs. A test target that
was expected to run but produced no test.xml (it failed to build, or Bazel
gave up) counts as one failed case, so a broken build can never look green.

--gtest_log=LOG adds the cases of GoogleTest binaries whose console output
is in LOG (e.g. tests run inside the Soft-RoCE VM): every "[       OK ]"
line is a pass, every "[  FAILED  ] name (N ms)" result line a failure,
every "[  SKIPPED ]" result line a skip. A log with no result line at all
counts as one failure.

Prints one line: "N passed, N failed, N skipped". Exits 1 if anything failed.
Before it, on stderr, each failure: the target, the step (the build-event
file's name) and, from its test.xml, the failed cases with the first lines of
their messages, so that a log's tail tells what failed where.
"""
import re

import json
import os
import sys
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET


def xml_counts(path):
    """Returns (passed, failed, skipped) for one JUnit XML file."""
    passed = failed = skipped = 0
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif (case.find("skipped") is not None
              or case.get("result") == "skipped"
              or case.get("status") == "notrun"):
            skipped += 1
        else:
            passed += 1
    if passed + failed + skipped == 0:
        # A test binary that wrote no cases: judge the whole file.
        errors = sum(int(s.get("failures", 0)) + int(s.get("errors", 0))
                     for s in root.iter("testsuite"))
        if errors or root.get("failures", "0") != "0":
            failed = 1
    return passed, failed, skipped


MAX_CASES = 5  # failures shown per target
MAX_LINES = 8  # lines of each failure message shown
MAX_CHARS = 400  # characters of each line shown


def xml_failures(path):
    """Returns ["Suite.case: first lines of one failure's message", ...]."""
    shown = []
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return shown
    for suite in root.iter("testsuite"):
        for case in suite.iter("testcase"):
            name = f"{suite.get('name', '?')}.{case.get('name', '?')}"
            for bad in list(case.iter("failure")) + list(case.iter("error")):
                text = bad.get("message") or bad.text or ""
                lines = [line.strip()[:MAX_CHARS] for line in text.splitlines()
                         if line.strip()]
                shown.append(f"{name}: " + "; ".join(lines[:MAX_LINES]))
    return shown


def file_path(uri):
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("", "file"):
        return None
    return urllib.request.url2pathname(parsed.path)


def summarize(bep_path):
    """Returns (passed, failed, skipped, problems) for one BEP JSON file."""
    latest = {}  # (label, run, shard) -> (attempt, xml path or None, status)
    expected = set()  # test labels Bazel meant to run
    tags = {}  # test label -> its tags
    tag_filters = []  # --test_tag_filters of the command
    summaries = {}  # label -> overall status
    with open(bep_path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            event = json.loads(line)
            eid = event.get("id", {})
            if "testResult" in eid:
                tid = eid["testResult"]
                key = (tid.get("label"), tid.get("run", 1), tid.get("shard", 1))
                attempt = tid.get("attempt", 1)
                result = event.get("testResult", {})
                xml = None
                for out in result.get("testActionOutput", []):
                    if out.get("name") == "test.xml":
                        xml = file_path(out.get("uri", ""))
                if key not in latest or attempt >= latest[key][0]:
                    latest[key] = (attempt, xml, result.get("status", ""))
            elif "testSummary" in eid:
                summaries[eid["testSummary"].get("label")] = (
                    event.get("testSummary", {}).get("overallStatus", ""))
            elif "targetConfigured" in eid:
                kind = event.get("configured", {}).get("targetKind", "")
                if kind.endswith(" test") or kind.endswith("_test rule"):
                    label = eid["targetConfigured"].get("label")
                    expected.add(label)
                    tags[label] = set(event.get("configured", {}).get("tag", []))
            elif "optionsParsed" in eid:
                for arg in event.get("optionsParsed", {}).get("cmdLine", []):
                    if arg.startswith("--test_tag_filters="):
                        tag_filters = [t for t in arg.split("=", 1)[1].split(",") if t]
    # Tests --test_tag_filters leaves out were never meant to run.
    excluded = {t[1:] for t in tag_filters if t.startswith("-")}
    required = {t for t in tag_filters if not t.startswith("-")}
    expected = {label for label in expected
                if not (tags.get(label, set()) & excluded)
                and (not required or tags.get(label, set()) & required)}
    passed = failed = skipped = 0
    problems = []
    ran = set()
    for (label, _, _), (_, xml, status) in sorted(latest.items()):
        ran.add(label)
        if xml is None:
            if status in ("PASSED", "FLAKY"):
                passed += 1
            else:
                failed += 1
                problems.append(f"{label}: {status or 'no result'}")
            continue
        p, fl, s = xml_counts(xml)
        if fl == 0 and status not in ("PASSED", "FLAKY", ""):
            fl = 1  # Bazel saw a failure the XML does not show (e.g. a crash)
        passed, failed, skipped = passed + p, failed + fl, skipped + s
        if fl:
            problems.append(f"{label}: {fl} failed case(s)")
            cases = xml_failures(xml)
            problems.extend(f"    {c}" for c in cases[:MAX_CASES])
            if len(cases) > MAX_CASES:
                problems.append(f"    ... and {len(cases) - MAX_CASES} more failure(s)")
    for label in sorted(expected - ran):
        failed += 1
        status = summaries.get(label, "no result")
        problems.append(f"{label}: did not run ({status})")
    return passed, failed, skipped, problems


def gtest_log_counts(path):
    """Returns (passed, failed, skipped) from GoogleTest console output."""
    passed = failed = skipped = 0
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = ansi.sub("", raw)
            if line.startswith("[       OK ]"):
                passed += 1
            elif re.match(r"\[  FAILED  \] \S+.* \(\d+ ms\)", line):
                failed += 1
            elif re.match(r"\[  SKIPPED \] \S+.* \(\d+ ms\)", line):
                skipped += 1
    if passed + failed + skipped == 0:
        failed = 1
    return passed, failed, skipped


def main(argv):
    logs = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--gtest_log=")]
    beps = [a for a in argv[1:] if not a.startswith("--gtest_log=")]
    if not beps and not logs:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    total = [0, 0, 0]
    for path in logs:
        try:
            p, f, s = gtest_log_counts(path)
        except OSError as err:
            print(f"test_summary: cannot read {path}: {err}", file=sys.stderr)
            p, f, s = 0, 1, 0
        if f:
            print(f"  FAILED {path}: {f} failed case(s)", file=sys.stderr)
        total = [total[0] + p, total[1] + f, total[2] + s]
    for path in beps:
        try:
            p, f, s, problems = summarize(path)
        except (OSError, ValueError, ET.ParseError) as err:
            print(f"test_summary: cannot read {path}: {err}", file=sys.stderr)
            p, f, s, problems = 0, 1, 0, [f"{path}: unreadable"]
        step = os.path.splitext(os.path.basename(path))[0]
        for problem in problems:
            if problem.startswith("    "):
                print(problem, file=sys.stderr)
            else:
                print(f"  FAILED ({step}) {problem}", file=sys.stderr)
        total = [total[0] + p, total[1] + f, total[2] + s]
    print(f"{total[0]} passed, {total[1]} failed, {total[2]} skipped")
    return 1 if total[1] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
