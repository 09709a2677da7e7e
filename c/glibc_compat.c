/* GCC 12's static libstdc++ calls arc4random (GLIBC_2.36) from
 * std::random_device. libkvferry.so carries its own, hidden, over
 * getrandom(2) (GLIBC_2.25), so that the library runs on glibc 2.34. */
#include <stdint.h>
#include <sys/random.h>

__attribute__((visibility("hidden"))) uint32_t arc4random(void) {
  uint32_t v = 0;
  while (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
  }
  return v;
}
