#include "transport/id_window.h"

#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry {
namespace transport {
namespace {

// Against std::map as the model: random adds and erases (mostly oldest
// first, some out of order, some of ids never given or already gone).
TEST(IdWindow, BehavesLikeAMapOfSequentialIds) {
  IdWindow<int> w;
  std::map<uint64_t, int> model;
  std::mt19937_64 rng(7);
  uint64_t next = 0;
  for (int step = 0; step < 20000; ++step) {
    const int what = rng() % 10;
    if (what < 5) {
      const int v = static_cast<int>(rng() % 1000);
      ASSERT_EQ(w.Add(v), next);
      model[next++] = v;
    } else if (what < 8 && !model.empty()) {
      const uint64_t id = model.begin()->first;  // the oldest
      ASSERT_TRUE(w.Erase(id));
      model.erase(id);
    } else {
      const uint64_t id = next == 0 ? 0 : rng() % (next + 3);
      ASSERT_EQ(w.Erase(id), model.erase(id) == 1) << id;
    }
    ASSERT_EQ(w.size(), model.size());
    if (!model.empty()) ASSERT_EQ(w.first(), model.begin()->first);
    const uint64_t probe = rng() % (next + 2);
    int* found = w.Find(probe);
    auto it = model.find(probe);
    ASSERT_EQ(found != nullptr, it != model.end()) << probe;
    if (found != nullptr) ASSERT_EQ(*found, it->second);
  }
  std::vector<std::pair<uint64_t, int>> seen;
  w.ForEach([&](uint64_t id, int v) { seen.emplace_back(id, v); });
  const std::vector<std::pair<uint64_t, int>> want(model.begin(), model.end());
  EXPECT_EQ(seen, want);
  w.Clear();
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(w.Find(next - 1), nullptr);
  EXPECT_EQ(w.Add(5), next);  // ids go on
}

}  // namespace
}  // namespace transport
}  // namespace kvferry
