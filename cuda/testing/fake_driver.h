// Points cuda::Driver at the fake driver library (//cuda/testing:
// libfakecuda.so, which the test must list in its data) before the driver
// is first used. Returns the loaded driver, or null with a test failure.
#ifndef KVFERRY_CUDA_TESTING_FAKE_DRIVER_H_
#define KVFERRY_CUDA_TESTING_FAKE_DRIVER_H_

#include "cuda/driver.h"

namespace kvferry {
namespace cuda {

const Driver* UseFakeDriver();

}  // namespace cuda
}  // namespace kvferry

#endif  // KVFERRY_CUDA_TESTING_FAKE_DRIVER_H_
