// FAULT INJECTION ONLY: a stand-in for libcuda.so.1 that fails in chosen ways, so the GPU
// probe's failure paths (cuInit error, hung driver, failed attribute query) are tested on
// machines without a GPU. The real driver is exercised by tests/hw on the GPU machine.
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

namespace {
std::atomic<int> g_mode{0};
std::atomic<bool> g_release{false};   // mode 1: cuInit returns once this is set
std::atomic<int> g_init_returned{0};  // cuInit calls that returned since the mode was set
constexpr int kNoDevice = 100;        // CUDA_ERROR_NO_DEVICE
constexpr int kInvalidValue = 1;      // CUDA_ERROR_INVALID_VALUE
}  // namespace

extern "C" {

/// Selects the fault: 0 cuInit fails (no device), 1 cuInit hangs until
/// spark_fault_release() (at most 30 s: nothing waits forever), 2 one device whose
/// MAX_SHARED_MEMORY_PER_BLOCK_OPTIN query fails.
void spark_fault_set_mode(int mode) {
  g_release = false;
  g_init_returned = 0;
  g_mode = mode;
}
/// Ends a hang of mode 1.
void spark_fault_release() {
  g_release = true;
}
/// How many cuInit calls returned since the mode was set (a test asserts that the probe
/// gave up on a hung call that is still hung).
int spark_fault_init_returned() {
  return g_init_returned.load();
}

int cuInit(unsigned) {
  int rc = 0;
  switch (g_mode.load()) {
    case 0:
      rc = kNoDevice;
      break;
    case 1: {
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!g_release.load() && std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      rc = kNoDevice;
      break;
    }
    default:
      rc = 0;
  }
  ++g_init_returned;
  return rc;
}
int cuDriverGetVersion(int* v) {
  *v = 13000;
  return 0;
}
int cuDeviceGetCount(int* n) {
  *n = 1;
  return 0;
}
int cuDeviceGet(int* dev, int ordinal) {
  *dev = ordinal;
  return 0;
}
int cuDeviceGetName(char* name, int len, int) {
  std::strncpy(name, "Fault Injection GPU", static_cast<size_t>(len));
  return 0;
}
int cuDeviceGetAttribute(int* v, int attr, int) {
  switch (attr) {
    case 75:
      *v = 9;
      return 0;  // compute capability major
    case 76:
      *v = 0;
      return 0;  // minor
    case 16:
      *v = 132;
      return 0;  // multiprocessors
    case 18:
      *v = 0;
      return 0;  // integrated: a discrete GPU
    case 97:
      return kInvalidValue;  // shared memory opt-in: the injected failure
    default:
      return kInvalidValue;
  }
}
int cuDeviceTotalMem_v2(unsigned long* bytes, int) {
  *bytes = 1ul << 30;
  return 0;
}
int cuGetErrorName(int r, const char** s) {
  *s = r == kNoDevice       ? "CUDA_ERROR_NO_DEVICE"
       : r == kInvalidValue ? "CUDA_ERROR_INVALID_VALUE"
                            : "CUDA_ERROR_UNKNOWN";
  return 0;
}
int cuGetErrorString(int r, const char** s) {
  *s = r == kNoDevice ? "no CUDA-capable device is detected" : "invalid argument";
  return 0;
}

}  // extern "C"
