"""The docs say what the code does: every EngineOptions field, environment
variable and tool flag named in configuration.md exists, and every relative
link between the docs points at a file that exists."""
import os
import re
import subprocess
import unittest

ROOT = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"])
DOCS = os.path.join(ROOT, "docs")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def section(text, title):
    start = text.index("## " + title)
    end = text.find("\n## ", start + 3)
    return text[start:end if end >= 0 else len(text)]


def first_column(table_text):
    names = []
    for line in table_text.splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if m:
            names.append(m.group(1))
    return names


class ConfigurationTest(unittest.TestCase):
    config = read("docs/configuration.md")

    def test_every_engine_option_exists(self):
        header = read("engine/transfer_engine.h")
        struct = header[header.index("struct EngineOptions {"):]
        struct = struct[:struct.index("\n};")]
        names = first_column(section(self.config, "EngineOptions"))
        self.assertGreaterEqual(len(names), 15)
        for name in names:
            self.assertRegex(struct, r"\b%s\b(\s*=[^;]*)?;" % re.escape(name), name)
        # ... and every field is documented.
        fields = re.findall(r"^\s+[\w:<>, ]+?\s(\w+)(?: = [^;]*)?;$", struct, re.M)
        for field in fields:
            self.assertIn(field, names, f"EngineOptions::{field} is not on the page")

    def test_every_environment_variable_is_read_somewhere(self):
        sources = "".join(read(p) for p in [
            "base/logging.cc", "cuda/driver.cc", "engine/peer/secret.h", "handshake/auth.h",
            "c/kvferry.cc", "python/kvferry/_lib.py", "python/kvferry/_mooncake.py",
            "python/kvferry/_nixl.py",
            "sim/seed.cc", "transport/verbs/ibv.cc",
            "tests/soak_test.cc",
            "tools/softroce/vm.sh", "transport/verbs/discovery.cc",
            "transport/verbs/verbs_conformance_test.cc"])
        names = first_column(section(self.config, "Environment variables"))
        self.assertGreaterEqual(len(names), 8)
        for name in names:
            self.assertIn(name, sources, name)

    def test_every_tool_flag_exists(self):
        rows = section(self.config, "Flags of the tools")
        checked = 0
        for line in rows.splitlines():
            m = re.match(r"\|\s*`//(\w+):(\w+)`\s*\|(.*)\|", line)
            if not m:
                continue
            binary = os.path.join(ROOT, m.group(1), m.group(2))
            out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True,
                                 timeout=60)
            text = out.stdout + out.stderr
            for flag in re.findall(r"`--(\w+)`", m.group(3)):
                self.assertIn(f"-{flag} ", text, f"{m.group(2)} has no --{flag}")
                checked += 1
        self.assertGreaterEqual(checked, 30)


class MooncakeTest(unittest.TestCase):
    def setUp(self):
        self.page = read("docs/migrating-from-mooncake.md")
        self.source = read("python/kvferry/_mooncake.py")
        self.engine = self.source[self.source.index("class TransferEngine:"):]

    def test_every_method_is_in_the_table(self):
        methods = re.findall(r"^    def ([a-z]\w*)\(", self.engine, re.M)
        self.assertGreaterEqual(len(methods), 30)
        table = section(self.page, "Every method of Mooncake's Python `TransferEngine`")
        for name in methods:
            if name.startswith("__") or name in ("get_last_error", "get_local_address"):
                continue  # kvferry's own, in python.md
            self.assertRegex(table, r"\| `%s[(`]" % name, name)

    def test_every_variable_read_is_in_the_table(self):
        known = re.search(r"_KNOWN_MC = \{(.*?)\}", self.source, re.S).group(1)
        names = re.findall(r'"(MC_\w+)"', known)
        self.assertGreaterEqual(len(names), 15)
        table = section(self.page, "Environment variables")
        for name in names:
            self.assertIn(f"`{name}`", table, name)


class NixlTest(unittest.TestCase):
    def setUp(self):
        self.page = read("docs/nixl.md")
        self.source = read("python/kvferry/_nixl.py")
        self.agent = self.source[self.source.index("class nixl_agent:"):]

    def test_every_agent_method_is_in_the_table(self):
        methods = set(re.findall(r"^    def ([a-z]\w*)\(", self.agent, re.M))
        methods |= set(re.findall(r"^    ([a-z]\w*) = _no_store$", self.agent, re.M))
        self.assertGreaterEqual(len(methods), 35)
        table = section(self.page, "The calls")
        for name in methods:
            self.assertRegex(table, r"`%s[(`]" % name, name)

    def test_every_variable_read_is_on_the_page(self):
        names = set(re.findall(r'environ\.get\("(\w+)"', self.source))
        names |= set(re.findall(r'environ\.get\("(\w+)"', read("python/kvferry/_mooncake.py"))
                     ) & {"KVFERRY_REMOTE_ACCESS", "KVFERRY_SECRET"}
        self.assertGreaterEqual(len(names), 5)
        table = section(self.page, "Running vLLM's NixlConnector and Dynamo on kvferry")
        for name in names:
            self.assertIn(f"`{name}`", table, name)


class LinksTest(unittest.TestCase):
    def test_relative_links_resolve(self):
        for name in sorted(os.listdir(DOCS)):
            if not name.endswith(".md"):
                continue
            text = read(os.path.join("docs", name))
            for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
                self.assertTrue(os.path.exists(os.path.join(DOCS, target)),
                                f"{name} links to missing {target}")


if __name__ == "__main__":
    unittest.main()
