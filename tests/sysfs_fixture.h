// Materializes a sysfs fixture manifest (tests/fixtures/sysfs/*.tree) into a
// directory, with real directories, files and symlinks. Returns the root;
// the sysfs root is <root>/sys and the /dev root <root>/dev.
#ifndef KVFERRY_TESTS_SYSFS_FIXTURE_H_
#define KVFERRY_TESTS_SYSFS_FIXTURE_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvferry {

inline absl::StatusOr<std::string> MaterializeSysfs(const std::string& manifest,
                                                    const std::string& name) {
  namespace fs = std::filesystem;
  const char* tmp = std::getenv("TEST_TMPDIR");
  const fs::path root = fs::path(tmp != nullptr ? tmp : "/tmp") / ("sysfs-" + name);
  std::error_code ec;
  fs::remove_all(root, ec);
  std::ifstream in(manifest);
  if (!in) return absl::NotFoundError(absl::StrCat("no fixture manifest ", manifest));
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t a = line.find(' ');
    const std::string kind = line.substr(0, a);
    const std::string rest = a == std::string::npos ? "" : line.substr(a + 1);
    const size_t b = rest.find(' ');
    const fs::path path = root / rest.substr(0, b);
    const std::string arg = b == std::string::npos ? "" : rest.substr(b + 1);
    fs::create_directories(kind == "dir" ? path : path.parent_path(), ec);
    if (kind == "file") {
      std::ofstream(path) << arg << "\n";
    } else if (kind == "link") {
      fs::create_symlink(arg, path, ec);
      if (ec) return absl::InternalError(absl::StrCat("symlink ", path.string(), ": ", ec.message()));
    } else if (kind != "dir") {
      return absl::DataLossError(absl::StrCat("bad manifest line: ", line));
    }
  }
  return root.string();
}

}  // namespace kvferry

#endif  // KVFERRY_TESTS_SYSFS_FIXTURE_H_
