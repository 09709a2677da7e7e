"""Tests for test_summary.py on synthetic build-event files."""

import json
import os
import tempfile
import unittest

import test_summary


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


CASES_XML = """<?xml version="1.0"?>
<testsuites><testsuite name="A">
<testcase name="ok" status="run" result="completed"/>
<testcase name="bad" status="run" result="completed"><failure message="x"/></testcase>
<testcase name="skip" status="run" result="skipped"><skipped/></testcase>
</testsuite></testsuites>
"""


class SummaryTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp()

    def event(self, **kw):
        return json.dumps(kw)

    def bep(self, events):
        path = os.path.join(self.dir, "bep.json")
        write(path, "\n".join(events) + "\n")
        return path

    def configured(self, label, kind="cc_test rule"):
        return self.event(id={"targetConfigured": {"label": label}},
                          configured={"targetKind": kind})

    def result(self, label, attempt, xml, status):
        outputs = [{"name": "test.xml", "uri": "file://" + xml}] if xml else []
        return self.event(
            id={"testResult": {"label": label, "run": 1, "shard": 1,
                               "attempt": attempt}},
            testResult={"status": status, "testActionOutput": outputs})

    def test_counts_cases_and_uses_latest_attempt(self):
        stale = os.path.join(self.dir, "stale.xml")
        write(stale, CASES_XML.replace('result="skipped"><skipped/>', '>'
                                       '<failure/>'))
        fresh = os.path.join(self.dir, "fresh.xml")
        write(fresh, CASES_XML)
        path = self.bep([
            self.configured("//a:t"),
            self.result("//a:t", 1, stale, "FAILED"),
            self.result("//a:t", 2, fresh, "FAILED"),
        ])
        passed, failed, skipped, problems = test_summary.summarize(path)
        self.assertEqual((passed, failed, skipped), (1, 1, 1))
        self.assertEqual(problems, ["//a:t: 1 failed case(s)", "    A.bad: x"])

    def test_failed_cases_are_named_with_their_message(self):
        xml = os.path.join(self.dir, "bad.xml")
        write(xml, '<testsuites><testsuite name="Soak">'
                   '<testcase name="ok"/>'
                   '<testcase name="Kill"><failure message="soak_test.cc:203&#x0A;'
                   'Expected equality&#x0A;  restart_failures: 1"/></testcase>'
                   '</testsuite></testsuites>')
        path = self.bep([self.configured("//a:t"),
                         self.result("//a:t", 1, xml, "FAILED")])
        passed, failed, skipped, problems = test_summary.summarize(path)
        self.assertEqual((passed, failed, skipped), (1, 1, 0))
        self.assertEqual(problems, [
            "//a:t: 1 failed case(s)",
            "    Soak.Kill: soak_test.cc:203; Expected equality; restart_failures: 1"])

    def test_target_that_never_ran_is_a_failure(self):
        path = self.bep([self.configured("//a:t"),
                         self.configured("//a:lib", "cc_library rule")])
        passed, failed, skipped, problems = test_summary.summarize(path)
        self.assertEqual((passed, failed, skipped), (0, 1, 0))
        self.assertIn("//a:t", problems[0])

    def test_tests_left_out_by_tag_filters_are_not_expected(self):
        path = self.bep([
            self.event(id={"optionsParsed": {}},
                       optionsParsed={"cmdLine": ["--test_tag_filters=-no_asan"]}),
            self.event(id={"targetConfigured": {"label": "//a:py"}},
                       configured={"targetKind": "py_test rule", "tag": ["no_asan"]}),
            self.configured("//a:t"),
        ])
        passed, failed, skipped, problems = test_summary.summarize(path)
        self.assertEqual((passed, failed, skipped), (0, 1, 0))
        self.assertEqual(len(problems), 1)
        self.assertIn("//a:t", problems[0])

    def test_bazel_failure_without_failing_case_counts(self):
        xml = os.path.join(self.dir, "ok.xml")
        write(xml, '<testsuites><testsuite><testcase name="a"/></testsuite>'
                   '</testsuites>')
        path = self.bep([self.configured("//a:t"),
                         self.result("//a:t", 1, xml, "TIMEOUT")])
        self.assertEqual(test_summary.summarize(path)[:3], (1, 1, 0))

    def test_gtest_console_logs_count(self):
        log = os.path.join(self.dir, "vm.log")
        write(log, "\x1b[0;32m[       OK ] \x1b[mA.B (3 ms)\n"
                   "[       OK ] A.C (1 ms)\n"
                   "[  FAILED  ] A.D, where GetParam() = x (5 ms)\n"
                   "[  FAILED  ] A.D, where GetParam() = x\n"
                   "[  SKIPPED ] A.E (0 ms)\n")
        self.assertEqual(test_summary.gtest_log_counts(log), (2, 1, 1))
        empty = os.path.join(self.dir, "empty.log")
        write(empty, "kernel panic\n")
        self.assertEqual(test_summary.gtest_log_counts(empty), (0, 1, 0))

    def test_main_prints_one_line_and_exit_code(self):
        xml = os.path.join(self.dir, "ok.xml")
        write(xml, '<testsuites><testsuite><testcase name="a"/></testsuite>'
                   '</testsuites>')
        path = self.bep([self.configured("//a:t"),
                         self.result("//a:t", 1, xml, "PASSED")])
        self.assertEqual(test_summary.main(["x", path]), 0)
        self.assertEqual(test_summary.main(["x", os.path.join(self.dir, "none")]), 1)


if __name__ == "__main__":
    unittest.main()
